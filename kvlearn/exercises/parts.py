"""Your parts, from the chapters to the capstone (chapter 9).

A build exercise's cell starts with `%%part NAME` (after `%load_ext kvlearn.exercises.parts`): the
cell runs as usual, and its code is also saved as `my_parts/NAME.py` beside the notebook, so that
chapter 9 can serve the model with the parts you wrote. A part cell is a small module: it imports
what it uses, and a later chapter's part may import an earlier one (`from my_parts.block_table
import MyBlockTable`).

- `check_part(name, impl)` runs `kvlearn.parts.check` and prints the verdict the course counts
  ("OK, well done." or "Not yet: ..." with the report), and remembers it;
- `use(name, impl)` is the part the chapter then drives: yours once `check_part` passed it, else the
  package's, saying so, so a student copy runs top to bottom before the exercise is done; `credit`
  words a result of that part with whose it is;
- `earlier_part(name, attr)` is what a later part grows from (chapter 2's `class
  MyBlockManager(earlier_part("block_table", "MyBlockTable"))`): your earlier part, read afresh from
  my_parts/NAME.py, once it passes `kvlearn.parts.check`, else the package's, saying so, so the later
  exercise can be written and checked before the earlier one is done;
- `gather(folder)` (chapter 9) reads every saved part of chapters 1-6 afresh, checks it again and
  returns the ones that pass, for `Engine(..., parts=...)`, printing a table of all of them (`make
  course` prints the same table for the folder the chapters wrote). Each part is imported and
  checked in a fresh process with time limits, so a part that loops, exits or changes the check at
  import is a row of the table, not a hung or broken call. Chapter 10's quantizer, an optional
  module after the capstone, is not gathered: it serves in its own chapter, with
  kv_cache_dtype="int8", which chapter 9's engines do not use.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from kvlearn.exercises import NOT_YET, OK, part_modules
from kvlearn.exercises.part_modules import FOLDER, IMPORT_LIMIT_S, part_path
from kvlearn.parts import check as check_impl  # the checker, imported before any part (a part cannot swap it)
from kvlearn.serving.part_registry import RECORDS, REGISTRY
from kvlearn.workshop.student import replace_file

_passed: dict[str, object] = {}   # part name -> the impl that last passed check_part

# The build exercises in course order: part name -> (chapter, the name its %%part cell defines).
BUILD = {part.name: (part.chapter, part.exercise) for part in REGISTRY}
CAPSTONE = 9   # the chapter that gathers the parts of the chapters before it


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
    with part_modules.building_part(path.stem):
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


def credit(name: str, part, line: str) -> str:
    """`line`, a result of the part `use(name, ...)` returned, saying whose part gave it: "your
    attention: ..." or "the package's attention: ...; yours has not passed check yet", so that a
    result of the package's stand-in never reads as yours."""
    from kvlearn.parts import PARTS

    if part is PARTS[name]:
        return f"the package's {name}: {line}; yours has not passed check_part({name!r}, ...) yet"
    return f"your {name}: {line}"


def earlier_part(name: str, attr: str, folder: str | Path = FOLDER, import_limit_s: float = IMPORT_LIMIT_S):
    """`attr` of your part `name` as saved in `folder/name.py`, if it passes `kvlearn.parts.check`
    (checked as `gather` checks, in a fresh process); else the package's part
    `kvlearn.parts.PARTS[name]`. Says which, in one line. Refused (RuntimeError) from inside part
    `name`'s own module or cell: a part builds on an earlier chapter's part, never on itself."""
    from kvlearn.parts import PARTS

    chain = part_modules.building_chain()
    if name in chain:
        raise RuntimeError(f"earlier_part({name!r}, {attr!r}) inside the {name} part itself (building "
                           f"{' -> '.join(chain)}): a part builds on an earlier chapter's part, never on "
                           f"itself; remove this call from the %%part {name} cell.")
    row = _gather_one(name, BUILD[name][0], attr, Path(folder), import_limit_s)
    if row.verdict == "yours":
        print(f"(building on your {attr} from {folder}/{name}.py: it passes check_part({name!r}, ...))")
        return row.impl
    package = PARTS[name]
    print(f"(building on the package's {package.__name__}: {row.note})")
    return package


# --- chapter 9: gather the parts ------------------------------------------------------------------

@dataclass(frozen=True)
class Gathered:
    """One part as `gather_parts` found it. `verdict`: "yours" (the class or function the module
    defines passed `kvlearn.parts.check`), "missing" (no module) or "fails check" (the module is not
    a readable file of at most MAX_PART_BYTES, does not import within its limit, lacks the name, or
    fails the check); `note`: why, in one line; `impl`: yours, once it passed (None otherwise)."""

    name: str
    chapter: int
    verdict: str
    note: str
    impl: object = None


def gather_parts(folder: str | Path = FOLDER, import_limit_s: float = IMPORT_LIMIT_S) -> list[Gathered]:
    """Check every part of the chapters before the capstone (`_offered`) saved in `folder`
    (my_parts/NAME.py, read afresh: edits since the last import count); one row per part, in course
    order. Each part is imported and checked in a fresh process of its own (`part_modules.Zygote`),
    killed when the import takes over `import_limit_s` or the check over twice `check`'s limit, so no
    part can hang this call, end it, or change the check of another; a part that passes is then imported
    here for the engine. A part's module may import an earlier one as `from my_parts.NAME import ...`
    (the folder is the package `my_parts`). The modules run in the folder's parent, the notebooks'
    folder they were written from, so `earlier_part` in them reads the same folder. Where there is no
    GPU it asks for Triton's interpreter first (`kvlearn.kernels.interpret_here`), so that a decode
    kernel imported here can serve with attention_backend="triton"."""
    from kvlearn.kernels import interpret_here

    interpret_here()   # before anything here imports triton: later is too late
    folder = Path(folder).resolve()
    part_modules.fresh_package(folder)
    with contextlib.chdir(folder.parent), part_modules.gather_verdicts():
        return [_gather_one(name, chapter, attribute, Path(folder.name), import_limit_s)
                for name, (chapter, attribute) in BUILD.items() if _offered(name, Path(folder.name))]


def _offered(name: str, folder: Path) -> bool:
    """The parts of the chapters before the capstone (chapter 9) are gathered, chapter 5's decode kernel
    only once it is saved and Triton imports."""
    if name != "decode_kernel":
        return BUILD[name][0] < CAPSTONE
    from kvlearn.kernels import triton_import_error

    return part_path(name, folder).is_file() and triton_import_error() is None


def parts_table(rows: list[Gathered], markdown: bool = False) -> str:
    """The rows as aligned text (or a markdown table), then "N of M parts pass"."""
    header = ("part", "chapter", "verdict", "what check said")
    cells = [(r.name, str(r.chapter), r.verdict, r.note) for r in rows]
    summary = f"{sum(r.verdict == 'yours' for r in rows)} of {len(rows)} parts pass"
    if markdown:
        lines = [header, ("---",) * len(header), *((*row[:-1], row[-1].replace("|", "\\|")) for row in cells)]
        return "\n".join("| " + " | ".join(row) + " |" for row in lines) + f"\n\n{summary}"
    widths = [max(len(row[i]) for row in (header, *cells)) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
                     for row in (header, *cells)) + f"\n{summary}"


def gather(folder: str | Path = FOLDER, import_limit_s: float = IMPORT_LIMIT_S) -> dict:
    """Your parts for the engine: print the table of `gather_parts(folder, import_limit_s)`, then
    `serving_table` (whose part serves, and why), and return {part name: your class or function} for
    the engine's parts that pass (`kvlearn.serving.config.PART_MODES`); a part left out is the
    package's own."""
    from kvlearn.serving.config import PART_MODES

    rows = gather_parts(folder, import_limit_s)
    print(parts_table(rows))
    engine = {r.name: r.impl for r in rows if r.verdict == "yours" and r.name in PART_MODES}
    print(serving_table(rows, engine))
    if "decode_kernel" in engine:
        print("Your decode_kernel serves only with attention_backend='triton' (slow in Triton's interpreter): "
              "Engine(..., attention_backend='triton', parts=parts_for(cache, parts, 'triton')).")
    if any(r.verdict == "fails check" for r in rows):
        print("A part that fails: its chapter's check_part cell prints the whole report, with a smallest example.")
    return engine


def _inside(parts: dict, name: str) -> bool:
    """Whether your block manager (in `parts`) builds on your part `name`: a class of
    my_parts/NAME.py among its bases. The block table serves only that way."""
    manager = parts.get("block_manager")
    folder = getattr(manager, "__module__", "").rpartition(".")[0]
    return any(cls.__module__ == f"{folder}.{name}" for cls in getattr(manager, "__mro__", ())[1:])


def _serves(parts: dict, name: str) -> tuple[tuple[str, ...], bool]:
    """(the cache modes part `name` serves in, whether yours serves there given `parts`): the engine
    takes it by name, or, for the block table (never given alone), inside your block manager."""
    from kvlearn.serving.config import PART_MODES

    if name in PART_MODES:
        return PART_MODES[name], name in parts
    return ("blocks",), _inside(parts, name)


def serving(rows: list[Gathered], parts: dict) -> list[tuple[str, bool, str]]:
    """(part, whether yours serves, where or why not), one per row of `gather_parts`, for engines
    given `parts` (what `gather` returns)."""
    said = []
    for row in rows:
        modes, yours = _serves(parts, row.name)
        engines = "both engines" if {"radix", "blocks"} <= set(modes) else f"the {' and '.join(modes)} engine"
        if yours:
            where = "inside your block_manager, " if row.name not in parts else ""
            where = "with attention_backend='triton' only, " if row.name == "decode_kernel" else where
            said.append((row.name, True, f"{where}in {engines}"))
        elif row.verdict != "yours":
            why = "yours is missing" if row.verdict == "missing" else "yours has not passed check yet"
            said.append((row.name, False, why))
        elif "block_manager" in parts:
            said.append((row.name, False, f"your block_manager does not build on it: chapter 2's part starts with "
                                          f"earlier_part({row.name!r}, {BUILD[row.name][1]!r})"))
        else:
            said.append((row.name, False, f"your {row.name} serves only inside a block manager: write chapter 2's "
                                          "block_manager (it builds on yours) to use it"))
    return said


def serving_table(rows: list[Gathered], parts: dict) -> str:
    """`serving(rows, parts)` as aligned text: which part serves, yours or the package's, and why."""
    said = serving(rows, parts)
    width = max(len(name) for name, _, _ in said)
    whose = {True: "yours", False: "the package's"}
    return "What serves:\n" + "\n".join(f"{name:<{width}}  {whose[yours]}: {why}" for name, yours, why in said)


def parts_label(engine) -> str:
    """A bench row's name for `engine`, read from the engine itself (the parts it was given that are not
    the package's own, and your block table inside your block manager): its cache mode and the parts of
    yours that serve in it ("radix, your radix_cache, attention"), "radix, all your parts" (yours for
    every part of chapters 1-6 that an engine of its mode and attention backend takes) or "radix, the
    package's parts"."""
    cache, parts = engine.cache_mode, engine.config.parts
    given = {name for name, part in parts.items() if part is not RECORDS[name].package}
    mine = [name for name in BUILD if name in given or (name == "block_table" and _inside(parts, name))]
    skip = {"triton": "attention", "fast": "attention"}.get(engine.attention_backend)   # the backend attends
    takes = [name for name in BUILD if BUILD[name][0] < CAPSTONE and cache in _serves(parts, name)[0] and name != skip
             and (name != "decode_kernel" or engine.attention_backend == "triton")]
    if not mine:
        return f"{cache}, the package's parts"
    return f"{cache}, all your parts" if mine == takes else f"{cache}, your {', '.join(mine)}"


def parts_for(cache: str, parts: dict, attention_backend: str = "auto") -> dict:
    """The parts among `parts` that an engine with this cache mode and attention backend serves with
    (a radix engine has no block manager, a blocks engine no radix tree; the decode kernel serves
    only with attention_backend="triton", and the attention part only without it)."""
    from kvlearn.serving.config import PART_MODES

    skip = "attention" if attention_backend == "triton" else "decode_kernel"
    return {name: impl for name, impl in parts.items() if cache in PART_MODES[name] and name != skip}


def _gather_one(name: str, chapter: int, attribute: str, folder: Path, import_limit_s: float) -> Gathered:
    """Check part `name` in a fresh process (`part_modules.Zygote.check`; a verdict of this gather
    on the same text is reused); if it passed, import the same text here and keep the class or
    function the module defines, when it is the one that was checked."""
    path = part_path(name, folder)
    fails = functools.partial(Gathered, name, chapter, "fails check")
    if not (isinstance(import_limit_s, (int, float)) and 0 < import_limit_s < math.inf):
        raise ValueError(f"import_limit_s={import_limit_s!r}: give a finite number of seconds > 0.")
    try:
        text = part_modules.read_part(path)
    except FileNotFoundError:
        return Gathered(name, chapter, "missing", f"no {folder.name}/{path.name}: run chapter {chapter}'s "
                                                  f"%%part {name} cell")
    except ValueError as error:   # not a part's file: say what it is
        return fails(str(error))
    except OSError as error:
        return fails(f"{folder.name}/{path.name} cannot be read ({error.strerror or error})")
    try:
        compile(text, str(path), "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        return fails(part_modules.import_failure(path, error))
    key = (name, attribute, hashlib.sha256(text.encode("utf-8")).hexdigest())
    with part_modules.gather_verdicts() as verdicts:
        if key not in verdicts:
            verdicts[key] = part_modules.Zygote.get().check(name, attribute, folder.resolve(), text,
                                                            import_limit_s)
        passed, note, checked = verdicts[key]
    if not passed:
        return fails(note)
    try:   # the fresh process showed the module imports within the limit: import it here for the engine
        module = part_modules.import_part(folder, name, text)
    except KeyboardInterrupt:   # the learner's Ctrl-C (the module itself raised none there)
        raise
    except BaseException as error:   # a learner's module may fail in any way: say how
        return fails(part_modules.import_failure(path, error))
    impl = getattr(module, attribute, None)
    problem = part_modules.not_its_own(impl, module, attribute, path)
    if problem is None and part_modules.defined(impl).__qualname__ != checked:
        problem = (f"{attribute} in {path.name} is {part_modules.defined(impl).__qualname__} here, but {checked} "
                   "where it was checked")
    return fails(problem) if problem else Gathered(name, chapter, "yours", note, impl)
