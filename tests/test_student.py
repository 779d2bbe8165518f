"""Student copies: every solution is gone, and so is every output a solution produced (verdicts,
cells that read a part's results); the rest is the instructor's notebook byte for byte, and every
checker answers a stub with "Not yet" instead of crashing."""

import copy
import json
import re
from pathlib import Path

import nbformat
import pytest

from kvlearn.exercises import NOT_YET, OK, ch00, ch01, ch02, ch03, ch04, ch05, ch06
from kvlearn.workshop.student import BEGIN, END, solved_cells, student_copy, write_student_copies

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
CHAPTERS = sorted(p.name[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CHECKERS = {f"{i:02d}": module for i, module in enumerate((ch00, ch01, ch02, ch03, ch04, ch05, ch06))}
VERDICTS = ("OK, well done", "meets the", "parts pass", "yours", "passed")
# Written by hand, apart from the rule in kvlearn.workshop.student: per chapter, the names that hold
# a learner's part or what the chapter computed with it. A code cell that mentions one of them, calls
# the parts kit, is a %%part cell or holds a solution shows a solution's work in the instructor copy.
SOLVED_NAMES = {
    "01": ["MyBlockTable", "Table", "mine"],
    "02": ["MyBlockManager", "Manager", "mine"],
    "03": ["MyRadixCache", "story", "yours"],
    "04": ["MyAllocator", "serve"],
    "05": ["my_paged_attention", "served", "my_decode_kernel", "decode_part", "kernel_tokens", "reads"],
    "06": ["MyScheduler", "mine", "my_reports"],
    "09": ["parts", "radix", "blocks", "yours_radix", "yours_blocks"],
    "10": ["MyQuantizer", "quantizer", "yours"],
}
KIT_CALL = re.compile(r"\b(check_part|use|earlier_part|gather|gather_parts)\(|\A%%part ")


def shows_solved_work(chapter: str, source: str) -> bool:
    names = SOLVED_NAMES.get(chapter)
    return bool(BEGIN in source or KIT_CALL.search(source)
                or names and re.search(rf"(?<![\w.])({'|'.join(names)})\b", source))


def solution_lines(source: str) -> list[str]:
    """The non-trivial lines inside the solution blocks of a cell, stripped."""
    blocks = re.findall(rf"^[ \t]*{BEGIN}\n(.*?)^[ \t]*{END}$", source, flags=re.S | re.M)
    return [s for b in blocks for s in map(str.strip, b.splitlines()) if len(s) > 3 and s != "return None"]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """chapter -> (instructor notebook, its student copy as write_student_copies wrote it); the
    instructor notebooks' files are the same bytes after the copies were written."""
    dest = tmp_path_factory.mktemp("student")
    before = {p.name: p.read_bytes() for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    paths = write_student_copies(NOTEBOOKS, dest)
    assert [p.name for p in paths] == sorted(before)
    assert {p.name: p.read_bytes() for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")} == before
    return {p.name[:2]: (nbformat.read(NOTEBOOKS / p.name, as_version=4), nbformat.read(p, as_version=4))
            for p in paths}


def shown_lines(cell) -> set[str]:
    """The stripped lines of a cell's source and of its outputs' text."""
    texts = [cell.source] + [o.get("text", "") + "\n".join(map(str, o.get("data", {}).values()))
                             for o in cell.get("outputs", [])]
    return {line.strip() for text in texts for line in text.splitlines()}


@pytest.mark.parametrize("chapter", sorted(CHECKERS))
def test_solutions_are_stubbed(copies, chapter):
    teacher, student = copies[chapter]
    secrets, given = set(), set()
    for t in teacher.cells:
        secrets.update(solution_lines(t.source) if t.cell_type == "code" else [])
        if t.cell_type == "code" and BEGIN not in t.source and not t.source.startswith("%%part"):
            given.update(line.strip() for line in t.source.splitlines())   # code the chapter gives (chapter 5's
    secrets -= given                                                        # one_program has `m = m_new` too)
    assert secrets, f"chapter {chapter} has no solution block"
    everything = json.dumps(student.cells)
    assert "BEGIN SOLUTION" not in everything and "END SOLUTION" not in everything
    left = secrets & set().union(*map(shown_lines, student.cells))
    assert not left, f"solution lines left in the student copy: {sorted(left)}"
    before = copy.deepcopy(teacher)
    student_copy(teacher)
    assert teacher == before, "student_copy changed the instructor notebook"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_copy_shows_nothing_solved_and_the_rest_is_unchanged(copies, chapter):
    """No verdict anywhere in the copy; every cell that shows a solution's work (by SOLVED_NAMES,
    not by the module's rule) has no output; every other cell is the instructor's, byte for byte."""
    teacher, student = copies[chapter]
    assert len(student.cells) == len(teacher.cells) and student.metadata == teacher.metadata
    shown = json.dumps([c.get("outputs", []) for c in teacher.cells])
    assert OK in shown or "parts pass" in shown, "the instructor copy shows its verdicts"
    cleared = []
    for number, (t, s) in enumerate(zip(teacher.cells, student.cells, strict=True), 1):
        if t.cell_type == "code" and shows_solved_work(chapter, t.source):
            assert s.outputs == [] and s.execution_count is None, f"cell {number} shows solved work"
            cleared.append(number)
        else:
            assert json.dumps(s, sort_keys=True) == json.dumps(t, sort_keys=True), f"cell {number} changed"
    assert cleared == solved_cells(teacher)
    outputs = json.dumps([c.get("outputs", []) for c in student.cells])
    assert not [v for v in VERDICTS if v in outputs]
    if chapter in SOLVED_NAMES:   # a cell after the stub that reads what it computed
        assert len(cleared) > sum(BEGIN in c.source or c.source.startswith("%%part") for c in teacher.cells)


def test_the_rule_follows_names_through_cells():
    sources = [
        "import torch\nx, rows = 1, [1, 2]",                            # 1 clean
        "def total():\n    return sum(mine)",                           # 2 clean: mine is not solved yet
        "%%part radix_cache\nimport torch\n\nclass MyRadixCache:\n    pass",  # 3 a build exercise
        "mine = MyRadixCache()\nr = s = t = e = mine",                  # 4 reads the part
        "print(torch.ones(1), x)",                                      # 5 a solved cell's imports do not count
        "for r in rows:\n    print(r)\n[s for s in rows]",              # 6 solved names bound anew, then read
        "print(total())",                                               # 7 total reads mine when called
        "n = 0\nn += len(mine)",                                        # 8 reads mine
        "print(n)",                                                     # 9 reads what 8 computed
        "n = 5\nprint(n)",                                              # 10 bound again, by an unsolved cell
        "print(n)",                                                     # 11 clean again
        "from kvlearn.exercises.parts import use\nA = use('x', x)",     # 12 a call of the parts kit
        "f = lambda: A\nprint(f())",                                    # 13 a lambda reads A
        "%load_ext kvlearn.exercises.parts\nprint(x)",                  # 14 a magic line is left out
        "for item in t:\n    pass",                                     # 15 a loop over a solved name
        "t = str(t)",                                                   # 16 the value is read before t is bound
        "def g(t=t):\n    return 1",                                    # 17 a default is read when defined
        "def h(t):\n    return t\nprint(h(2))",                         # 18 a parameter is not the solved t
        "t += '!'",                                                     # 19 reads t
        "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    print(e)",  # 20 e bound anew
        "k = lambda t: t\nprint(k(1))",                                 # 21 a parameter again
        "{s: s for s in rows}",                                         # 22 s is the comprehension's
        "import math as t\nprint(t.pi)",                                # 23 an import binds t anew
        "from math import pi as s\nprint(s, t)",                        # 24 and s
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("uses MyRadixCache")]
                                  + [nbformat.v4.new_code_cell(s) for s in sources])
    for number, cell in enumerate(nb.cells[1:], 1):
        cell.outputs, cell.execution_count = [nbformat.v4.new_output("stream", text=f"{number}\n")], number
    solved = [n - 1 for n in solved_cells(nb)]
    assert solved == [3, 4, 7, 8, 9, 12, 13, 15, 16, 17, 19]
    copied = student_copy(nb)
    for number, (t, s) in enumerate(zip(nb.cells[1:], copied.cells[1:], strict=True), 1):
        assert (s.outputs, s.execution_count) == (([], None) if number in solved else (t.outputs, number))
    assert copied.cells[0] == nb.cells[0]


def test_a_code_cell_that_is_not_python_is_named():
    with pytest.raises(ValueError, match="cell 2: not Python"):
        student_copy(_notebook("x = 0", "print(x"))


@pytest.mark.parametrize("chapter", sorted(CHECKERS))
def without_part_magic(source: str) -> str:
    """A build exercise's cell as the Python it runs: without its first line, `%%part NAME`."""
    return re.sub(r"\A%%part \w+\n", "", source)


@pytest.mark.parametrize("chapter", sorted(CHECKERS))
def test_every_checker_says_not_yet_to_its_stub(copies, chapter, capsys, tmp_path, monkeypatch):
    """Run the student copy's exercise cells: each checker gets the stub a student starts from.
    (The build exercises' checks: tests/test_build_exercises.py.)"""
    monkeypatch.chdir(tmp_path)   # a part that reads an earlier one (my_parts/) finds none
    module = CHECKERS[chapter]
    names = sorted(n for n in vars(module) if n.startswith("check_"))
    _, student = copies[chapter]
    cells = [c.source for c in student.cells if c.cell_type == "code" and "your " in c.source]
    namespace = {}
    for source in cells:
        exec(without_part_magic(source), namespace)
    called = sorted(n for n in names if any(f".{n}(" in source for source in cells))
    assert called == names, "every checker is called from an exercise cell"
    out = capsys.readouterr().out
    assert out.count(NOT_YET) == len(names) and OK not in out


def _notebook(*sources):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def test_stubs():
    nb = _notebook(f"def f(x):\n    y = 1\n    {BEGIN}\n    return x + y\n    {END}\n\nf(1)",
                   f"{BEGIN}\nanswer = [4,\n          8]  # two lines\nother = 3\n{END}\ncheck(answer)")
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="OK")]
    nb.cells[0].execution_count = 1
    first, second = student_copy(nb).cells
    assert first.source == "def f(x):\n    y = 1\n    ...  # your code here\n\nf(1)"
    assert first.outputs == [] and first.execution_count is None
    assert second.source == "answer = ...  # your answer here\nother = ...  # your answer here\ncheck(answer)"


@pytest.mark.parametrize("source, message", [
    (f"{BEGIN}\nx = 1", "without an"),
    (f"x = 1\n{END}", "without a"),
    (f"def f():\n    {BEGIN}\n    {BEGIN}\n    return 1\n    {END}\n    {END}", "nested"),
    (f"{BEGIN}\nprint(42)\n{END}", "only assignments"),
    (f"{BEGIN}\na, b = 1, 2\n{END}", "only assignments"),
])
def test_authoring_errors_name_the_cell(source, message):
    with pytest.raises(ValueError, match=rf"cell 2: .*{message}"):
        student_copy(_notebook("x = 0", source))


def test_write_student_copies_refuses_to_overwrite_the_source():
    with pytest.raises(ValueError, match="overwrite"):
        write_student_copies(NOTEBOOKS, NOTEBOOKS)


@pytest.fixture
def one_chapter(tmp_path):
    """A src folder with one instructor notebook holding a solution, and an empty dest next to it."""
    src = tmp_path / "notebooks"
    src.mkdir()
    nbformat.write(_notebook(f"{BEGIN}\nanswer = 42\n{END}"), src / "00_x.ipynb")
    return src, tmp_path / "student"


@pytest.mark.parametrize("kind", ["link to the instructor notebook", "dangling link"])
def test_a_copy_path_that_is_a_link_is_refused_and_nothing_is_written(one_chapter, kind, capsys):
    src, dest = one_chapter
    nbformat.write(_notebook(f"{BEGIN}\nanswer = 1\n{END}"), src / "01_y.ipynb")
    dest.mkdir()
    outside = src.parent / "anywhere.ipynb"
    target = src / "01_y.ipynb" if kind.startswith("link") else outside
    (dest / "01_y.ipynb").symlink_to(target)
    before = (src / "01_y.ipynb").read_bytes()
    with pytest.raises(ValueError, match=r"01_y\.ipynb is a symbolic link"):
        write_student_copies(src, dest)
    assert (src / "01_y.ipynb").read_bytes() == before and not outside.exists()
    assert sorted(p.name for p in dest.iterdir()) == ["01_y.ipynb"]  # 00_x was not written either
    from kvlearn.__main__ import main

    assert main(["student", "--src", str(src), "--dest", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "symbolic link" in err and str(dest / "01_y.ipynb") in err


def test_a_dest_folder_that_is_a_link_is_refused(one_chapter):
    src, dest = one_chapter
    elsewhere = src.parent / "elsewhere"
    elsewhere.mkdir()
    dest.symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symbolic link"):
        write_student_copies(src, dest)
    assert list(elsewhere.iterdir()) == []


def test_a_hard_link_is_replaced_not_written_through(one_chapter):
    src, dest = one_chapter
    dest.mkdir()
    (dest / "00_x.ipynb").hardlink_to(src / "00_x.ipynb")
    before = (src / "00_x.ipynb").read_bytes()
    write_student_copies(src, dest)
    assert (src / "00_x.ipynb").read_bytes() == before
    assert "answer = ...  # your answer here" in (dest / "00_x.ipynb").read_text()
    assert sorted(p.name for p in dest.iterdir()) == ["00_x.ipynb", "figures"]  # no temporary file left


def test_the_copies_write_their_figures_under_dest_never_into_the_course(one_chapter, monkeypatch):
    """A copy's cells write figures where `figures_dir()` finds them from dest: dest/figures, a copy of
    the course's (so a cell that shows a committed figure finds it), not the course's figures/."""
    from kvlearn.viz.plots import figures_dir, save_figure

    monkeypatch.delenv("KVLEARN_FIGURES", raising=False)   # set while make test runs the notebooks

    src, dest = one_chapter
    course = src.parent / "figures"
    course.mkdir()
    (course / "bench_shared_system.png").write_bytes(b"committed")
    write_student_copies(src, dest)
    assert figures_dir(dest) == dest / "figures"
    assert (dest / "figures" / "bench_shared_system.png").read_bytes() == b"committed"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert save_figure(plt.figure(), "bench_shared_system", figures_dir(dest)).parent == dest / "figures"
    assert (course / "bench_shared_system.png").read_bytes() == b"committed"
    (dest / "figures").rename(dest / "mine")
    (dest / "figures").symlink_to(course)   # a link to the course's figures/: refused, nothing written
    with pytest.raises(ValueError, match="figures is a symbolic link"):
        write_student_copies(src, dest)
    assert [p.name for p in course.iterdir()] == ["bench_shared_system.png"]


@pytest.mark.parametrize("bad", ["missing src", "src is a file", "dest is a file"])
def test_bad_paths_give_one_line_and_exit_2(one_chapter, bad, capsys):
    from kvlearn.__main__ import main

    src, dest = one_chapter
    if bad == "missing src":
        src = src.parent / "nope"
    elif bad == "src is a file":
        src = src / "00_x.ipynb"
    else:
        dest.write_text("not a folder")
    assert main(["student", "--src", str(src), "--dest", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and ("--src" in err or "--dest" in err)


BUILD_CELL = f'''%%part allocator
import torch

from kvlearn import KVCapacityError
from kvlearn.parts import AllocatorBase


class MyAllocator(AllocatorBase):
    """A Python list as the stack of free pages, its top at the end."""

    def __init__(self, num_pages, device=None):
        super().__init__(num_pages, device)
        {BEGIN}
        self.stack = list(range(num_pages - 1, -1, -1))
        {END}

    @property
    def free_pages(self):
        {BEGIN}
        return self.stack[::-1]
        {END}

    def alloc(self, n):
        """n pages off the free list, as an int64 tensor; KVCapacityError when fewer are free."""
        {BEGIN}
        if n < 0:
            raise ValueError(f"alloc({{n}}): n must be >= 0")
        if n > len(self.stack):
            raise KVCapacityError(f"{{n}} pages asked for, {{len(self.stack)}} free")
        taken = self.stack[len(self.stack) - n:][::-1]
        del self.stack[len(self.stack) - n:]
        return torch.tensor(taken, dtype=torch.int64, device=self.device)
        {END}

    def free(self, pages):
        {BEGIN}
        pages = pages.tolist()
        if len(set(pages)) != len(pages) or set(pages) & set(self.stack) or not all(0 <= p < self.num_pages
                                                                                  for p in pages):
            raise ValueError("double free, or no such page")
        self.stack.extend(pages[::-1])
        {END}'''


def test_a_build_exercise_becomes_a_skeleton_that_says_not_yet(tmp_path, capsys):
    """A `%%part` cell whose methods hold the solution: the student copy keeps the magic line, the
    signatures and docstrings; its saved module imports, and its check says "Not yet"."""
    from kvlearn.exercises.parts import check_part, save_part

    (cell,) = student_copy(_notebook(BUILD_CELL)).cells
    assert cell.source.startswith("%%part allocator\n") and BEGIN not in cell.source
    assert cell.source.count("        ...  # your code here") == 4 and "self.stack" not in cell.source
    assert '"""n pages off the free list' in cell.source and "    def free(self, pages):" in cell.source
    for source, verdict in ((BUILD_CELL, OK), (cell.source, NOT_YET)):
        name, _, body = source.partition("\n")
        path = save_part(name.split()[1], body, tmp_path / "my_parts")
        namespace = {}
        exec(compile(path.read_text(), str(path), "exec"), namespace)   # what the magic runs
        assert check_part("allocator", namespace["MyAllocator"]) is (verdict == OK)
        assert capsys.readouterr().out.startswith(verdict)


def test_chapter_one_gives_blocks_back_in_the_order_its_part_must(copies):
    """Section 1's code frees blocks the way `allocator.free(ids)` does (ids[0] is handed out next),
    and the stub of `deallocate` says so: nothing in the given code to copy reversed into the part."""
    _, student = copies["01"]
    code = [c.source for c in student.cells if c.cell_type == "code"]
    given = code[:next(i for i, source in enumerate(code) if source.startswith("%%part block_table"))]
    assert not [s for s in given if "reversed(" in s], "section 1 reverses the freed blocks; the part must not"
    stub = next(s for s in code if s.startswith("%%part block_table"))
    deallocate = stub[stub.index("def deallocate"):stub.index("def slot_mapping")]
    assert "self.allocator.free(ids) hands ids[0] out next" in deallocate and "not reversed" in deallocate
