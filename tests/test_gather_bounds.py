"""`gather` and `earlier_part` are bounded: whatever a part's module does at import (loop, sleep, exit,
build on itself, change the check), the table comes back within the limits, says what happened, and
credits the learner only with the class their module defines and that passed. Each reproducer runs
with a small import limit."""

import os
import time

import pytest

from kvlearn.exercises.part_modules import CHAIN_VARIABLE, MAX_PART_BYTES
from kvlearn.exercises.parts import earlier_part, gather, gather_parts, save_part
from kvlearn.parts import PARTS
from tests.test_capstone import stand_in

LIMIT_S = 2   # the import limit in these tests; a check of a small part takes well under a second


def rows(folder, **options):
    return {r.name: r for r in gather_parts(folder, import_limit_s=LIMIT_S, **options)}


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@pytest.mark.parametrize("source", ["while True:\n    pass", "import time\ntime.sleep(1000)"])
def test_a_module_that_loops_or_sleeps_at_import_fails_within_the_limit(tmp_path, source):
    folder = tmp_path / "my_parts"
    save_part("block_table", source, folder)
    save_part("allocator", stand_in("allocator"), folder)
    start = time.monotonic()
    found = rows(folder)
    assert time.monotonic() - start < 60   # the limit is 2 s; starting the check's Python may take a while
    assert found["block_table"].verdict == "fails check"
    assert found["block_table"].note.startswith(f"importing block_table.py did not finish within {LIMIT_S} s")
    assert found["allocator"].verdict == "yours"   # the parts after it are still checked


@pytest.mark.parametrize("source, says", [
    ("raise SystemExit(3)", "importing block_table.py raised SystemExit: 3"),
    ("raise KeyboardInterrupt", "importing block_table.py raised KeyboardInterrupt"),
    ("raise GeneratorExit('bye')", "importing block_table.py raised GeneratorExit: bye"),
    ("import os\nos._exit(7)", "Python ended (exit status 7) while importing block_table.py"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
     "Python ended (signal 11, SIGSEGV: a read or write outside the process's memory"),
])
@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_a_module_that_exits_at_import_is_a_row_of_the_table(tmp_path, capsys, source, says):
    folder = tmp_path / "my_parts"
    save_part("block_table", source, folder)
    save_part("allocator", stand_in("allocator"), folder)
    parts = gather(folder, import_limit_s=LIMIT_S)
    out = capsys.readouterr().out
    assert list(parts) == ["allocator"] and "1 of 6 parts pass" in out
    assert says in rows(folder)["block_table"].note


def test_what_is_not_a_part_file_is_said_not_missing(tmp_path):
    folder = tmp_path / "my_parts"
    folder.mkdir()
    (folder / "block_table.py").mkdir()
    os.symlink("/dev/zero", folder / "radix_cache.py")
    (folder / "allocator.py").write_text("# a part's cell\n" * (MAX_PART_BYTES // 10))
    (folder / "attention.py").write_bytes(b"x = '\xff'\n")
    found = rows(folder)
    assert {name: r.verdict for name, r in found.items() if name != "block_manager"} == {
        "block_table": "fails check", "radix_cache": "fails check", "allocator": "fails check",
        "attention": "fails check", "scheduler": "missing"}
    assert found["block_table"].note.startswith("my_parts/block_table.py is a directory, not a file")
    assert found["radix_cache"].note.startswith("my_parts/radix_cache.py is a device, pipe or socket, not a file")
    assert found["allocator"].note.startswith(f"my_parts/allocator.py is over {MAX_PART_BYTES:,} bytes")
    assert found["attention"].note.startswith("my_parts/attention.py is not UTF-8 text")


def test_a_part_that_builds_on_itself_is_refused_at_once(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "my_parts"
    save_part("block_table", "from kvlearn.exercises.parts import earlier_part\n\n"
                             "MyBlockTable = earlier_part('block_table', 'MyBlockTable')", folder)
    start = time.monotonic()
    note = rows(folder)["block_table"].note
    assert time.monotonic() - start < 60
    assert note.startswith("importing block_table.py raised RuntimeError: earlier_part('block_table', "
                           "'MyBlockTable') inside the block_table part itself")
    assert "never on itself" in note
    monkeypatch.chdir(tmp_path)   # a later part building on it gets the package's, saying why
    assert earlier_part("block_table", "MyBlockTable", import_limit_s=LIMIT_S) is PARTS["block_table"]
    assert "never on itself" in capsys.readouterr().out


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_yours_only_for_the_class_the_module_defines_and_that_was_checked(tmp_path):
    folder = tmp_path / "my_parts"
    save_part("block_table", "from kvlearn.parts import PARTS\n\nMyBlockTable = PARTS['block_table']", folder)
    rebinds = stand_in("allocator").replace("        super().__init__(", "        globals()['MyAllocator'] = "
                                            "PageAllocator\n        super().__init__(", 1)
    assert rebinds != stand_in("allocator")
    save_part("allocator", "from kvlearn.allocator import PageAllocator\n" + rebinds, folder)
    save_part("radix_cache", "import os\n" + stand_in("radix_cache") + "\n\n\nclass Other(MyRadixCache):\n"
              "    pass\n\n\n"
              f"if {CHAIN_VARIABLE!r} not in os.environ:   # not where it is checked\n"
              "    MyRadixCache = Other\n", folder)
    found = rows(folder)
    assert {name: r.verdict for name, r in found.items()} == {
        "block_table": "fails check", "block_manager": "missing", "radix_cache": "fails check",
        "allocator": "fails check", "attention": "missing", "scheduler": "missing"}
    assert found["block_table"].note == ("MyBlockTable in block_table.py is kvlearn.blocks.BlockManager, not a "
                                         "class or function block_table.py defines")
    assert found["allocator"].note.startswith("allocator.py rebound MyAllocator while it was checked")
    assert found["radix_cache"].note == ("MyRadixCache in radix_cache.py is Other here, "
                                         "but MyRadixCache where it was checked")
    assert all(r.impl is None for r in found.values())


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_a_part_that_changes_the_check_fails_and_changes_no_other_part(tmp_path):
    folder = tmp_path / "my_parts"
    save_part("block_table", "import kvlearn.parts\nfrom kvlearn.parts import conformance\n\n"
                             "def passes(name, impl, **options):\n"
                             "    return conformance.CheckReport(name, 'x', True, 'it meets the contract')\n\n\n"
                             "kvlearn.parts.check = conformance.check = passes\n"
                             "conformance._run = lambda *args: ('ok', None, conformance.Trace())\n\n\n"
                             "class MyBlockTable:\n    pass", folder)
    save_part("radix_cache", "class MyRadixCache:\n    pass", folder)   # wrong: must still fail
    save_part("allocator", stand_in("allocator"), folder)
    found = rows(folder)
    assert (found["block_table"].verdict == "fails check" and
            "a part may not change kvlearn" in found["block_table"].note)
    assert "kvlearn.parts.conformance.check" in found["block_table"].note
    assert found["radix_cache"].verdict == "fails check" and "lacks" in found["radix_cache"].note
    assert found["allocator"].verdict == "yours"


def test_the_import_limit_must_be_a_finite_positive_number(tmp_path):
    save_part("allocator", stand_in("allocator"), tmp_path / "my_parts")
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="import_limit_s"):
            gather_parts(tmp_path / "my_parts", import_limit_s=bad)
