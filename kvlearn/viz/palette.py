"""One colour per state, the same in every picture of the course: a colour that means "locked" in
chapter 3 means it in chapter 6 too, and no other state shares it.

    STATES    the fill of a block, slot, tree node or grid cell by the state of the KV it stands for:
              free, new (computed in this step), cached (kept, nobody holds it: evictable),
              locked (held by a running request; blocks say "in use"), shared (held by several),
              split, evicted, and where it lives: device, host, disk
    MASK      the cells of an attention mask (chapter 5)
    REQUESTS  what a request did in a step (chapter 6's timeline); prefill is "new", decode "locked"
    OWNERS    one colour per sequence or owner, for arrows and owned slots (identities, not states)
    INK       lines and text that carry no state: edges, frames, headers, the walked path
    FORMATS   a KV format's point by how it was measured: stored in the pool, or simulated (chapter 10)
    HEAT      the colour map of magnitudes (|K| and |V| by token and channel, chapter 10)

Invariant: no two states share a colour; every module of kvlearn.viz takes its colours from here
(tests/test_viz_palette.py checks both). Fills are pale, so black text stays readable on a projector.
"""

from __future__ import annotations

STATES = {
    "free": "#ffffff",        # white
    "new": "#fbb4ae",         # pink: K and V computed in this step
    "cached": "#ccebc5",      # green: kept after use, nobody holds it (evictable)
    "locked": "#b3cde3",      # blue: held by a running request
    "shared": "#fdcdac",      # orange: held by several requests at once
    "split": "#fff2ae",       # yellow: cut in two by the step
    "evicted": "#e0e0e0",     # grey (drawn dashed): dropped by the step
    "device": "#bebada",      # purple: in the device pool
    "host": "#8dd3c7",        # teal: in host memory only
    "disk": "#a6761d",        # brown: pages also on disk (a border: a copy below the memory tiers)
}
ALIASES = {"evictable": "cached", "in use": "locked"}  # the same state under a chapter's own name

MASK = {"padding": "#bdbdbd", "hidden (future)": "#ffffff", "may attend": "#3182bd"}

REQUESTS = {"waiting": "#f0f0f0", "prefill": STATES["new"], "decode": STATES["locked"], "deferred": "#fdb863",
            "preempted": "#000000", "done": "#ffffff"}

OWNERS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]

FORMATS = {"stored in the pool": "#2b8cbe", "simulated, not stored": "#d95f0e"}

HEAT = "viridis"

INK = {"edge": "#555555", "header": "#eeeeee", "path": "#d62728", "held by others": "#9e9e9e"}


def state_color(name: str) -> str:
    """The fill of a state, by its name or a chapter's alias ("evictable", "in use"); a node on
    several tiers ("device+host") is a graphviz gradient of theirs, left to right."""
    if "+" in name:
        return ":".join(state_color(part) for part in name.split("+"))
    return STATES[ALIASES.get(name, name)]


def legend(*names: str) -> dict[str, str]:
    """{name: colour} of the states named, in that order: what a picture's legend shows."""
    return {name: state_color(name) for name in names}


def owner_color(k: int) -> str:
    """The colour of the k-th sequence or owner (cycling)."""
    return OWNERS[k % len(OWNERS)]
