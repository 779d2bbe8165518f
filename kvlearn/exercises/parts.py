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
  MyBlockManager(earlier_part("block_table", "MyBlockTable"))`): your earlier part, read from
  my_parts/NAME.py, once it passes `kvlearn.parts.check`, else the package's, saying so, so the later
  exercise can be written and checked before the earlier one is done.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from kvlearn.exercises import NOT_YET, OK

FOLDER = "my_parts"
_passed: dict[str, object] = {}   # part name -> the impl that last passed check_part


def part_path(name: str, folder: str | Path = FOLDER) -> Path:
    if not name.isidentifier():
        raise ValueError(f"%%part {name!r}: give the part's module name, a Python identifier such as "
                         "block_manager (the cell is saved as my_parts/<name>.py).")
    return Path(folder) / f"{name}.py"


def save_part(name: str, source: str, folder: str | Path = FOLDER) -> Path:
    """Write `source` to `folder/name.py` (a new file renamed over the old one); returns the path."""
    path = part_path(name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source.rstrip("\n") + "\n\n# Saved by a %%part cell: edit that cell, not this file.\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
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
    """Run the conformance suite of part `name` on `impl`, print the verdict and the report; return it."""
    from kvlearn.parts import check

    result = check(name, impl, **options)
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
    else the package's part `kvlearn.parts.PARTS[name]`. Says which, in one line. The file is read
    afresh on every call, so an edited and re-run earlier cell counts."""
    from kvlearn.parts import PARTS, check

    path = part_path(name, folder)
    if not path.exists():
        reason = f"{path} is not there yet (run the %%part {name} cell)"
    else:
        try:
            spec = importlib.util.spec_from_file_location(f"{FOLDER}.{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            impl = getattr(module, attr)
        except Exception as error:   # the learner's module: say what went wrong, never raise
            reason = f"importing {attr} from {path} raised {type(error).__name__}: {error}"
        else:
            if check(name, impl).passed:
                print(f"(building on your {attr} from {path}: it passes check_part({name!r}, ...))")
                return impl
            reason = f"your {attr} does not pass check_part({name!r}, ...) yet"
    package = PARTS[name]
    print(f"(building on the package's {package.__name__}: {reason})")
    return package
