"""Chapter 9: `gather` finds the learner's parts in my_parts/, and the capstone serves the model with them.

The parts modules are made the way a `%%part` cell makes them (`save_part`): from the instructor
notebooks' build-exercise cells, and, for a part whose chapter has no such cell, from the correct
parts written outside the package in tests/test_parts.py.
"""

import inspect
import re
import sys
from pathlib import Path

import nbformat
import pytest

import kvlearn.kernels
from kvlearn import Engine
from kvlearn.exercises import NOT_YET
from kvlearn.exercises.parts import BUILD, gather, gather_parts, parts_for, parts_label, parts_table, save_part
from kvlearn.workshop.mutants import worked_solutions
from tests import test_parts
from tests.kernel_variants import kernel_copy

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
CAPSTONE = "09_your_engine.ipynb"
HEADER = ("import torch\n\nfrom kvlearn import KVCapacityError, Sequence\n"
          "from kvlearn.parts import AllocatorBase, BlockManagerBase, RadixCacheBase\n"
          "from kvlearn.radix import MatchResult\n\n\n")


def stand_in(name: str, class_name: str | None = None) -> str:
    """A module holding tests/test_parts.py's correct part `name`, its class named `class_name`."""
    source = inspect.getsource(test_parts.MINE[name])
    if class_name:
        source = re.sub(r"^class \w+", f"class {class_name}", source)
    return HEADER + source


def solutions(folder: Path) -> set[str]:
    """Write the instructor solutions as my_parts/ modules in `folder`; returns the parts written."""
    modules = {name: stand_in(name) for name in test_parts.MINE} | worked_solutions()
    for name, source in modules.items():
        save_part(name, source, folder / "my_parts")
    return set(modules)


# --- gather ------------------------------------------------------------------------------------

@pytest.mark.slow   # 10 s or more: `make quick` leaves it out
def test_gather_says_what_is_yours_missing_or_failing(tmp_path, capsys):
    folder = tmp_path / "my_parts"
    save_part("allocator", stand_in("allocator"), folder)
    save_part("radix_cache", "class MyRadixCache:\n    pass", folder)
    save_part("block_manager", "from my_parts.block_table import MyBlockTable\n\n\n"
                               "class MyBlockManager(MyBlockTable):\n    pass", folder)
    save_part("attention", "def my_paged_attention(:\n    pass", folder)
    save_part("scheduler", "class Scheduler:\n    pass", folder)

    parts = gather(folder)
    out = capsys.readouterr().out
    assert parts == {"allocator": sys.modules["my_parts.allocator"].MyAllocator}
    rows = {r.name: r for r in gather_parts(folder)}
    assert list(rows) == [name for name in BUILD if name not in ("decode_kernel", "quantizer")] == [
        "block_table", "block_manager", "radix_cache", "allocator", "attention", "scheduler"]   # no kernel saved
    assert {name: r.verdict for name, r in rows.items()} == {
        "block_table": "missing", "block_manager": "fails check", "radix_cache": "fails check",
        "allocator": "yours", "attention": "fails check", "scheduler": "fails check"}
    assert rows["block_table"].note == "no my_parts/block_table.py: run chapter 1's %%part block_table cell"
    assert "ModuleNotFoundError: No module named 'my_parts.block_table'" in rows["block_manager"].note
    assert rows["radix_cache"].note.startswith("MyRadixCache lacks ") and "match_prefix" in rows["radix_cache"].note
    assert "SyntaxError" in rows["attention"].note and "(attention.py, line 1)" in rows["attention"].note
    assert rows["scheduler"].note == "scheduler.py defines no MyScheduler"
    assert "meets the allocator contract" in rows["allocator"].note
    assert "1 of 6 parts pass" in out
    assert "\nallocator      yours: in both engines\n" in out
    assert "\nblock_table    the package's: yours is missing\n" in out
    assert "\nattention      the package's: yours has not passed check yet\n" in out
    assert NOT_YET not in out   # the course counts "Not yet:" as an exercise's verdict: the table is none
    assert out.count("\n") == 1 + 6 + 1 + 1 + 6 + 1
    assert capsys.readouterr().out == ""
    gather(folder)
    assert capsys.readouterr().out == out   # the same table every time (nbval)


def label(model, tokenizer, cache: str, parts: dict, backend: str = "auto") -> str:
    """The bench label of the engine chapter 9 builds for `cache` from the gathered `parts`."""
    return parts_label(Engine(model, tokenizer, cache=cache, num_slots=64, attention_backend=backend,
                              parts=parts_for(cache, parts, backend)))


def test_a_part_may_build_on_an_earlier_one_and_every_passing_part_is_returned(tmp_path, capsys, model, tokenizer):
    folder = tmp_path / "my_parts"
    save_part("block_table", stand_in("block_manager", "MyBlockTable"), folder)
    save_part("block_manager", "from my_parts.block_table import MyBlockTable\n\n\n"
                               "class MyBlockManager(MyBlockTable):\n    pass", folder)
    save_part("radix_cache", stand_in("radix_cache"), folder)
    save_part("allocator", stand_in("allocator"), folder)
    parts = gather(folder)
    assert {name: cls.__name__ for name, cls in parts.items()} == {
        "block_manager": "MyBlockManager", "radix_cache": "MyRadixCache", "allocator": "MyAllocator"}
    assert parts["block_manager"].__mro__[1].__module__ == "my_parts.block_table"
    assert parts_for("radix", parts) == {"radix_cache": parts["radix_cache"], "allocator": parts["allocator"]}
    assert parts_for("blocks", parts) == {"block_manager": parts["block_manager"], "allocator": parts["allocator"]}
    assert parts_for("none", parts) == {"allocator": parts["allocator"]}
    out = capsys.readouterr().out
    assert "\nblock_table    yours: inside your block_manager, in the blocks engine\n" in out
    assert label(model, tokenizer, "blocks", parts) == "blocks, your block_table, block_manager, allocator"
    assert label(model, tokenizer, "radix", parts) == "radix, your radix_cache, allocator"


def test_the_summary_says_what_serves_with_only_a_block_table_and_attention_written(tmp_path, capsys, model,
                                                                                   tokenizer):
    """A block table passes its check but never serves alone (only inside a block manager); the
    attention serves in both engines; each bench row is named by the parts of yours it used."""
    folder = tmp_path / "my_parts"
    written = worked_solutions()
    for name in ("block_table", "attention"):
        save_part(name, written[name], folder)
    parts = gather(folder)
    out = capsys.readouterr().out
    assert "2 of 6 parts pass" in out and list(parts) == ["attention"]
    said = out.split("What serves:\n", 1)[1].splitlines()
    assert said[:6] == [
        "block_table    the package's: your block_table serves only inside a block manager: write chapter 2's "
        "block_manager (it builds on yours) to use it",
        "block_manager  the package's: yours is missing",
        "radix_cache    the package's: yours is missing",
        "allocator      the package's: yours is missing",
        "attention      yours: in both engines",
        "scheduler      the package's: yours is missing"]
    assert label(model, tokenizer, "radix", parts) == "radix, your attention"
    assert label(model, tokenizer, "blocks", parts) == "blocks, your attention"
    assert label(model, tokenizer, "radix", {}) == "radix, the package's parts"
    save_part("scheduler", written["scheduler"], tmp_path / "more" / "my_parts")
    everything = parts | gather(tmp_path / "more" / "my_parts") | {
        name: test_parts.MINE[name] for name in ("radix_cache", "allocator")}
    assert label(model, tokenizer, "radix", everything) == "radix, all your parts"


@pytest.mark.skipif(kvlearn.kernels.triton_import_error() is not None, reason="Triton has no wheels here")
def test_a_label_names_only_the_parts_its_engine_ran(tmp_path, model, tokenizer):
    """With only a decode kernel written, an engine with torch attention serves none of yours, and says so;
    the engine with the Triton backend serves your kernel, and says that."""
    parts = {"decode_kernel": kernel_copy(tmp_path)}
    assert label(model, tokenizer, "radix", parts) == "radix, the package's parts"
    assert label(model, tokenizer, "blocks", parts) == "blocks, the package's parts"
    assert label(model, tokenizer, "radix", parts, "triton") == "radix, your decode_kernel"


def test_gather_reads_the_files_afresh(tmp_path, capsys):
    folder = tmp_path / "my_parts"
    save_part("allocator", "class MyAllocator:\n    pass", folder)
    assert gather(folder) == {}
    save_part("allocator", stand_in("allocator"), folder)   # the cell fixed and run again
    assert list(gather(folder)) == ["allocator"]
    other = tmp_path / "elsewhere" / "my_parts"              # another folder of the same name
    save_part("allocator", "class MyAllocator:\n    pass", other)
    assert gather(other) == {}
    assert sys.modules["my_parts"].__path__ == [str(other.resolve())]


def test_the_parts_table_as_markdown(tmp_path):
    rows = gather_parts(tmp_path / "my_parts")   # no folder at all: every part is missing
    lines = parts_table(rows, markdown=True).splitlines()
    assert lines[0] == "| part | chapter | verdict | what check said |" and lines[1].startswith("| --- |")
    assert lines[2].startswith("| block_table | 1 | missing | no my_parts/block_table.py")
    assert lines[-1] == "0 of 6 parts pass"


def test_a_folder_whose_name_is_not_a_package_is_refused(tmp_path):
    with pytest.raises(ValueError, match="identifier"):
        gather_parts(tmp_path / "my-parts")


# --- the capstone notebook -----------------------------------------------------------------------

def test_the_capstone_has_no_solution_to_strip_and_opens_like_every_chapter():
    nb = nbformat.read(NOTEBOOKS / CAPSTONE, as_version=4)
    assert nb.cells[0].source.startswith("# Chapter 9")
    assert "**By the end of this chapter you can**" in nb.cells[1].source and "```text" in nb.cells[1].source
    assert "SOLUTION" not in "".join(c.source for c in nb.cells)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for needed in ("gather()", 'cache="radix"', 'cache="blocks"', "hf.outputs", "unique_token_floor",
                   "evict_all()", "table("):
        assert needed in code, needed


@pytest.mark.thorough   # chapter 9's student copy already runs under nbval, with its verdicts
@pytest.mark.parametrize("parts", ["instructor solutions", "none written yet"])
def test_the_student_capstone_serves_the_model(tmp_path, parts):
    """The student copy of chapter 9 runs top to bottom: with every skeleton filled with the
    instructor's solution, all of them pass and serve; with no part written, the package's serve."""
    from kvlearn.workshop.course import run_notebook
    from kvlearn.workshop.student import write_student_copies

    student = tmp_path / "student"
    write_student_copies(NOTEBOOKS, student)
    # chapter 10: after the capstone
    written = solutions(student) - {"quantizer"} if parts == "instructor solutions" else set()
    nb = nbformat.read(student / CAPSTONE, as_version=4)
    run = run_notebook(student / CAPSTONE, nb=nb)
    assert run.passed, run.error
    shown = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    verdicts = {r.name: r.verdict for r in gather_parts(student / "my_parts")}
    assert {name for name, verdict in verdicts.items() if verdict != "missing"} == written
    assert all(verdicts[name] == "yours" for name in written), verdicts
    passing = sum(v == "yours" for v in verdicts.values())
    assert f"{passing} of {len(verdicts)} parts pass" in shown
    if written:
        assert "radix tree: your MyRadixCache | page allocator: your MyAllocator" in shown
        assert "block manager: your MyBlockManager | page allocator: your MyAllocator" in shown
    else:
        assert "radix tree: the package's RadixCache | page allocator: the package's PageAllocator" in shown
    # the radix and blocks engines, and with the instructor's kernel the Triton engine that serves it
    assert shown.count("same tokens as generate: True") == 2 + ("decode_kernel" in written)
    if "decode_kernel" in written:
        assert "attention backend: triton | parts of yours it serves: radix_cache, allocator, decode_kernel" in shown
    else:
        assert "No decode_kernel of yours passed its check yet" in shown
    assert shown.count("free slots after evict_all: 2048 of 2048") == 2


def test_a_result_of_the_package_stand_in_says_whose_it_is():
    from kvlearn.attention import paged_attention
    from kvlearn.exercises.parts import credit

    def my_paged_attention(*args):
        return paged_attention(*args)

    assert credit("attention", paged_attention, "same tokens as generate: True") == (
        "the package's attention: same tokens as generate: True; yours has not passed check_part('attention', ...) yet")
    assert credit("attention", my_paged_attention, "same tokens as generate: True") == \
        "your attention: same tokens as generate: True"
