"""The suite's own map (tests/README.md): the tests it cites exist, and each runs under the command
whose column cites it: `make test` (not marked thorough) or `make thorough` (marked)."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
README = (TESTS / "README.md").read_text(encoding="utf-8")


def cited(cell: str):
    """(file, test or None) for each `test_x.py` or `test_x.py::name` in a table cell; a bare
    `test_name` after a cited file belongs to that file."""
    file = None
    for ref in re.findall(r"`([\w./:]+)`", cell):
        path, _, name = ref.partition("::")
        if path.startswith("test_") and path.endswith(".py"):
            file = path
            yield file, name or None
        elif file and re.fullmatch(r"test_\w+", ref):
            yield file, ref


def promise_rows():
    """(the `make test` cell, the `make thorough` cell) of each row of the promise table."""
    table = README.split("## Promise -> the test that proves it", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [(test, thorough) for _, test, thorough in rows[1:]]


def marked_thorough(file: str, name: str) -> bool:
    """Whether `name` in tests/`file` is marked thorough: by a decorator above it or by the module."""
    lines = (TESTS / file).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(rf"(def {name}\(|{name} = )", line))
    decorators = []
    while at > 0 and lines[at - 1].startswith(("@", " ", ")")):
        at -= 1
        decorators.append(lines[at])
    module = [line for line in lines if line.startswith("pytestmark")]
    return any("mark.thorough" in line for line in decorators + module)


def test_the_readme_cites_tests_that_exist():
    refs = [ref for row in promise_rows() for cell in row for ref in cited(cell)]
    assert len(refs) > 30
    missing = [f"{file}::{name}" if name else file for file, name in refs
               if not (TESTS / file).is_file()
               or (name and not re.search(rf"^(def {name}\(|{name} = )", (TESTS / file).read_text(), re.M))]
    assert not missing, f"tests/README.md cites what is not there: {missing}"


def test_each_cited_test_runs_under_the_command_of_its_column():
    wrong = [f"{file}::{name} ({column})" for row in promise_rows()
             for column, cell in zip(("make test", "make thorough"), row, strict=True)
             for file, name in cited(cell)
             if name and marked_thorough(file, name) != (column == "make thorough")]
    assert not wrong, f"tests/README.md's column and the test's marker disagree: {wrong}"
