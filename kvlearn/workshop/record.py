"""`python -m kvlearn record [NOTEBOOK ...]`: re-execute chapter notebooks in place, on a quiet machine.

The committed outputs are course material that strict nbval re-checks and that the prose reads
from, so they must come from a quiet run: timings taken beside other jobs contradict the text. Each
notebook runs top to bottom in a fresh kernel (as `course` runs it); if every cell passed, the load
average before it was at or below `MAX_LOAD_PER_CORE` per core, and other processes took at most
`MAX_OTHERS_PER_CORE` of each core while it ran, the notebook is written back with `metadata.kvlearn`:
when it ran, the load average before and after, the cores, the cores' worth of CPU that others took
(`others`), and the plain-read bandwidth measured just before (the yardstick that the course's speed
figures are read against). The load average after a run counts the notebook's own work: a chapter
that keeps 2 cores busy for two minutes ends near 1.7 on a machine with nothing else on it, so the
CPU time of everything else is measured instead (Linux's /proc/stat; elsewhere the load after).
A loaded or failed run writes nothing, figures included: the cells write theirs into a scratch copy
of the course's figures/, copied back only with the notebook. `tests/test_notebooks.py` refuses a
committed notebook whose record is missing or loaded.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import tempfile
import time
from pathlib import Path

from kvlearn.viz.plots import FIGURES_VARIABLE, figures_dir
from kvlearn.workshop.course import chapter_notebooks, run_notebook
from kvlearn.workshop.student import copy_figures

MAX_LOAD_PER_CORE = 0.75  # 1.5 on the course's 2-core machines
MAX_OTHERS_PER_CORE = 0.1  # 0.2 of a core on 2: what a quiet machine's daemons take


def load_average() -> float:
    """The one-minute load average."""
    return round(os.getloadavg()[0], 2)


def cpu_seconds() -> tuple[float, float, float] | None:
    """(a monotonic clock, CPU seconds the whole machine has been busy, CPU seconds of this process and
    its waited-for children, the kernels among them), or None without /proc/stat. Busy: all but idle,
    iowait and the guest columns (already inside user)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    busy = sum(int(f) for i, f in enumerate(fields) if i not in (3, 4, 8, 9)) / os.sysconf("SC_CLK_TCK")
    mine = sum(t for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for t in resource.getrusage(who)[:2])
    return time.monotonic(), busy, mine


def others(start: tuple[float, float, float] | None) -> float | None:
    """Cores' worth of CPU that other processes took since `start` (a `cpu_seconds()`), or None."""
    end = cpu_seconds()
    if start is None or end is None or end[0] <= start[0]:
        return None
    return round(max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]), 2)


def quiet(load: float, cores: int | None = None) -> bool:
    return load <= MAX_LOAD_PER_CORE * (cores or os.cpu_count() or 1)


def ran_quietly(others: float | None, load_after: float, cores: int) -> bool:
    """Whether a run was left alone: other processes took at most `MAX_OTHERS_PER_CORE` of each core,
    or, where that was not measured (`others` None), the load after it was quiet."""
    return others <= MAX_OTHERS_PER_CORE * cores if others is not None else quiet(load_after, cores)


def record(path: Path, timeout: int = 600) -> str:
    """Execute one notebook and write it back with its record; returns what happened, in a line."""
    import nbformat

    from kvlearn.decoding import plain_read_gb_s

    nb = nbformat.read(path, as_version=4)
    cores, before, bandwidth = os.cpu_count(), load_average(), round(plain_read_gb_s(), 1)
    if not quiet(before, cores):
        return (f"{path.name}: not run, load {before} on {cores} cores (above {MAX_LOAD_PER_CORE} per core): "
                "wait for a quiet machine")
    course = figures_dir(path.parent)
    with tempfile.TemporaryDirectory(prefix="kvlearn-figures-") as scratch:
        figures, previous = copy_figures(course, Path(scratch)), os.environ.get(FIGURES_VARIABLE)
        os.environ[FIGURES_VARIABLE] = str(figures)   # the kernel inherits it
        try:
            start = cpu_seconds()
            run = run_notebook(path, timeout, nb=nb)
            busy = others(start)
        finally:
            if previous is None:
                del os.environ[FIGURES_VARIABLE]
            else:
                os.environ[FIGURES_VARIABLE] = previous
        after = load_average()
        if not run.passed:
            return f"{path.name}: FAIL {run.error}; nothing written"
        if not ran_quietly(busy, after, cores):
            why = f"other processes took {busy} of" if busy is not None else f"the load rose to {after} on"
            return f"{path.name}: ran, but {why} {cores} cores; nothing written"
        copy_figures(figures, course)
    nb.metadata["kvlearn"] = {"executed": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                              "load_before": before, "load_after": after, "cores": cores, "others": busy,
                              "plain_read_gb_s": bandwidth}
    nbformat.write(nb, path)
    return (f"{path.name}: recorded in {run.seconds:.1f} s, load {before} -> {after}, others {busy} cores, "
            f"plain read {bandwidth} GB/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn record", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to record (default: every chapter)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (default 600)")
    args = parser.parse_args(argv)
    paths = args.notebooks or chapter_notebooks()
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lines = [record(Path(p), args.timeout) for p in paths]
    print("\n".join(lines))
    return 0 if all(": recorded" in line for line in lines) else 1
