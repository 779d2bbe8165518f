"""Where figures go, and how they are written so that re-running code gives the same files."""

from __future__ import annotations

from pathlib import Path

FIGURES = Path(__file__).resolve().parent.parent / "figures"


def save_figure(fig, name: str, folder: Path = FIGURES) -> Path:
    """Save a matplotlib figure as <folder>/<name>.png (figures/ by default) without a timestamp or
    version stamp, so the same figure always gives the same file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    return path
