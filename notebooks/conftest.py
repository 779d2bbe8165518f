"""nbval over the chapters, then each chapter's student copy in the same kernel.

Pictures (SVG, PNG) and stderr (progress bars, library warnings) are not compared.

A student copy (kvlearn.workshop.student) is the instructor notebook, byte for byte, up to its first
solved cell, so running each copy in a kernel of its own would repeat all that work. Instead, after
nbval's last cell of a chapter, its kernel moves to a folder of student copies (with figures/ of its
own, as `make student` lays them out; %%part cells save my_parts/ there) and runs the copy's
code cells from the first solved one on, as items "student Cell N" (N counted as nbval counts):
each must run without error, and one that kept the instructor's outputs must show them again
(strictly, as nbval compares). Those cells bind every name that the instructor's cells from the
same point on bound (a stub binds what its solution did), so they read the copy's values, not the
solutions'. Then the item "student verdicts" asserts what a learner meets: every checker says "Not
yet" (two or more per chapter, the capstone aside), each build exercise's skeleton is saved and
its check_part says "Not yet", the cells that drive a part run on the package's (`use` says so,
and so does each verdict line that `credit` words), and, after the last chapter of a unit, no part
saved in my_parts/ passes. The chapters run in two units (tests/units.py), each in order in one
process: chapter 9 reads the parts that chapters 1-6 saved, so they share one. After each unit's
last chapter, "tracked files unchanged": the instructor notebooks wrote their figures into a copy,
the student copies into theirs, and `git status` lists what it listed before.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nbval.plugin import IPyNbCell, IPyNbFile, find_comment_markers, find_metadata_tags

from tests.units import notebook_unit

CAPSTONE = "09"
# Chapters whose student copy meets no checker: the capstone has no exercise of its own.
WITHOUT_CHECKERS = {CAPSTONE}
CHAPTER = re.compile(r"\d\d_\w+\.ipynb")
PART_CELL = re.compile(r"\A%%part (\w+)\n")
USES_A_PART = re.compile(r"\buse\(")
CREDITS = re.compile(r"\bcredit\(")
FOLDER = pytest.StashKey[tempfile.TemporaryDirectory]()
SNAPSHOT = pytest.StashKey[tuple]()    # (changed_files() before the first notebook ran, KVLEARN_FIGURES then)
FIGURES_VARIABLE = "KVLEARN_FIGURES"   # where kvlearn.viz.plots.figures_dir() writes, when set
ROOT = Path(__file__).resolve().parents[1]


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("image/svg+xml", "text/html", "stderr")


def student_folder(config: pytest.Config) -> Path:
    """This session's folder of student copies, laid out as `make student` lays out student/: with
    its own figures/ (`copy_figures`), and inside the clone (under build/, which git ignores), so a
    copy that wrote into the course's figures/ would show in "tracked files unchanged"."""
    if FOLDER not in config.stash:
        from kvlearn.workshop.student import copy_figures

        (ROOT / "build").mkdir(exist_ok=True)
        config.stash[FOLDER] = tempfile.TemporaryDirectory(prefix="kvlearn-student-", dir=ROOT / "build")
        root = Path(config.stash[FOLDER].name)
        (root / "student").mkdir()
        (root / "instructor").mkdir()
        copy_figures(ROOT / "figures", root / "student" / "figures")
        copy_figures(ROOT / "figures", root / "instructor" / "figures")
    return Path(config.stash[FOLDER].name) / "student"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the first notebook's kernel starts: the instructor notebooks write their figures into a
    copy (KVLEARN_FIGURES, which the kernels inherit), not the course's figures/, and the clone's
    changed files are noted for "tracked files unchanged"."""
    if isinstance(item, IPyNbCell) and SNAPSHOT not in item.config.stash:
        item.config.stash[SNAPSHOT] = (changed_files(), os.environ.get(FIGURES_VARIABLE))
        os.environ[FIGURES_VARIABLE] = str(student_folder(item.config).parent / "instructor" / "figures")


def pytest_unconfigure(config):
    if SNAPSHOT in config.stash:
        _, figures = config.stash[SNAPSHOT]
        if figures is None:
            os.environ.pop(FIGURES_VARIABLE, None)
        else:
            os.environ[FIGURES_VARIABLE] = figures
    if FOLDER in config.stash:
        config.stash[FOLDER].cleanup()


def changed_files() -> dict[str, str] | None:
    """What `git status` lists in the clone (changed, and untracked but not ignored), each file with
    its status and a hash of its bytes; None without git or a clone."""
    try:
        listed = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=all"], cwd=ROOT,
                                capture_output=True, check=True, timeout=120).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError):
        return None
    entries, found = iter(listed.split("\0")), {}
    for entry in entries:
        if entry:
            status, path = entry[:2], entry[3:]
            if status[0] in "RC":   # a rename or copy: its source path follows
                next(entries, None)
            file = ROOT / path
            found[path] = status + (" " + hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else "")
    return found


class TrackedFilesUnchanged(pytest.Item):
    """After every chapter and its student copy ran: `git status` lists what it listed before (a run
    that wrote into figures/ or notebooks/, or left a file there, would show)."""

    def runtest(self):
        before, _ = self.config.stash.get(SNAPSHOT, (None, None))
        after = changed_files()
        if before is None or after is None:
            pytest.skip("no git clone here: cannot tell whether the notebooks changed tracked files")
        changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
        assert not changed, (f"running the notebooks and their student copies changed {changed}: a notebook writes "
                             "figures only through kvlearn.viz.plots.figures_dir(), and a student copy into "
                             "student/figures/")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, AssertionError):
            return f"tracked files unchanged: {excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.path.relative_to(self.config.rootpath)}::{self.name}"


@dataclass
class StudentRun:
    """One chapter's student copy as its items run it. `first`: nbval's number of its first solved
    code cell; `ran`: (source, outputs) of each code cell that ran clean, by nbval's number."""

    chapter: str
    first: int
    cells: list[int]                                          # the numbers of the cells run here
    teacher_items: list[IPyNbCell]                            # nbval's items before `first`
    ran: dict[int, tuple[str, list]] = field(default_factory=dict)


class StudentCell(IPyNbCell):
    """A code cell of the student copy, run in the chapter's kernel after nbval's cells."""

    def __init__(self, *args, run: StudentRun, **kwargs):
        super().__init__(*args, **kwargs)
        self.run = run

    def runtest(self):
        if self.cell_num == self.run.first:   # the copy's first cell: the kernel moves to its folder
            kernel = self.parent.kernel
            folder = str(student_folder(self.config))
            moves = f"import os; os.chdir({folder!r}); os.environ.pop({FIGURES_VARIABLE!r}, None)"
            msg_id = kernel.execute_cell_input(moves, allow_stdin=False)
            kernel.await_reply(msg_id, timeout=60)
            kernel.await_idle(msg_id, timeout=60)
        super().runtest()
        self.run.ran[self.cell_num] = (self.cell.source, self.test_outputs)

    def reportinfo(self):
        return self.fspath, 0, f"{self.fspath.relto(self.config.rootdir)}::student Cell {self.cell_num}"


class StudentVerdicts(pytest.Item):
    """What a learner meets in the chapter's student copy (see the module docstring)."""

    def __init__(self, *args, run: StudentRun, runs: list[StudentRun] | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.run, self.runs = run, runs   # runs: every chapter's, for the last chapter only

    def runtest(self):
        from kvlearn.exercises import NOT_YET, OK
        from kvlearn.exercises.parts import gather_parts

        run, folder = self.run, student_folder(self.config)
        failed = [n for n in run.cells if n not in run.ran]
        assert not failed, f"student Cells {failed} did not run clean (their own items say why)"
        cells = [(item.cell.source, item.test_outputs or []) for item in run.teacher_items]
        cells += [run.ran[n] for n in run.cells]
        shown = [(source, "".join(o.get("text", "") for o in outs if o.get("output_type") == "stream"))
                 for source, outs in cells]
        verdicts = [(source, text) for source, text in shown if OK in text or NOT_YET in text]
        assert not [text for _, text in verdicts if OK in text], "an exercise of the student copy is solved"
        if run.chapter not in WITHOUT_CHECKERS:
            assert len(verdicts) >= 2, f"{len(verdicts)} checkers answered; every chapter has 2 or more"
        for source, _ in cells:
            part = PART_CELL.match(source)
            if part:
                name, body = part[1], source[part.end():]
                saved = folder / "my_parts" / f"{name}.py"
                assert saved.read_text().startswith(body.rstrip("\n")), f"{saved} is not the skeleton"
                assert any(f'check_part("{name}"' in s for s, _ in verdicts), f"no check_part({name!r}) said Not yet"
        if any(USES_A_PART.search(source) for source, _ in cells):
            assert any("(using the package's" in text for _, text in shown), "use() did not fall back"
        for source, text in shown:   # a result of the package's stand-in says so on its own line
            if CREDITS.search(source):
                assert "the package's" in text and "yours has not passed" in text, \
                    f"credit() hid the stand-in: {text!r}"
        if self.runs is not None:   # the parts that every chapter run in this process saved
            written = {PART_CELL.match(source)[1] for r in self.runs for source, _ in r.ran.values()
                       if PART_CELL.match(source)}
            rows = gather_parts(folder / "my_parts")
            assert [r.verdict for r in rows] == ["fails check" if r.name in written else "missing" for r in rows], rows

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, AssertionError):   # the message says it all; pytest's frames do not
            return f"student verdicts: {excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.path.relative_to(self.config.rootpath)}::{self.name}"


def pytest_collection_modifyitems(session, config, items):
    """Each chapter's student items right after nbval's last cell of it, in the same kernel."""
    chapters = defaultdict(list)   # IPyNbFile -> its nbval items, in order
    for item in items:
        if isinstance(item, IPyNbCell) and CHAPTER.fullmatch(item.path.name):
            chapters[item.parent].append(item)
    runs, units = [], [notebook_unit(nbfile.path.name) for nbfile in chapters]
    for number, (nbfile, teacher_items) in enumerate(chapters.items()):
        at = items.index(teacher_items[-1]) + 1
        items[at:at] = student_items(nbfile, teacher_items, runs, last=units[number] not in units[number + 1:])


def student_items(nbfile: IPyNbFile, teacher_items: list[IPyNbCell], runs: list[StudentRun], last: bool) -> list:
    """The items that run `nbfile`'s student copy: its code cells from the first solved one on,
    then its verdicts (which, for the `last` chapter of its unit, also judge the parts that the
    `runs` of this process saved, and are followed by "tracked files unchanged").
    Appends the chapter's StudentRun to `runs`."""
    from kvlearn.workshop.student import solved_cells, student_copy

    nb = nbfile.nb
    code = [number for number, cell in enumerate(nb.cells, 1) if cell.cell_type == "code"]
    solved = solved_cells(nb)
    first = code.index(solved[0]) if solved else len(code)
    copy = [cell for cell in student_copy(nb).cells if cell.cell_type == "code"]
    run = StudentRun(nbfile.path.name[:2], first, list(range(first, len(copy))),
                     [item for item in teacher_items if item.cell_num < first])
    runs.append(run)
    items = []
    for number in run.cells:
        cell = copy[number]
        options = defaultdict(bool, find_metadata_tags(cell.metadata))
        options.update(find_comment_markers(cell.source))
        options.setdefault("check", nbfile.compare_outputs)
        items.append(StudentCell.from_parent(nbfile, name=f"student Cell {number}", cell_num=number, cell=cell,
                                             options=options, run=run))
    verdicts = StudentVerdicts.from_parent(nbfile, name="student verdicts", run=run, runs=runs if last else None)
    tracked = [TrackedFilesUnchanged.from_parent(nbfile, name="tracked files unchanged")] if last else []
    return items + [verdicts] + tracked
