"""Your parts, from the chapters to the capstone (chapter 9).

A build exercise's cell starts with `%%part NAME` (after `%load_ext kvlearn.exercises.parts`): the
cell runs as usual, and its code is also saved as `my_parts/NAME.py` beside the notebook, so that
chapter 9 can serve the model with the parts you wrote. A part cell is a small module: it imports
what it uses, and a later chapter's part may import an earlier one (`from my_parts.block_table
import MyBlockTable`).

- `check_part(name, impl)` runs `kvlearn.parts.check` and prints the verdict the course counts
  ("OK, well done." or "Not yet: ..." with the report), and remembers it;
- `use(name, impl)` is the part the chapter then drives: yours once `check_part` passed it, else the
  package's, saying so, so a student copy runs top to bottom before the exercise is done;
- `earlier_part(name, attr)` is what a later part grows from (chapter 2's `class
  MyBlockManager(earlier_part("block_table", "MyBlockTable"))`): your earlier part, read afresh from
  my_parts/NAME.py, once it passes `kvlearn.parts.check`, else the package's, saying so, so the later
  exercise can be written and checked before the earlier one is done;
- `gather(folder)` (chapter 9) reads every saved part afresh, checks it again and returns the ones
  that pass, for `Engine(..., parts=...)`, printing a table of all of them (`make course` prints
  the same table for the folder the chapters wrote).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from kvlearn.exercises import NOT_YET, OK
from kvlearn.parts import check as check_impl   # the checker, imported before any part (a part cannot swap it)
from kvlearn.workshop.student import replace_file

FOLDER = "my_parts"
_passed: dict[str, object] = {}   # part name -> the impl that last passed check_part

# The build exercises in course order: part name -> (chapter, the name its %%part cell defines).
BUILD = {
    "block_table": (1, "MyBlockTable"),
    "block_manager": (2, "MyBlockManager"),
    "radix_cache": (3, "MyRadixCache"),
    "allocator": (4, "MyAllocator"),
    "attention": (5, "my_paged_attention"),
    "scheduler": (6, "MyScheduler"),
}


def part_path(name: str, folder: str | Path = FOLDER) -> Path:
    if not name.isidentifier():
        raise ValueError(f"%%part {name!r}: give the part's module name, a Python identifier such as "
                         "block_manager (the cell is saved as my_parts/<name>.py).")
    return Path(folder) / f"{name}.py"


def save_part(name: str, source: str, folder: str | Path = FOLDER) -> Path:
    """Write `source` to `folder/name.py` (a new file renamed over the old one); returns the path."""
    path = part_path(name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, source.rstrip("\n") + "\n\n# Saved by a %%part cell: edit that cell, not this file.\n")
    return path


def part(line: str, cell: str) -> None:
    """`%%part NAME`: save the cell as my_parts/NAME.py, then run it in the notebook."""
    from IPython import get_ipython

    path = save_part(line.strip(), cell)
    ip = get_ipython()
    code = compile(cell, str(path), "exec")   # tracebacks show the saved file's lines (same numbers)
    exec(code, ip.user_ns)


def load_ipython_extension(ipython) -> None:
    ipython.register_magic_function(part, "cell", "part")


def check_part(name: str, impl, **options) -> bool:
    """Run the conformance suite of part `name` on `impl`, print the verdict and the report; return it.
    `options` go to `kvlearn.parts.check` (time_limit_s, programs, seed), which refuses bad ones."""
    result = check_impl(name, impl, **options)
    if result.passed:
        _passed[name] = impl
        print(f"{OK} {result.message}")
    else:
        _passed.pop(name, None)
        message = result.message.removeprefix(NOT_YET).lstrip()
        print(f"{NOT_YET} {message}")
    return result.passed


def use(name: str, impl):
    """`impl` if `check_part(name, impl)` passed it in this kernel, else the package's part (said)."""
    from kvlearn.parts import PARTS

    if _passed.get(name) is impl:
        return impl
    package = PARTS[name]
    print(f"(using the package's {package.__name__}: {getattr(impl, '__name__', impl)} has not passed "
          f"check_part({name!r}, ...) yet)")
    return package


def earlier_part(name: str, attr: str, folder: str | Path = FOLDER):
    """`attr` of your part `name` as saved in `folder/name.py`, if it passes `kvlearn.parts.check`;
    else the package's part `kvlearn.parts.PARTS[name]`. Says which, in one line."""
    from kvlearn.parts import PARTS

    row = _gather_one(name, BUILD[name][0], attr, Path(folder))
    if row.verdict == "yours":
        print(f"(building on your {attr} from {folder}/{name}.py: it passes check_part({name!r}, ...))")
        return row.impl
    package = PARTS[name]
    print(f"(building on the package's {package.__name__}: {row.note})")
    return package


# --- chapter 9: gather the parts ------------------------------------------------------------------

@dataclass(frozen=True)
class Gathered:
    """One part as `gather_parts` found it. `verdict`: "yours" (it passed `kvlearn.parts.check`),
    "missing" (no module) or "fails check" (the module does not import, lacks the name, or fails the
    check); `note`: why, in one line;
    `impl`: the learner's class or function once imported (None otherwise)."""

    name: str
    chapter: int
    verdict: str
    note: str
    impl: object = None


def gather_parts(folder: str | Path = FOLDER) -> list[Gathered]:
    """Import every part of BUILD from `folder` (my_parts/NAME.py, read afresh: edits since the last
    import count) and check it; one row per part, in course order. A part's module may import an
    earlier one as `from my_parts.NAME import ...` (the folder is the package `my_parts`). The modules
    run in the folder's parent, the notebooks' folder they were written from, so `earlier_part` in
    them reads the same folder."""
    folder = Path(folder).resolve()
    _fresh_package(folder)
    with contextlib.chdir(folder.parent):
        return [_gather_one(name, chapter, attribute, Path(folder.name))
                for name, (chapter, attribute) in BUILD.items()]


def parts_table(rows: list[Gathered], markdown: bool = False) -> str:
    """The rows as aligned text (or a markdown table), then "N of M parts pass"."""
    header = ("part", "chapter", "verdict", "what check said")
    cells = [(r.name, str(r.chapter), r.verdict, r.note) for r in rows]
    summary = f"{sum(r.verdict == 'yours' for r in rows)} of {len(rows)} parts pass"
    if markdown:
        lines = [header, ("---",) * len(header), *((*row[:-1], row[-1].replace("|", "\\|")) for row in cells)]
        return "\n".join("| " + " | ".join(row) + " |" for row in lines) + f"\n\n{summary}"
    widths = [max(len(row[i]) for row in (header, *cells)) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip()
                     for row in (header, *cells)) + f"\n{summary}"


def gather(folder: str | Path = FOLDER) -> dict:
    """Your parts for the engine: print the table of `gather_parts(folder)` and return {part name:
    your class or function} for the engine's parts that pass (`kvlearn.serving.config.PART_MODES`);
    a part left out is the package's own (said)."""
    from kvlearn.serving.config import PART_MODES

    rows = gather_parts(folder)
    print(parts_table(rows))
    engine = {r.name: r.impl for r in rows if r.verdict == "yours" and r.name in PART_MODES}
    package = [name for name in PART_MODES if name not in engine]
    if package:
        print(f"The engine uses the package's {', '.join(package)}.")
    if any(r.verdict == "fails check" for r in rows):
        print("A part that fails: its chapter's check_part cell prints the whole report, with a smallest example.")
    return engine


def parts_for(cache: str, parts: dict) -> dict:
    """The parts among `parts` that an engine with this cache mode serves with (a radix engine has
    no block manager, a blocks engine no radix tree)."""
    from kvlearn.serving.config import PART_MODES

    return {name: impl for name, impl in parts.items() if cache in PART_MODES[name]}


def _fresh_package(folder: Path) -> None:
    """Make `folder` the package named after it, forgetting every module of it imported before."""
    package = folder.name
    if not package.isidentifier():
        raise ValueError(f"{folder}: the parts folder's name must be a Python identifier, such as my_parts.")
    for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        del sys.modules[key]
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations = [str(folder.resolve())]
    sys.modules[package] = importlib.util.module_from_spec(spec)


def _import_part(folder: Path, name: str):
    """Import folder/name.py as the module `<folder name>.<name>`, compiled from its text (never from a
    cached .pyc, which a cell saved twice within a second could leave stale)."""
    path = part_path(name, folder)
    spec = importlib.util.spec_from_file_location(f"{folder.name}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), vars(module))
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def _gather_one(name: str, chapter: int, attribute: str, folder: Path) -> Gathered:
    from kvlearn.parts import check

    path = part_path(name, folder)
    if not path.is_file():
        return Gathered(name, chapter, "missing", f"no {folder.name}/{path.name}: run chapter {chapter}'s "
                                                  f"%%part {name} cell")
    try:
        module = _import_part(folder, name)
    except Exception as error:   # a learner's module may fail in any way: say how
        where = (f" ({Path(error.filename).name}, line {error.lineno})"
                 if isinstance(error, SyntaxError) and error.filename else "")
        return Gathered(name, chapter, "fails check", f"importing {path.name} raised {type(error).__name__}: "
                                                      f"{getattr(error, 'msg', error)}{where}")
    impl = getattr(module, attribute, None)
    if impl is None:
        return Gathered(name, chapter, "fails check", f"{path.name} defines no {attribute}")
    report = check(name, impl)
    first = report.message.splitlines()[0].removeprefix(NOT_YET).strip()
    return Gathered(name, chapter, "yours" if report.passed else "fails check", first, impl)
