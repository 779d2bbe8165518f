"""Build exercises (`%%part NAME` cells): the instructor's solution passes `kvlearn.parts.check`, the
student's skeleton fails it with "Not yet" and never raises, and a later part grows from an earlier
one (`earlier_part`) whether or not the earlier one is done.

Part cells run here the way the notebooks run them, in chapter order in one folder: each is saved as
my_parts/NAME.py (`save_part`, what `%%part` does) and executed; the class checked is the one the
notebook hands to `check_part`.
"""

import re
from pathlib import Path

import nbformat
import pytest

from kvlearn.errors import KVCapacityError
from kvlearn.exercises import NOT_YET, OK
from kvlearn.exercises.parts import check_part, earlier_part, save_part
from kvlearn.parts import PARTS, check
from kvlearn.workshop.student import student_copy

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PART = re.compile(r"\A%%part (\w+)\n")
CHECKED = re.compile(r'check_part\("(\w+)", (\w+)\)')


def part_cells(nb) -> list[tuple[str, str, str]]:
    """(part name, the class check_part gets, the cell's Python) of every part cell, in order."""
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    found = []
    for i, source in enumerate(code):
        if m := PART.match(source):
            checked = next(CHECKED.search(s) for s in code[i + 1:] if CHECKED.search(s))
            assert checked.group(1) == m.group(1), f"%%part {m.group(1)} is checked as {checked.group(1)}"
            found.append((m.group(1), checked.group(2), source[m.end():]))
    return found


def run_parts(version: str) -> list[tuple[str, object]]:
    """Save and run every part cell of the chapters (instructor or student version) in order, in the
    current folder; returns (part name, the class or function check_part gets)."""
    parts = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for name, cls, body in part_cells(student_copy(nb) if version == "student" else nb):
            namespace = {}
            # the saved file's own path: Triton reads a kernel's source through it (the same relative
            # name in two tests' folders would hand a student's kernel the instructor's source)
            exec(compile(body, str(save_part(name, body).resolve()), "exec"), namespace)
            parts.append((name, namespace[cls]))
    return parts


def test_chapters_1_and_2_have_their_build_exercises():
    found = {name: cls for path in NOTEBOOKS[:3] for name, cls, _ in part_cells(nbformat.read(path, as_version=4))}
    assert found == {"block_table": "MyBlockTable", "block_manager": "MyBlockManager"}


@pytest.mark.thorough   # each chapter's check_part says OK under nbval; test_referee_holes.py too
def test_instructor_solutions_pass_check(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    parts = run_parts("instructor")
    assert parts
    for name, impl in parts:
        package = PARTS[name]
        assert impl is not package and not (isinstance(impl, type) and issubclass(impl, package)), \
            f"{name}: a part never is, nor inherits, the package's finished one"
        report = check(name, impl)
        assert report.passed, report.message
    assert "(building on your MyBlockTable from my_parts/block_table.py" in capsys.readouterr().out


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_student_skeletons_say_not_yet_and_never_raise(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    parts = run_parts("student")
    assert parts and (tmp_path / "my_parts" / "block_table.py").exists()
    out = capsys.readouterr().out
    # chapter 2 grows from the package's block table while chapter 1's skeleton does not pass
    assert "(building on the package's BlockManager: MyBlockTable does not meet the block_table contract" in out
    for name, impl in parts:
        assert check_part(name, impl) is False
        out = capsys.readouterr().out
        assert out.startswith(NOT_YET) and OK not in out and "Hint:" in out, out


def test_chapter_2_runs_where_chapter_1_never_did(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(next(p for p in NOTEBOOKS if p.name.startswith("02_")), as_version=4)
    (name, cls, body), = part_cells(nb)
    namespace = {}
    exec(body, namespace)
    assert namespace["MyBlockTable"] is PARTS["block_table"]
    assert "no my_parts/block_table.py: run chapter 1's %%part block_table cell" in capsys.readouterr().out
    assert check(name, namespace[cls]).passed   # chapter 2's own methods, on the package's block table


BUGGY_TABLE = '''
from kvlearn.blocks import BlockManager
class MyBlockTable(BlockManager):
    def slot_mapping(self, seq, start, end, device=None):
        return super().slot_mapping(seq, start, end, device) + 1   # off by one
'''


@pytest.mark.parametrize("source, says", [
    (None, "no my_parts/block_table.py"),
    ("raise RuntimeError('half-typed')", "raised RuntimeError: half-typed"),
    ("x = 1", "defines no MyBlockTable"),
    (BUGGY_TABLE, "MyBlockTable does not meet the block_table contract"),
])
def test_earlier_part_is_the_package_s_until_yours_passes(tmp_path, monkeypatch, capsys, source, says):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        save_part("block_table", source)
    assert earlier_part("block_table", "MyBlockTable") is PARTS["block_table"]
    out = capsys.readouterr().out
    assert out.startswith("(building on the package's BlockManager: ") and says in out, out


def test_earlier_part_reads_the_file_afresh(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_part("block_table", BUGGY_TABLE)
    assert earlier_part("block_table", "MyBlockTable") is PARTS["block_table"]
    save_part("block_table", BUGGY_TABLE.replace(" + 1   # off by one", ""))   # fixed, the cell run again
    mine = earlier_part("block_table", "MyBlockTable")
    assert mine is not PARTS["block_table"] and mine.__name__ == "MyBlockTable"
    assert "it passes check_part('block_table', ...)" in capsys.readouterr().out


def new_blocks_first(base):
    class NewBlocksFirst(base):   # evicts for new KV before the hits leave cached_blocks
        def allocate(self, seq):
            self.check_new(seq)
            hit = self.lookup(seq.token_ids)
            if self.blocks_needed(seq, hit) > self.num_free_blocks:
                raise KVCapacityError("no room")
            new = self.new_blocks(seq.num_blocks - len(hit))
            for block_id in hit:
                self.cached_blocks.pop(block_id, None)
                self.blocks[block_id].ref_count += 1
            seq.block_table[:] = hit + new
            seq.num_cached_tokens = len(hit) * self.block_size
            self.live_seqs.add(seq.seq_id)
            self.count_hits(seq)
    return NewBlocksFirst


def chapter_2_wrong_turns(solution):
    """The usual wrong turns of chapter 2's build exercise (docs/instructor.md), each one change to
    the instructor's `MyBlockManager`."""

    class NoFullHit(solution):   # the block holding the last token may hit
        def lookup(self, token_ids):
            return super().lookup(list(token_ids) + [None])

    class HitsAreFree(solution):   # a hit on a cached block still leaves the free list
        def blocks_needed(self, seq, hit):
            return seq.num_blocks - len(hit)

    NewBlocksFirst = new_blocks_first(solution)   # evicts for new KV before the hits leave cached_blocks

    class PublishesAtAllocate(solution):   # before the KV is computed
        def allocate(self, seq):
            super().allocate(seq)
            self.hash_blocks(seq)

    class MostRecentlyFreed(solution):   # evicts the newest cached block, not the oldest
        def new_blocks(self, n):
            fresh = min(n, self.allocator.num_free)
            taken = self.allocator.alloc(fresh).tolist()
            for _ in range(n - fresh):
                block_id, _ = self.cached_blocks.popitem()
                self.forget(self.blocks[block_id])
                self.stats.evicted_blocks += 1
                taken.append(block_id)
            for block_id in taken:
                self.blocks[block_id].ref_count = 1
            return taken

    return [(NoFullHit, "m.num_cached_prefix(s2): expected 0"), (HitsAreFree, "m.can_allocate(s4): expected False"),
            (NewBlocksFirst, "which are in use"), (PublishesAtAllocate, "m.hash_blocks(s1, 7): expected 2, got 0"),
            (MostRecentlyFreed, "which was freed earlier")]


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_chapter_2_wrong_turns_fail_check_with_a_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solution = dict(run_parts("instructor"))["block_manager"]
    for bug, says in chapter_2_wrong_turns(solution):
        report = check("block_manager", bug)
        assert not report.passed and says in report.message and "Hint:" in report.message, (bug, report.message)
