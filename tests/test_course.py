"""`python -m kvlearn course`: each notebook in a fresh kernel, failures named, nothing written back."""

import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from kvlearn.__main__ import main
from kvlearn.exercises import NOT_YET, OK
from kvlearn.exercises.parts import gather_parts
from kvlearn.workshop import course
from tests.test_capstone import stand_in


def write(folder: Path, name: str, *sources: str) -> Path:
    nb = new_notebook(cells=[new_markdown_cell("# a chapter")] + [new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / name
    nbformat.write(nb, path)
    return path


@pytest.fixture
def toy_course(tmp_path):
    write(tmp_path, "00_first.ipynb", "seen = 'set in chapter 0'", f"print({OK!r})", "1 / 0", "print('never')")
    write(tmp_path, "01_fresh.ipynb", "import os; print(os.getcwd())",
          "assert 'seen' not in globals(), 'state leaked from the previous chapter'", f"print({NOT_YET!r} + ' hint')")
    write(tmp_path, "02_dies.ipynb", "import os; os._exit(1)")
    write(tmp_path, "notes.ipynb", "raise SystemExit('not a chapter: NN_name.ipynb only')")
    return tmp_path


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_each_chapter_runs_in_a_fresh_kernel_and_failures_are_named(toy_course, capsys):
    before = {p: p.read_bytes() for p in toy_course.glob("*.ipynb")}
    runs = course.run_course(course.chapter_notebooks(toy_course), timeout=60, progress=False)
    first, fresh, dies = runs
    assert [r.notebook for r in runs] == ["00_first", "01_fresh", "02_dies"]
    assert (first.cells, first.ran, first.passed) == (4, 2, False)
    assert first.error == "cell 3: ZeroDivisionError: division by zero"
    assert (first.exercises, first.solved) == (1, 1)
    assert fresh.passed and (fresh.ran, fresh.exercises, fresh.solved) == (3, 1, 0)
    assert not dies.passed and dies.error.startswith("cell 1: the kernel died")
    assert {p: p.read_bytes() for p in toy_course.glob("*.ipynb")} == before  # nothing written back

    text = course.table(runs)
    assert "FAIL cell 3: ZeroDivisionError" in text and "whole course" in text and "1/3 PASS" in text
    md = course.table(runs, markdown=True).splitlines()
    assert md[0].startswith("| chapter | time |") and md[1].startswith("| --- |") and len(md) == 2 + 3 + 1


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_cli_prints_the_summary_and_fails_when_a_chapter_fails(toy_course, capsys):
    assert main(["course", "--notebooks", str(toy_course)]) == 1
    out = capsys.readouterr().out
    assert "01_fresh" in out and "PASS" in out and "FAIL cell 3" in out
    assert "block_table    1        missing" in out and out.rstrip().endswith("0 of 6 parts pass")
    good = toy_course / "good"
    good.mkdir()
    write(good, "00_ok.ipynb", "print(1 + 1)")
    assert main(["course", "--notebooks", str(good)]) == 0
    assert "1/1 PASS" in capsys.readouterr().out


def test_kernel_starts_in_the_notebook_folder(tmp_path):
    path = write(tmp_path, "00_where.ipynb", f"import os; assert os.getcwd() == {str(tmp_path)!r}, os.getcwd()")
    assert course.run_notebook(path).passed


def test_guide_table_is_replaced_between_the_markers(toy_course, tmp_path):
    begin, end = course.GUIDE_MARKERS
    guide = tmp_path / "guide.md"
    guide.write_text(f"# Guide\n\nbefore\n{begin}\nold table\n{end}\nafter\n")
    runs = course.run_course(course.chapter_notebooks(toy_course)[1:2], progress=False)
    parts = gather_parts(toy_course / "my_parts")
    course.write_guide(guide, runs, parts)
    text = guide.read_text()
    assert "old table" not in text and text.startswith("# Guide\n\nbefore\n") and text.endswith(f"{end}\nafter\n")
    assert "| 01_fresh |" in text and "`make course`" in text
    assert "| part | chapter | verdict | what check said |" in text and f"0 of 6 parts pass\n{end}" in text
    guide.write_text("no markers here")
    with pytest.raises(ValueError, match="course-times"):
        course.write_guide(guide, runs, parts)


@pytest.mark.slow   # 10 s or more: `make quick` leaves it out
def test_the_course_reports_per_part_what_the_chapters_saved(tmp_path, capsys):
    """A chapter's %%part cell saves my_parts/NAME.py beside the notebooks; the course checks each part."""
    write(tmp_path, "04_pool.ipynb", "%load_ext kvlearn.exercises.parts",
          "%%part allocator\n" + stand_in("allocator"), "%%part radix_cache\nclass MyRadixCache:\n    pass")
    assert main(["course", "--notebooks", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1/1 PASS" in out and out.rstrip().endswith("1 of 6 parts pass")
    assert re.search(r"allocator +4 +yours +MyAllocator meets the allocator contract", out)
    assert re.search(r"radix_cache +3 +fails check +MyRadixCache lacks", out)


def test_a_folder_without_chapters_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="--notebooks"):
        course.chapter_notebooks(tmp_path)


def test_the_guide_has_measured_times_for_exactly_the_chapters_there_are():
    guide = (course.NOTEBOOKS.parent / "docs" / "instructor.md").read_text()
    begin, end = course.GUIDE_MARKERS
    block = guide[guide.index(begin):guide.index(end)]
    rows = [line.split(" | ")[0].lstrip("| ") for line in block.splitlines() if re.match(r"\| \d\d_", line)]
    assert rows == [p.stem for p in course.chapter_notebooks()], "re-run `make course GUIDE=docs/instructor.md`"
    assert f"| {len(rows)}/{len(rows)} PASS |" in block  # the recorded run passed every chapter


@pytest.mark.slow   # 10 s or more: `make quick` leaves it out
def test_a_cell_timeout_fails_that_chapter_and_the_course_goes_on(tmp_path, capsys):
    write(tmp_path, "00_slow.ipynb", "print('started')", "import time; time.sleep(60)", "print('never')")
    write(tmp_path, "01_after.ipynb", "print(2)")
    assert main(["course", "--notebooks", str(tmp_path), "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL cell 2: timeout" in out and "01_after" in out and "1/2 PASS" in out
    slow, after = course.run_course(course.chapter_notebooks(tmp_path), timeout=2, progress=False)
    assert (slow.ran, slow.passed) == (1, False) and "timeout" in slow.error and after.passed


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_timeout_below_one_second_is_a_usage_error(tmp_path, timeout, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["course", "--notebooks", str(tmp_path), "--timeout", timeout])
    assert exit.value.code == 2 and "--timeout must be at least 1" in capsys.readouterr().err


def refuse_to_run(*args, **kwargs):
    raise AssertionError("the course ran before its arguments were checked")


@pytest.mark.parametrize("bad", ["guide without markers", "missing guide", "missing folder", "folder is a file"])
def test_bad_arguments_are_one_line_and_exit_2_before_any_chapter_runs(toy_course, bad, monkeypatch, capsys):
    monkeypatch.setattr(course, "run_course", refuse_to_run)
    args = ["course", "--notebooks", str(toy_course)]
    if bad == "guide without markers":
        (toy_course / "guide.md").write_text("# Guide\nno markers here\n")
        args += ["--guide", str(toy_course / "guide.md")]
    elif bad == "missing guide":
        args += ["--guide", str(toy_course / "nope.md")]
    elif bad == "missing folder":
        args[2] = str(toy_course / "nope")
    else:
        args[2] = str(toy_course / "00_first.ipynb")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("course-times" if bad == "guide without markers" else "nope" if "missing" in bad else "not a folder") in err


def test_no_course_text_cites_an_issue_of_this_project():
    """A learner cannot follow "issue 47": notebooks, docs, the README and the package's docstrings and
    comments give the reason itself. Another project's issue, cited as owner/repo#N or "#N", is a source."""
    root = Path(__file__).resolve().parents[1]
    texts = [*root.glob("notebooks/*.ipynb"), *root.glob("docs/**/*.md"), root / "README.md",
             *root.glob("kvlearn/**/*.py")]
    cited = [f"{path.relative_to(root)}: {m.group(0)!r}" for path in texts
             for m in re.finditer(r"\b[Ii]ssues? \d+(?: and \d+)?", path.read_text(encoding="utf-8"))]
    assert not cited, cited
