"""How the pictures write tokens, slots, legends and trees: the text helpers every viz module shares.

Plain strings only (no graphviz, no matplotlib), so the text renderers work where neither is installed.
"""

from __future__ import annotations


def elide(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, keeping its start and end around a '…'."""
    return text if len(text) <= limit else text[:limit - limit // 3 - 1] + "…" + text[-(limit // 3):]


def edge_tokens(key, tokenizer=None, limit: int = 28) -> str:
    """The tokens of an edge: decoded text in quotes with a tokenizer, else the ids in brackets."""
    if tokenizer is not None:
        return repr(elide(tokenizer.decode(list(key)), limit))
    return f"[{elide(' '.join(map(str, key)), limit)}]"


def slot_ranges(slots: list[int], limit: int = 3) -> str:
    """Slot ids as runs, e.g. '0-3,7,9-10' (the first `limit` runs, then '…')."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append(f"{slots[start]}" if i - 1 == start else f"{slots[start]}-{slots[i - 1]}")
            start = i
    return ",".join(runs[:limit]) + (",…" if len(runs) > limit else "")


def graphviz_escape(text: str) -> str:
    """Backslashes in decoded text would read as graphviz escapes: double them."""
    return text.replace("\\", "\\\\")


def legend_table(colors: dict[str, str], note: str = "") -> str:
    """A graphviz HTML table of one row: a cell per state filled with its colour, then `note`
    (borderless) if given."""
    cells = "".join(f'<TD BGCOLOR="{color}">{name}</TD>' for name, color in colors.items())
    if note:
        cells += f'<TD BORDER="0">{note}</TD>'
    return f'<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2"><TR>{cells}</TR></TABLE>'


def tree_lines(root, children, label) -> list[str]:
    """The nodes below `root` as indented lines ('├─', '└─'), depth first: `children(node)` gives
    a node's children in the order shown, `label(node)` the text after the branch."""
    lines = []

    def walk(node, indent):
        kids = children(node)
        for k, child in enumerate(kids):
            last = k == len(kids) - 1
            lines.append(f"{indent}{'└─' if last else '├─'} {label(child)}")
            walk(child, indent + ("   " if last else "│  "))

    walk(root, "")
    return lines
