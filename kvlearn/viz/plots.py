"""Where figures go, and how they are written so that re-running code gives the same files.

Figures go where the user works, never into the installed package: `$KVLEARN_FIGURES` when set,
else the nearest `figures/` folder in the current directory (or the one given) or above it (the
course's figures/, whether a notebook runs in notebooks/ or student/, or a command at the top of a
clone), else a new figures/ in that directory. Where kvlearn itself lives plays no part: run from a
folder outside the clone, `bench` and `demo` never overwrite the clone's committed figures.
"""

from __future__ import annotations

import os
from pathlib import Path

FIGURES_VARIABLE = "KVLEARN_FIGURES"


def figures_dir(start: str | os.PathLike | None = None) -> Path:
    """The folder figures are written to, looked for from `start` (default: the current directory;
    see the module docstring); decided at call time."""
    named = os.environ.get(FIGURES_VARIABLE, "").strip()
    if named:
        return Path(named).expanduser()
    here = Path.cwd() if start is None else Path(start).expanduser().absolute()
    for folder in (here, *here.parents):
        if (folder / "figures").is_dir():
            return folder / "figures"
    return here / "figures"


def save_figure(fig, name: str, folder: Path | None = None) -> Path:
    """Save a matplotlib figure as <folder>/<name>.png (`figures_dir()` by default) without a
    timestamp or version stamp, so the same figure always gives the same file."""
    folder = figures_dir() if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    return path
