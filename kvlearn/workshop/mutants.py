"""`python -m kvlearn mutants`: how strong is each part's referee? Mutation testing of the worked solutions.

The worked solutions are the `%%part NAME` cells of the instructor notebooks (a part whose chapter has
none yet: tests/data/mutants/NAME.py, the cell to be). Cosmic Ray's
operators (comparisons and arithmetic swapped, numbers off by one, `and`/`or`, `break`/`continue`,
`not` added, a loop made empty) make one mutant per change of a line inside a solution block
(`### BEGIN SOLUTION` .. `### END SOLUTION`: the code a learner writes); each mutant is judged by
`kvlearn.parts.check(name, mutant)` in a child process forked from this warm one (torch and kvlearn
imported once), under a time and a memory limit. A mutant is killed when the check fails (or the
child dies or runs out of time); a surviving mutant is either listed as equivalent in
tests/data/mutants/<part>.json, with one line saying why it behaves the same, or it is a hole in the
referee. Exit status 1 when a part has a survivor that is not listed, a listed mutant that is no
longer made or is killed (the list is out of date), or a worked solution that fails its own check.

A listed mutant is named by what a reader can find again: Cosmic Ray's operator, the solution's line
before and after the change (whitespace stripped), and `nth` when the same change fits several lines.
`apply_listed` makes it again from that text alone (no mutation tool needed), and
`kvlearn.workshop.mutant_review` records what a part answers on the suite's programs, so
tests/test_mutants.py can check that each listed mutant still passes and answers what the worked
solution answers.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import importlib.util
import json
import linecache
import os
import random
import resource
import select
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import torch

from kvlearn.exercises.parts import BUILD, save_part
from kvlearn.kernels import interpret_here
from kvlearn.parts import check
from kvlearn.parts.conformance import SUITES
from kvlearn.workshop.course import NOTEBOOKS
from kvlearn.workshop.student import BEGIN, END

EQUIVALENTS = NOTEBOOKS.parent / "tests" / "data" / "mutants"   # <part>.json: the equivalent mutants
TOOL_HINT = "the mutation tool is not installed: pip install -r requirements-mutants.txt (or run `make mutants`)"
MEMORY_BYTES = 2 << 30   # a mutant may use this much memory beyond what the warm process holds


# --- the worked solutions and their mutants -----------------------------------------------------

def worked_solutions(folder: Path = NOTEBOOKS, waiting: Path = EQUIVALENTS) -> dict[str, str]:
    """Every `%%part NAME` cell of the chapter notebooks in `folder`: NAME -> the cell's code without
    its magic line (the module a `%%part` cell saves). A part whose chapter has no such cell yet keeps
    its worked solution beside its listing, `waiting`/NAME.py (the cell's code, markers included);
    ValueError when a part is in both places: the cell is the one, delete the file."""
    cells = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            first, _, body = cell.source.partition("\n")
            if cell.cell_type == "code" and first.startswith("%%part "):
                cells[first.split()[1]] = body
    for path in sorted(waiting.glob("*.py")) if waiting.is_dir() else ():
        if path.stem in cells:
            raise ValueError(f"{path}: the worked solution of {path.stem} is a %%part cell of {folder} now: "
                             "delete this file (and keep its mutants' listing).")
        cells[path.stem] = path.read_text(encoding="utf-8")
    return cells


def solution_lines(source: str) -> set[int]:
    """The numbers (from 1) of the lines strictly between a `### BEGIN SOLUTION` and its `### END SOLUTION`."""
    inside, lines = False, set()
    for number, line in enumerate(source.split("\n"), 1):
        if line.strip() in (BEGIN, END):
            inside = line.strip() == BEGIN
        elif inside:
            lines.add(number)
    return lines


@dataclass(frozen=True)
class Mutant:
    """One mutant of a part's worked solution: `source` is the whole mutated module; `before` and
    `after` the changed lines (stripped, joined by newlines); `nth` counts earlier mutants with the
    same operator, before and after (in line order); `line` and `where` say where it is."""

    part: str
    operator: str
    before: str
    after: str
    nth: int
    line: int
    where: str
    source: str

    @property
    def key(self) -> tuple:
        return self.operator, self.before, self.after, self.nth

    def entry(self, why: str = "") -> dict:
        """The mutant as an entry of tests/data/mutants/<part>.json."""
        return {"operator": self.operator, "before": self.before, "after": self.after, "nth": self.nth, "why": why}

    def diff(self) -> str:
        return "\n".join([f"  - {line}" for line in self.before.split("\n")] +
                         [f"  + {line}" for line in self.after.split("\n")])


def make_mutants(part: str, source: str) -> list[Mutant]:
    """Every mutant Cosmic Ray's core operators make of a line inside the solution blocks of `source`
    (operators that need arguments are left out); ImportError if Cosmic Ray is not installed."""
    try:
        from cosmic_ray import plugins
        from cosmic_ray.ast import ast_nodes, get_ast
        from cosmic_ray.ast.ast_query import ASTQuery
        from cosmic_ray.mutating import mutate_code
    except ImportError as error:
        raise ImportError(TOOL_HINT) from error
    inside, lines = solution_lines(source), source.split("\n")
    found, seen = [], {}
    for name in plugins.operator_names():
        operator_class = plugins.get_operator(name)
        if operator_class.arguments():
            continue
        operator = operator_class()
        positions = [(node, start) for node in ast_nodes(get_ast(source))
                     for start, _ in operator.mutation_positions(node)]
        for occurrence, (node, (line, _)) in enumerate(positions):
            if line not in inside:
                continue
            mutated = mutate_code(source, operator, occurrence)
            if mutated is None or mutated == source:
                continue
            before, after = changed_lines(lines, mutated.split("\n"))
            nth = seen.get((name, before, after), 0)
            seen[(name, before, after)] = nth + 1
            found.append(Mutant(part, name, before, after, nth, line, ASTQuery(node).get_definition_name() or "",
                                mutated))
    return found


def changed_lines(old: list[str], new: list[str]) -> tuple[str, str]:
    """The lines that differ between `old` and `new` (one changed stretch), stripped and joined."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    changes = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    _, i1, _, j1, _ = changes[0]
    _, _, i2, _, j2 = changes[-1]
    return "\n".join(s.strip() for s in old[i1:i2]), "\n".join(s.strip() for s in new[j1:j2])


def apply_listed(source: str, entry: dict) -> str:
    """`source` with a listed mutant applied by its text: the `nth` stretch of solution lines that
    reads `before` (whitespace stripped) becomes `after`, each line keeping its indentation.
    ValueError when the solution has no such stretch (the listing is out of date)."""
    lines, inside = source.split("\n"), solution_lines(source)
    before, after = entry["before"].split("\n"), entry["after"].split("\n")
    starts = [i for i in range(len(lines) - len(before) + 1) if i + 1 in inside and
              [s.strip() for s in lines[i:i + len(before)]] == before]
    if len(starts) <= entry.get("nth", 0):
        raise ValueError(f"no solution line reads {entry['before']!r} (occurrence {entry.get('nth', 0)}): "
                         "the worked solution changed; update or remove this entry")
    i = starts[entry.get("nth", 0)]
    indents = [s[:len(s) - len(s.lstrip())] for s in lines[i:i + len(before)]]
    new = [indents[min(j, len(indents) - 1)] + text for j, text in enumerate(after)]
    return "\n".join(lines[:i] + new + lines[i + len(before):])


def load_equivalents(part: str, folder: Path = EQUIVALENTS) -> list[dict]:
    """The entries of folder/<part>.json (none when there is no file)."""
    path = folder / f"{part}.json"
    return json.loads(path.read_text(encoding="utf-8"))["equivalent"] if path.is_file() else []


# --- running a part ---------------------------------------------------------------------------------

@contextlib.contextmanager
def parts_folder(solutions: dict[str, str]):
    """For the block: a temporary folder holding my_parts/NAME.py for every solution (as its `%%part`
    cell saves it), as the working directory and first on sys.path, so that a later part's module
    finds the earlier ones (`earlier_part`, `from my_parts.NAME import ...`). Modules of my_parts
    imported before are set aside meanwhile, and put back after."""
    aside = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "my_parts" or k.startswith("my_parts.")}
    with tempfile.TemporaryDirectory(prefix="kvlearn-mutants-") as tmp, contextlib.chdir(tmp):
        for name, source in solutions.items():
            save_part(name, source, Path(tmp) / "my_parts")
        sys.path.insert(0, tmp)
        try:
            yield Path(tmp)
        finally:
            sys.path.remove(tmp)
            for k in [k for k in sys.modules if k == "my_parts" or k.startswith("my_parts.")]:
                del sys.modules[k]
            sys.modules.update(aside)


def load_part(part: str, source: str):
    """Run `source` as the module my_parts.<part> (not remembered in sys.modules) and return the
    class or function its build exercise defines (`kvlearn.exercises.parts.BUILD`)."""
    spec = importlib.util.spec_from_loader(f"my_parts.{part}", loader=None)
    module = importlib.util.module_from_spec(spec)
    filename = f"my_parts/{part}.py"
    # What inspect.getsource reads for this file (Triton's jit does, to run a kernel): this text, the
    # mutant's, not the worked solution that parts_folder saved under the same name.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), vars(module))
    return getattr(module, BUILD[part][1])


# --- judging many mutants, one forked child each ------------------------------------------------------

@dataclass
class Verdict:
    """What became of one mutant: `killed`, `how` (check's hint line, or what ended the child), the
    seconds it took, and `rule`: the key of the suite's HINTS whose hint check printed (see `rule_of`)."""

    killed: bool
    how: str
    seconds: float
    rule: str = ""


def rule_of(part: str, hint: str | None) -> str:
    """The rule a failed check's hint line names: the key of the part's suite HINTS whose text the
    line starts with (the longest such text: a suite may add a note after a hint), else "(other hint)";
    "(no hint)" when the report has no hint line."""
    if hint is None:
        return "(no hint)"
    text = hint.removeprefix("Hint:").strip()
    found = [(len(h), key) for key, h in SUITES[part].module.HINTS.items() if text.startswith(h)]
    return max(found)[1] if found else "(other hint)"


def _judge_in_child(part: str, source: str, write_fd: int) -> None:
    """In the forked child: load the mutant, check it, write the verdict to `write_fd`. Never
    returns: the child ends here whatever happens (the parent's loop must not run in it)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with open("/proc/self/status") as status:
            held = int(next(line for line in status if line.startswith("VmSize:")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_BYTES, held + MEMORY_BYTES))
        torch.set_num_threads(1)
        result = check(part, load_part(part, source))
        lines = result.message.splitlines()
        hint = next((s for s in lines if s.startswith("Hint:")), None)
        verdict = {"killed": not result.passed, "how": (hint or lines[0])[:200],
                   "rule": rule_of(part, hint) if not result.passed else ""}
    except BaseException as error:   # whatever the mutant did, the parent gets a verdict
        verdict = {"killed": True, "how": f"loading or checking it raised {type(error).__name__}: {error}"[:200],
                   "rule": "(crashed)"}
    try:
        os.write(write_fd, json.dumps(verdict).encode())   # a few hundred bytes: one write, never blocks
    finally:
        os._exit(0)


def judge(part: str, sources: list[str], jobs: int = 1, timeout_s: float = 60.0, progress=None) -> list[Verdict]:
    """Check each source (a module of part `part`) in a child forked from this process, `jobs` at a
    time, each killed after `timeout_s` (a timeout kills the mutant). Call from the folder that holds
    my_parts/ (on sys.path). `progress(done, total)` is called after each one."""
    verdicts: list[Verdict | None] = [None] * len(sources)
    running: dict[int, tuple[int, int, float]] = {}   # read fd -> (index, pid, started)
    waiting = list(range(len(sources)))[::-1]
    done = 0
    while waiting or running:
        while waiting and len(running) < jobs:
            index = waiting.pop()
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _judge_in_child(part, sources[index], write_fd)
            os.close(write_fd)
            running[read_fd] = (index, pid, time.monotonic())
        first_deadline = min(started for _, _, started in running.values()) + timeout_s
        ready, _, _ = select.select(list(running), [], [], max(0.0, first_deadline - time.monotonic()))
        now = time.monotonic()
        for read_fd in list(running):
            index, pid, started = running[read_fd]
            if read_fd in ready:
                data = _read_all(read_fd)
                os.waitpid(pid, 0)
                try:
                    verdict = json.loads(data)
                    verdicts[index] = Verdict(verdict["killed"], verdict["how"], now - started, verdict["rule"])
                except ValueError:
                    verdicts[index] = Verdict(True, "the child died without a verdict", now - started, "(crashed)")
            elif now - started >= timeout_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                verdicts[index] = Verdict(True, f"no verdict within {timeout_s:g} s", now - started, "(time limit)")
            else:
                continue
            os.close(read_fd)
            del running[read_fd]
            done += 1
            if progress:
                progress(done, len(sources))
    return verdicts


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


# --- the command ------------------------------------------------------------------------------------

@dataclass
class PartResult:
    """One part's numbers: `mutants` judged, `killed`, `equivalent` (listed; they survived or not:
    a killed one is also a problem), the `survivors` not listed, `problems` with the listing, and
    `rules`: how many killed mutants got each rule's hint first (`rule_of`)."""

    part: str
    mutants: int
    killed: int
    equivalent: int
    survivors: list[Mutant]
    problems: list[str]   # listed entries out of date, a worked solution that fails
    seconds: float
    sampled: bool
    rules: collections.Counter = field(default_factory=collections.Counter)

    @property
    def kill_rate(self) -> float:
        judged = self.mutants - self.equivalent
        return 100.0 * self.killed / judged if judged else 100.0


def run_part(part: str, source: str, equivalents: list[dict], jobs: int, timeout_s: float,
             sample: int | None = None, out=sys.stdout) -> PartResult:
    """Make and judge the mutants of one part (call from the folder that holds my_parts/)."""
    start = time.monotonic()
    mutants = make_mutants(part, source)
    listed = {(e["operator"], e["before"], e["after"], e.get("nth", 0)): e for e in equivalents}
    made = {m.key for m in mutants}
    problems = [f"listed as equivalent but no longer made: {e['operator']}: {e['before']!r} -> {e['after']!r}"
                for key, e in listed.items() if key not in made]
    sampled = sample is not None and sample < len(mutants)
    if sampled:
        mutants = random.Random(0).sample(mutants, sample)
    baseline = judge(part, [source], 1, timeout_s)[0]
    if baseline.killed:
        return PartResult(part, 0, 0, 0, [], [f"the worked solution fails its own check: {baseline.how}"],
                          time.monotonic() - start, sampled)

    def progress(done, total):
        print(f"\r{part}: {done}/{total} mutants judged", end="", file=out, flush=True)

    shown = out.isatty()
    verdicts = judge(part, [m.source for m in mutants], jobs, timeout_s, progress if shown else None)
    if shown:
        print("\r" + " " * 60 + "\r", end="", file=out)
    killed = equivalent = 0
    survivors, rules = [], collections.Counter()
    for mutant, verdict in zip(mutants, verdicts, strict=True):
        if mutant.key in listed:
            equivalent += 1
            if verdict.killed:
                problems.append(f"listed as equivalent but killed ({verdict.how}): {mutant.operator}: "
                                f"{mutant.before!r} -> {mutant.after!r}")
        elif verdict.killed:
            killed += 1
            rules[verdict.rule] += 1
        else:
            survivors.append(mutant)
    return PartResult(part, len(mutants), killed, equivalent, survivors, problems, time.monotonic() - start,
                      sampled, rules)


def hint_tally(results: list[PartResult], top: int) -> str:
    """The rules whose hint check printed first for the most killed mutants: the `top` of each
    part, then of all parts together (a proxy for where learners' mistakes land, not a count of them)."""
    lines = [f"The hints check printed first, over the killed mutants (top {top}):"]
    overall = collections.Counter()
    for r in results:
        overall.update({f"{r.part}: {rule}": n for rule, n in r.rules.items()})
        shown = ", ".join(f"{rule} {n}" for rule, n in r.rules.most_common(top))
        lines.append(f"  {r.part} ({r.killed} killed): {shown or '-'}")
    lines.append("  all parts: " + (", ".join(f"{rule} {n}" for rule, n in overall.most_common(top)) or "-"))
    return "\n".join(lines)


def summary(results: list[PartResult]) -> str:
    """The table of the parts' numbers, then each survivor (with its entry for the listing) and each problem."""
    rows = [("part", "mutants", "killed", "equivalent", "survived", "kill rate", "time")]
    for r in results:
        rows.append((r.part + (" (sample)" if r.sampled else ""), str(r.mutants), str(r.killed), str(r.equivalent),
                     str(len(r.survivors)), f"{r.kill_rate:.1f} %", f"{r.seconds:.0f} s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                      for row in rows)
    notes = []
    for r in results:
        for mutant in r.survivors:
            notes.append(f"{r.part}: survived, line {mutant.line} ({mutant.where}), "
                         f"{mutant.operator}:\n{mutant.diff()}\n"
                         f"  kill it with a stronger suite, or list it as equivalent in tests/data/mutants/"
                         f"{r.part}.json:\n  {json.dumps(mutant.entry('why it behaves the same'))}")
        notes += [f"{r.part}: {problem}" for problem in r.problems]
    return table + ("\n\n" + "\n\n".join(notes) if notes else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", action="append", choices=list(BUILD), help="a part to test (repeat; default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants judged at once (default 1)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a mutant may take (default 60)")
    parser.add_argument("--sample", type=int, help="judge this many mutants per part, drawn at random (seeded)")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="the instructor notebooks' folder")
    parser.add_argument("--equivalents", type=Path, default=EQUIVALENTS, help="folder of <part>.json")
    parser.add_argument("--hints", type=int, nargs="?", const=3, default=0, metavar="N",
                        help="tally the rule whose hint check printed first for each killed mutant, and print the "
                             "N most common per part and overall (default 3)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0 or (args.sample is not None and args.sample < 1) or args.hints < 0:
        parser.error("--jobs, --sample and --hints take a positive count, --timeout a positive number of seconds")
    try:
        import cosmic_ray  # noqa: F401  (only to say what to install)
    except ImportError:
        print(TOOL_HINT, file=sys.stderr)
        return 2
    solutions = worked_solutions(args.notebooks, args.equivalents)
    parts = args.part or [name for name in BUILD if name in solutions]
    if "decode_kernel" in parts:   # a Triton kernel: interpreted on a CPU, triton loaded once before the forks
        interpret_here()
        import kvlearn.kernels.decode  # noqa: F401
    missing = [name for name in parts if name not in solutions]
    if missing:
        print(f"no %%part cell for {', '.join(missing)} in {args.notebooks}", file=sys.stderr)
        return 2
    results = []
    with parts_folder(solutions):
        for name in parts:
            results.append(run_part(name, solutions[name], load_equivalents(name, args.equivalents), args.jobs,
                                    args.timeout, args.sample))
            print(f"{name}: {results[-1].mutants} mutants, {results[-1].killed} killed, "
                  f"{results[-1].equivalent} equivalent, {len(results[-1].survivors)} survived", flush=True)
    print()
    print(summary(results))
    if args.hints:
        print()
        print(hint_tally(results, args.hints))
    return 1 if any(r.survivors or r.problems for r in results) else 0
