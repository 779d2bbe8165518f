"""Pictures of a radix tree (chapter 3): the tree as text and as a graphviz picture, and a
recorded trace of insert / match / lock / unlock / evict to step through.

A recorded step keeps frozen copies of the nodes, so it shows the tree as it was even after later
steps changed it; nodes are named by their ids, so the same state gives the same text and picture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvlearn.viz.palette import INK, legend
from kvlearn.viz.text import edge_tokens, graphviz_escape, legend_table, slot_ranges, tree_lines

if TYPE_CHECKING:
    import graphviz

# Fill colours of a tree node (the course's palette): its state, or what the step just recorded did to it.
_RADIX_COLORS = legend("evictable", "locked", "new", "split", "evicted")


class _NodeView(NamedTuple):
    """A frozen copy of one tree node, so that a recorded step keeps showing the tree as it was."""

    id: int
    parent: int | None
    key: tuple
    slots: list
    lock_ref: int
    last_access: int


def _radix_view(cache) -> tuple[str, list[_NodeView]]:
    """(repr of the cache, every node frozen), root first, children in token order."""
    return repr(cache), [_NodeView(n.id, n.parent.id if n.parent is not None else None, n.key,
                                   n.value.tolist(), n.lock_ref, n.last_access) for n in cache.nodes()]


def _radix_state(v: _NodeView, marks: dict) -> str:
    return marks.get(v.id) or ("locked" if v.lock_ref else "evictable")


def _radix_children(views: list[_NodeView], ghosts: list[_NodeView]) -> dict:
    """parent id -> children in token order; just-evicted nodes hang where they were."""
    children: dict = {}
    for v in views[1:] + ghosts:
        children.setdefault(v.parent, []).append(v)
    for kids in children.values():
        kids.sort(key=lambda v: v.key)
    return children


def _radix_lines(header: str, views, tokenizer=None, marks=None, ghosts=(), width: int = 28) -> str:
    marks, children = marks or {}, _radix_children(views, list(ghosts))

    def label(v: _NodeView) -> str:
        state = _radix_state(v, marks)
        return (f"#{v.id} {edge_tokens(v.key, tokenizer, width)}  {len(v.key)} tok, slots {slot_ranges(v.slots)}, "
                f"lock_ref={v.lock_ref}, t={v.last_access}" + ("" if state == "evictable" else f"  <{state}>"))

    lines = tree_lines(views[0], lambda v: children.get(v.id, []), label)
    return "\n".join([header, f"root  lock_ref={views[0].lock_ref}", *lines])


def radix_text(cache, tokenizer=None, width: int = 28) -> str:
    """The tree as indented text, one line per node: id, tokens (decoded when a tokenizer is
    given, elided past `width` characters), slot ranges, lock_ref, last access time, and <locked>.
    The same state gives the same text."""
    return _radix_lines(*_radix_view(cache), tokenizer, width=width)


def tree_digraph(name: str, label: str, ranksep: str = "0.45") -> graphviz.Digraph:
    """An empty top-down graphviz picture titled `label` (already escaped), with the rounded boxes
    and fonts of every tree picture (this module's and `kvlearn.viz.tiers`')."""
    import graphviz

    return graphviz.Digraph(name, graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": ranksep,
                                              "label": label, "labelloc": "t", "fontname": "Helvetica"},
                            node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                       "fontsize": "10"},
                            edge_attr={"fontname": "Helvetica", "fontsize": "10"})


def _radix_graph(title: list[str], views, tokenizer=None, marks=None, ghosts=(), path=(),
                 width: int = 20) -> graphviz.Digraph:
    marks = marks or {}
    g = tree_digraph("radix", "\\n".join(map(graphviz_escape, title)))
    root = views[0]
    g.node(f"n{root.id}", f"root\\nlock_ref={root.lock_ref}", fillcolor=_RADIX_COLORS[_radix_state(root, {})])
    for v in views[1:] + list(ghosts):
        state = _radix_state(v, marks)
        g.node(f"n{v.id}", f"#{v.id}  {len(v.key)} tok\\nslots {slot_ranges(v.slots)}\\n"
                           f"lock_ref={v.lock_ref}  t={v.last_access}",
               fillcolor=_RADIX_COLORS[state], style="rounded,filled" + (",dashed" if state == "evicted" else ""))
    for parent, kids in sorted(_radix_children(views, list(ghosts)).items()):
        for v in kids:
            bold = v.id in path
            g.edge(f"n{parent}", f"n{v.id}", label=" " + graphviz_escape(edge_tokens(v.key, tokenizer, width)),
                   color=INK["path"] if bold else "black", penwidth="2.5" if bold else "1",
                   style="dashed" if marks.get(v.id) == "evicted" else "solid")
    g.node("legend", f"<{legend_table(_RADIX_COLORS)}>", shape="plaintext", style="", fontsize="9")
    return g


def draw_radix(cache, tokenizer=None, width: int = 20) -> graphviz.Digraph:
    """The tree as a graphviz picture: edges labelled with their tokens (decoded when a tokenizer
    is given, elided past `width` characters), nodes with id, slot ranges, lock_ref and last
    access; locked nodes blue."""
    header, views = _radix_view(cache)
    return _radix_graph([header], views, tokenizer, width=width)


class RadixStep(NamedTuple):
    """One recorded step: what was done, the tree after it, and which nodes it split, created
    (`marks`: id -> 'split' | 'new' | 'evicted'), evicted (`ghosts`) or walked (`path`)."""

    description: str
    header: str
    views: list
    marks: dict
    ghosts: list
    path: frozenset


class RadixTrace:
    """Runs insert / match / lock / unlock / evict on a RadixCache (or a learner's `radix_cache`
    part: only the members of `kvlearn.parts.RadixCachePart` and `RadixNode` are read) and records
    each step.

    `text(i)` and `draw(i)` show step i (step 0 is the tree when recording began), colouring the
    nodes that step split, created or evicted; `radix_widget(trace)` steps through them.
    """

    def __init__(self, cache, tokenizer=None):
        self.cache, self.tokenizer = cache, tokenizer
        self.steps = [RadixStep("step 0: start", *_radix_view(cache), {}, [], frozenset())]

    def __len__(self) -> int:
        return len(self.steps)

    def _tokens(self, key) -> str:
        return edge_tokens(key.tolist() if hasattr(key, "tolist") else list(key), self.tokenizer, 40)

    def _record(self, what: str, path_node=None) -> None:
        before = {v.id: v for v in self.steps[-1].views}
        header, views = _radix_view(self.cache)
        now = {v.id for v in views}
        marks = {}
        for v in views[1:]:
            if v.id not in before:  # a new node above an older one is the upper half of a split
                marks[v.id] = "split" if any(c.parent == v.id and c.id in before for c in views) else "new"
        ghosts = [v for i, v in before.items() if i not in now]
        marks.update((g.id, "evicted") for g in ghosts)
        path = set()
        while path_node is not None:
            path.add(path_node.id)
            path_node = path_node.parent
        self.steps.append(RadixStep(f"step {len(self.steps)}: {what}", header, views, marks, ghosts,
                                    frozenset(path)))

    def insert(self, key, value) -> int:
        present = self.cache.insert(key, value)
        self._record(f"insert {self._tokens(key)} -> {present} tokens were already cached")
        return present

    def match(self, key):
        result = self.cache.match_prefix(key)
        self._record(f"match {self._tokens(key)} -> {len(result)} tokens, slots "
                     f"{slot_ranges(result.indices.tolist()) or 'none'}, ends at #{result.last_node.id}",
                     result.last_node)
        return result

    def lock(self, node) -> None:
        self.cache.lock(node)
        self._record(f"lock #{node.id} -> protected {self.cache.protected_size}, "
                     f"evictable {self.cache.evictable_size}", node)

    def unlock(self, node) -> None:
        self.cache.unlock(node)
        self._record(f"unlock #{node.id} -> protected {self.cache.protected_size}, "
                     f"evictable {self.cache.evictable_size}", node)

    def evict(self, num_tokens: int) -> int:
        # Listen to the eviction callback to tell the order the nodes went in: a slot is held by one
        # node, so the slots handed over name it (a part may hand over a copy of node.value).
        node_of = {tuple(n.value.tolist()): n.id for n in self.cache.nodes()[1:]}
        order, callback = [], self.cache.evict_callback

        def listen(value):
            order.append(node_of.get(tuple(value.tolist()), "?"))
            if callback is not None:
                callback(value)

        self.cache.evict_callback = listen
        try:
            freed = self.cache.evict(num_tokens)
        finally:
            self.cache.evict_callback = callback
        gone = ", then ".join(f"#{i}" for i in order)
        self._record(f"evict({num_tokens}) -> freed {freed} tokens" + (f": {gone}" if gone else ""))
        return freed

    def text(self, i: int) -> str:
        s = self.steps[i]
        return f"{s.description}\n" + _radix_lines(s.header, s.views, self.tokenizer, s.marks, s.ghosts)

    def draw(self, i: int) -> graphviz.Digraph:
        s = self.steps[i]
        return _radix_graph([s.description, s.header], s.views, self.tokenizer, s.marks, s.ghosts, s.path)


def radix_widget(trace: RadixTrace, step: int = 0):
    """A slider over the recorded steps with each step's description and picture (ipywidgets).

    Run headless (nbval, nbconvert) the widget is built but nobody sees it: print
    `trace.text(i)` next to it to show the same step as checked text.
    """
    import ipywidgets as widgets

    if not 0 <= step < len(trace):
        raise ValueError(f"step must be in 0..{len(trace) - 1}, got {step}.")
    slider = widgets.IntSlider(value=step, min=0, max=len(trace) - 1, description="step",
                               continuous_update=False)
    caption, picture = widgets.Label(), widgets.HTML()

    def show(i: int) -> None:
        caption.value = trace.steps[i].description
        picture.value = trace.draw(i).pipe(format="svg", encoding="utf-8")

    slider.observe(lambda change: show(change["new"]), names="value")
    show(step)
    return widgets.VBox([slider, caption, picture])
