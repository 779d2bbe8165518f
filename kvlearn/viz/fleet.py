"""Pictures of a fleet: every replica's radix tree, side by side (chapter 7)."""

from __future__ import annotations

from pathlib import Path

from kvlearn.viz.radix import draw_radix


def replica_trees(caches, tokenizer=None, width: int = 12) -> list:
    """One graphviz picture per replica's RadixCache, titled with its index."""
    pictures = []
    for i, cache in enumerate(caches):
        g = draw_radix(cache, tokenizer, width=width)
        g.attr(label=f"replica {i}: {cache.total_size} tokens cached")
        pictures.append(g)
    return pictures


def side_by_side(pictures):
    """An HTML row of the pictures (for a notebook cell); each is a graphviz Digraph."""
    from IPython.display import HTML

    cells = "".join(f'<div style="flex: 1; min-width: 0">{g.pipe(format="svg").decode()}</div>' for g in pictures)
    return HTML(f'<div style="display: flex; gap: 12px; align-items: flex-start">{cells}</div>')


def save_trees(pictures, name: str, folder: Path) -> list[Path]:
    """Write each picture as <folder>/<name>_replica<i>.svg."""
    paths = []
    for i, g in enumerate(pictures):
        path = Path(folder) / f"{name}_replica{i}.svg"
        path.write_bytes(g.pipe(format="svg"))
        paths.append(path)
    return paths
