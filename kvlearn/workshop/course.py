"""`python -m kvlearn course`: run the whole course the way a room will, the night before.

Every chapter notebook is executed top to bottom in its own fresh kernel, in order, with a progress
bar over all code cells. Nothing is written back to the notebooks. The summary gives, per chapter,
the wall time, the cells run, the exercises the checkers accepted, the slowest cell, and PASS or
FAIL (FAIL names the cell and the error, or the timeout; the next chapter still runs). Then it gathers the
parts the chapters' build exercises saved (`my_parts/` beside the notebooks) and prints, per part,
whether it passes its check ("4 of 6 parts pass"). `--guide FILE` writes both tables, as markdown,
between the course-times markers of the instructor guide; every argument is checked before the
first kernel starts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvlearn.exercises import NOT_YET, OK
from kvlearn.exercises.parts import FOLDER, Gathered, gather_parts, parts_table

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"  # kvlearn/workshop/ -> the repository
GUIDE_MARKERS = ("<!-- course-times: begin -->", "<!-- course-times: end -->")


@dataclass
class ChapterRun:
    notebook: str
    seconds: float = 0.0
    cells: int = 0              # code cells in the notebook
    ran: int = 0                # code cells executed (all of them unless one failed)
    exercises: int = 0          # cells whose checker printed a verdict
    solved: int = 0             # ... and the verdict was OK
    slowest: tuple = (0.0, 0)   # (seconds, code cell number)
    error: str = ""             # "cell N: ErrorName: message" when a cell raised or timed out
    cell_seconds: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.error and self.ran == self.cells


def chapter_notebooks(folder: Path = NOTEBOOKS) -> list[Path]:
    if not Path(folder).is_dir():
        raise (NotADirectoryError if Path(folder).exists() else FileNotFoundError)(
            f"--notebooks {folder} is not a folder: pass the folder that holds the NN_name.ipynb chapters")
    paths = sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no chapter notebooks (NN_name.ipynb) in {folder}: pass --notebooks FOLDER")
    return paths


def run_notebook(path: Path, timeout: int = 600, on_cell=lambda: None, nb=None) -> ChapterRun:
    """Execute one notebook in a fresh kernel, started in the notebook's folder; never raises for
    a failing cell, a cell that runs over `timeout` seconds or a dead kernel (the run records it and
    stops that chapter). `nb`: the notebook read from `path`, to keep its new outputs (else it is
    read here and the outputs are dropped)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4) if nb is None else nb
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    run = ChapterRun(path.stem, cells=len(code))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    # the kernel's own stderr only warns that it listens on localhost; errors come back as messages
    with client.setup_kernel(stderr=subprocess.DEVNULL):
        for number, (index, cell) in enumerate(code, 1):
            began = time.perf_counter()
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as err:
                run.error = f"cell {number}: {err.ename}: {err.evalue}"
                break
            except CellTimeoutError:
                run.error = f"cell {number}: timeout: still running after {timeout} s (raise --timeout)"
                client.shutdown_kernel = "immediate"  # the kernel is busy: a graceful stop would wait
                break
            except DeadKernelError:
                run.error = f"cell {number}: the kernel died (out of memory? `make check` tells)"
                break
            finally:
                run.cell_seconds.append(time.perf_counter() - began)
                on_cell()
            run.ran = number
            text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            run.exercises += OK in text or NOT_YET in text
            run.solved += OK in text
    run.seconds = time.perf_counter() - start
    if run.cell_seconds:
        worst = max(range(len(run.cell_seconds)), key=run.cell_seconds.__getitem__)
        run.slowest = (run.cell_seconds[worst], worst + 1)
    return run


def run_course(paths: list[Path], timeout: int = 600, progress: bool = True) -> list[ChapterRun]:
    import nbformat

    from kvlearn.progress import progress_bar

    total = sum(c.cell_type == "code" for p in paths for c in nbformat.read(p, as_version=4).cells)
    runs = []
    with progress_bar(total=total, unit="cell", desc="course", disable=not progress) as bar:
        for path in paths:
            bar.set_postfix_str(path.stem)
            runs.append(run_notebook(path, timeout, on_cell=lambda: bar.update(1)))
            bar.update(runs[-1].cells - len(runs[-1].cell_seconds))  # cells skipped after a failure
    return runs


def table(runs: list[ChapterRun], markdown: bool = False) -> str:
    """The per-chapter summary, as aligned text for a terminal or as a markdown table."""
    header = ("chapter", "time", "cells", "exercises OK", "slowest cell", "result")
    rows = [(r.notebook, f"{r.seconds:.1f} s", f"{r.ran}/{r.cells}", f"{r.solved}/{r.exercises}",
             f"{r.slowest[0]:.1f} s (#{r.slowest[1]})", "PASS" if r.passed else f"FAIL {r.error}")
            for r in runs]
    total = sum(r.seconds for r in runs)
    passed = sum(r.passed for r in runs)
    rows.append(("whole course", f"{total:.0f} s", f"{sum(r.ran for r in runs)}/{sum(r.cells for r in runs)}",
                 f"{sum(r.solved for r in runs)}/{sum(r.exercises for r in runs)}", "",
                 f"{passed}/{len(runs)} PASS"))
    if markdown:
        lines = [header, ("---",) * len(header), *rows]
        return "\n".join("| " + " | ".join(row) + " |" for row in lines)
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in (header, *rows))


def write_guide(guide: Path, runs: list[ChapterRun], parts: list[Gathered]) -> None:
    """Replace the tables between the guide's course-times markers with this run's."""
    begin, end = GUIDE_MARKERS
    text = guide_text(guide)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    block = (f"{begin}\nMeasured {datetime.date.today()} on {machine} with `make course` "
             f"(model already converted):\n\n{table(runs, markdown=True)}\n\n"
             f"The build exercises' parts, as the run left them in `{FOLDER}/`:\n\n"
             f"{parts_table(parts, markdown=True)}\n{end}")
    guide.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S))


def guide_text(guide: Path) -> str:
    """The guide's text; ValueError when it lacks the course-times markers (checked before a run)."""
    begin, end = GUIDE_MARKERS
    text = Path(guide).read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{guide} has no `{begin}` ... `{end}` block to write the timings into")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn course", description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS,
                        help="folder of NN_*.ipynb (default: the course's)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (default 600)")
    parser.add_argument("--guide", type=Path, help="also write the table into this guide (docs/instructor.md)")
    args = parser.parse_args(argv)
    if args.timeout < 1:
        parser.error(f"--timeout must be at least 1 second, got {args.timeout}")
    try:  # every input is checked before the first kernel starts
        paths = chapter_notebooks(args.notebooks)
        if args.guide:
            guide_text(args.guide)
    except (OSError, ValueError) as err:
        print(f"python -m kvlearn course: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    runs = run_course(paths, args.timeout)
    print("\n" + table(runs))
    parts = gather_parts(Path(args.notebooks) / FOLDER)   # where the chapters' %%part cells saved them
    print("\n" + parts_table(parts))
    if args.guide:
        write_guide(args.guide, runs, parts)
        print(f"\ntimings written to {args.guide}")
    return 0 if all(r.passed for r in runs) else 1
