"""Where figures go, and how they are written so that re-running code gives the same files."""

from __future__ import annotations

from pathlib import Path

FIGURES = Path(__file__).resolve().parent.parent / "figures"


def save_figure(fig, name: str) -> Path:
    """Save a matplotlib figure as figures/<name>.png without a timestamp or version stamp."""
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    return path
