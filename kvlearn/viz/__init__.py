"""Pictures of the cache structures: graphviz for notebooks, text for terminals and tests.

Every drawing is deterministic (nodes named by ids, no addresses or times), so the same state
always gives the same picture and the same text.
"""

from __future__ import annotations

from typing import NamedTuple

import graphviz
import torch

from kvlearn.blocks import short_hash
from kvlearn.sequence import shorten

# --- block tables (chapters 1-2) -----------------------------------------------------------

# Fill colours of a physical block by state: the same four states in picture and text.
_BLOCK_COLORS = {"free": "white", "cached": "#d9f0d3", "in use": "#cfe2f3", "shared": "#f9cb9c"}
_SEQ_EDGE_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]


def _block_state(manager, block) -> str:
    if block.ref_count > 1:
        return "shared"
    if block.ref_count == 1:
        return "in use"
    return "cached" if manager.is_cached(block.block_id) else "free"


def _tokens(ids, limit=6) -> str:
    return shorten(ids, limit, " …")


def blocks_text(manager, seqs, tokenizer=None, width: int = 96) -> str:
    """Block tables of `seqs`, then every physical block that is in use or remembers a hash, as text.

    A free block is "cached" only if `hash_to_block_id` points at it (a later request can find it).
    With a tokenizer, a block's tokens show as the text they decode to (in quotes, at most `width`
    characters), else as ids. A column of the block list that is empty in every row (no block has
    a hash, or tokens) is left out.
    """
    def tokens(ids) -> str:
        if tokenizer is not None:
            return repr(_elide(tokenizer.decode(list(ids)), width))
        return f"[{_tokens(ids, 16)}]"

    states = [_block_state(manager, b) for b in manager.blocks]
    lines = [f"{manager.num_blocks} blocks of {manager.block_size} tokens: "
             + ", ".join(f"{states.count(s)} {s}" for s in _BLOCK_COLORS)]
    for seq in seqs:
        lines.append(f"seq {seq.seq_id}: {seq.num_tokens} tokens, {seq.num_cached_tokens} cached, "
                     f"block_table {seq.block_table}")
        for i, block_id in enumerate(seq.block_table):
            lines.append(f"  logical {i:>2} -> block {block_id:>2}  {tokens(seq.block(i))}")
    listed = [(b, state) for b, state in zip(manager.blocks, states) if state != "free" or b.hash is not None]
    show_hash, show_tokens = any(b.hash is not None for b, _ in listed), any(b.token_ids for b, _ in listed)
    rows = [("block", "ref", "state", "hash", "tokens")]
    rows += [(b.block_id, b.ref_count, state, short_hash(b.hash),
              "" if not b.token_ids else tokens(b.token_ids) if tokenizer is not None else _tokens(b.token_ids, 16))
             for b, state in listed]
    for block_id, ref, state, hash_, toks in rows:
        line = f"{block_id:>5}  {ref:>3}  {state:<6}" + (f"  {hash_:<6}" if show_hash else "")
        lines.append(line + f"  {toks}" if show_tokens else line.rstrip())
    lines.append(f"free list (handed out first -> last): {manager.free_block_ids}")
    return "\n".join(lines)


def _html_table(title: str, rows: list[str]) -> str:
    return (f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="4">'
            f'<TR><TD BGCOLOR="#eeeeee">{title}</TD></TR>{"".join(rows)}</TABLE>>')


def draw_blocks(manager, seqs) -> graphviz.Digraph:
    """Logical blocks of each sequence (left) pointing at the physical blocks (right).

    Physical blocks are coloured by state: free (white), freed but still cached (green),
    in use by one sequence (blue), shared by several (orange).
    """
    g = graphviz.Digraph("blocks", graph_attr={"rankdir": "LR", "nodesep": "0.3", "ranksep": "1.2"},
                         node_attr={"shape": "plaintext", "fontname": "Helvetica", "fontsize": "11"})
    for k, seq in enumerate(seqs):
        rows = [f'<TR><TD PORT="l{i}" ALIGN="LEFT">{i}: {_tokens(seq.block(i))}</TD></TR>'
                for i in range(len(seq.block_table))]
        title = f"<B>seq {seq.seq_id}</B> ({seq.num_cached_tokens}/{seq.num_tokens} cached)"
        g.node(f"seq{seq.seq_id}", _html_table(title, rows))
        color = _SEQ_EDGE_COLORS[k % len(_SEQ_EDGE_COLORS)]
        for i, block_id in enumerate(seq.block_table):
            g.edge(f"seq{seq.seq_id}:l{i}:e", f"pool:p{block_id}:w", color=color)
    rows = []
    for b in manager.blocks:
        tokens = f"  [{_tokens(b.token_ids)}]" if b.token_ids else ""
        rows.append(f'<TR><TD PORT="p{b.block_id}" BGCOLOR="{_BLOCK_COLORS[_block_state(manager, b)]}" ALIGN="LEFT">'
                    f"block {b.block_id}  ref {b.ref_count}  {short_hash(b.hash)}{tokens}</TD></TR>")
    legend = "".join(f'<TD BGCOLOR="{c}">{s}</TD>' for s, c in _BLOCK_COLORS.items())
    rows.append(f'<TR><TD BORDER="0"><TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2"><TR>{legend}</TR>'
                f'</TABLE></TD></TR>')
    g.node("pool", _html_table("<B>physical blocks</B>", rows))
    return g


# --- radix tree (chapter 3) ----------------------------------------------------------------


# Fill colours of a tree node: its state, or what the step just recorded did to it.
_RADIX_COLORS = {"evictable": "white", "locked": "#cfe2f3", "new": "#d9f0d3", "split": "#fff2cc",
                 "evicted": "#eeeeee"}


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


def _elide(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - limit // 3 - 1] + "…" + text[-(limit // 3):]


def _edge_tokens(key, tokenizer=None, limit: int = 28) -> str:
    """The tokens of an edge: decoded text in quotes with a tokenizer, else the ids in brackets."""
    if tokenizer is not None:
        return repr(_elide(tokenizer.decode(list(key)), limit))
    return f"[{_elide(' '.join(map(str, key)), limit)}]"


def _slot_ranges(slots: list[int], limit: int = 3) -> str:
    """Slot ids as runs, e.g. '0-3,7,9-10' (the first `limit` runs, then '…')."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append(f"{slots[start]}" if i - 1 == start else f"{slots[start]}-{slots[i - 1]}")
            start = i
    return ",".join(runs[:limit]) + (",…" if len(runs) > limit else "")


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
    marks, lines = marks or {}, [header, f"root  lock_ref={views[0].lock_ref}"]
    children = _radix_children(views, list(ghosts))

    def walk(node_id, indent):
        kids = children.get(node_id, [])
        for k, v in enumerate(kids):
            last = k == len(kids) - 1
            state = _radix_state(v, marks)
            lines.append(f"{indent}{'└─' if last else '├─'} #{v.id} {_edge_tokens(v.key, tokenizer, width)}  "
                         f"{len(v.key)} tok, slots {_slot_ranges(v.slots)}, lock_ref={v.lock_ref}, "
                         f"t={v.last_access}" + ("" if state == "evictable" else f"  <{state}>"))
            walk(v.id, indent + ("   " if last else "│  "))

    walk(views[0].id, "")
    return "\n".join(lines)


def radix_text(cache, tokenizer=None, width: int = 28) -> str:
    """The tree as indented text, one line per node: id, tokens (decoded when a tokenizer is
    given, elided past `width` characters), slot ranges, lock_ref, last access time, and <locked>.
    The same state gives the same text."""
    return _radix_lines(*_radix_view(cache), tokenizer, width=width)


def _gv(text: str) -> str:
    """Backslashes in decoded text would read as graphviz escapes: double them."""
    return text.replace("\\", "\\\\")


def _radix_graph(title: list[str], views, tokenizer=None, marks=None, ghosts=(), path=(),
                 width: int = 20) -> graphviz.Digraph:
    marks = marks or {}
    g = graphviz.Digraph("radix", graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": "0.45",
                                              "label": "\\n".join(map(_gv, title)), "labelloc": "t",
                                              "fontname": "Helvetica"},
                         node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                    "fontsize": "10"},
                         edge_attr={"fontname": "Helvetica", "fontsize": "10"})
    root = views[0]
    g.node(f"n{root.id}", f"root\\nlock_ref={root.lock_ref}", fillcolor=_RADIX_COLORS[_radix_state(root, {})])
    for v in views[1:] + list(ghosts):
        state = _radix_state(v, marks)
        g.node(f"n{v.id}", f"#{v.id}  {len(v.key)} tok\\nslots {_slot_ranges(v.slots)}\\n"
                           f"lock_ref={v.lock_ref}  t={v.last_access}",
               fillcolor=_RADIX_COLORS[state], style="rounded,filled" + (",dashed" if state == "evicted" else ""))
    for parent, kids in sorted(_radix_children(views, list(ghosts)).items()):
        for v in kids:
            bold = v.id in path
            g.edge(f"n{parent}", f"n{v.id}", label=" " + _gv(_edge_tokens(v.key, tokenizer, width)),
                   color="#d62728" if bold else "black", penwidth="2.5" if bold else "1",
                   style="dashed" if marks.get(v.id) == "evicted" else "solid")
    cells = "".join(f'<TD BGCOLOR="{c}">{s}</TD>' for s, c in _RADIX_COLORS.items())
    g.node("legend", f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2"><TR>{cells}</TR></TABLE>>',
           shape="plaintext", style="", fontsize="9")
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
    """Runs insert / match / lock / unlock / evict on a RadixCache and records each step.

    `text(i)` and `draw(i)` show step i (step 0 is the tree when recording began), colouring the
    nodes that step split, created or evicted; `radix_widget(trace)` steps through them.
    """

    def __init__(self, cache, tokenizer=None):
        self.cache, self.tokenizer = cache, tokenizer
        self.steps = [RadixStep("step 0: start", *_radix_view(cache), {}, [], frozenset())]

    def __len__(self) -> int:
        return len(self.steps)

    def _tokens(self, key) -> str:
        return _edge_tokens(key.tolist() if hasattr(key, "tolist") else list(key), self.tokenizer, 40)

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
                     f"{_slot_ranges(result.indices.tolist()) or 'none'}, ends at #{result.last_node.id}",
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
        # Listen to the eviction callback to tell the order the nodes went in.
        node_of = {id(n.value): n.id for n in self.cache.nodes()}  # evict hands over node.value itself
        order, callback = [], self.cache.evict_callback

        def listen(value):
            order.append(node_of.get(id(value), "?"))
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


# --- kv pool and paged attention (chapters 4-5) ------------------------------------------


def _slot_owners(pool, owners: dict) -> list[int]:
    """Per slot: -1 free, -2 allocated but not named in `owners`, else the owner's position."""
    flags = pool.is_free(torch.arange(pool.num_slots)).tolist()
    marks = [-1 if free else -2 for free in flags]
    for k, slots in enumerate(owners.values()):
        for s in slots.tolist():
            marks[s] = k
    return marks


def pool_text(pool, owners: dict, width: int = 32) -> str:
    """One character per slot: the first letter of its owner's name (A, B, ... in `owners` order
    when first letters clash), '.' free, '#' held by nobody named. Pages are separated by a space;
    `width` slots per line."""
    letters = [str(name)[:1] for name in owners]
    if len(set(letters)) < len(letters) or set(letters) & {"", ".", "#", " "}:
        letters = list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    if len(owners) > len(letters):
        raise ValueError(f"pool_text names at most {len(letters)} owners, got {len(owners)}.")
    chars = [{-1: ".", -2: "#"}.get(m) or letters[m] for m in _slot_owners(pool, owners)]
    lines = [f"{pool.num_slots} slots, page_size {pool.page_size}, {pool.num_free} free"]
    for start in range(0, pool.num_slots, width):
        row = chars[start:start + width]
        pages = ["".join(row[i:i + pool.page_size]) for i in range(0, len(row), pool.page_size)]
        lines.append(f"{start:>5}  " + (" ".join(pages) if pool.page_size > 1 else "".join(row)))
    lines += [f"  {letters[k]} = {name}" for k, name in enumerate(owners)]
    return "\n".join(lines)


def draw_pool(pool, owners: dict, max_layers: int = 3):
    """The pool as a grid (matplotlib figure): a row for K and a row for V of each layer, a column
    per slot, coloured by owner. A token's slot is one column: the same index in every layer."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    marks = _slot_owners(pool, owners)
    layers = min(pool.num_layers, max_layers)
    row = [{-1: 0, -2: 1}.get(m, m + 2) for m in marks]  # 0 free, 1 unnamed, 2.. owners
    grid = [row] * (2 * layers)
    colours = ["#f4f4f4", "#9e9e9e"] + [plt.cm.tab10(k % 10) for k in range(len(owners))]
    fig, ax = plt.subplots(figsize=(max(6, pool.num_slots * 0.22), 0.45 * len(grid) + 1.2))
    ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1, aspect="auto")
    ax.set_yticks(range(len(grid)), [f"layer {r // 2} {'KV'[r % 2]}" for r in range(len(grid))])
    ax.set_xticks(range(0, pool.num_slots, pool.page_size))
    ax.set_xlabel("slot" + (f" (pages of {pool.page_size})" if pool.page_size > 1 else ""))
    for x in range(pool.page_size, pool.num_slots, pool.page_size):
        ax.axvline(x - 0.5, color="black", linewidth=1.2)
    for y in range(1, len(grid)):
        ax.axhline(y - 0.5, color="white", linewidth=2 if y % 2 == 0 else 0.5)
    labels = [*owners, "free"] + (["held by others"] if 1 in row else [])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours[2:]] + [
        plt.Rectangle((0, 0), 1, 1, facecolor=colours[0], edgecolor="black"),
        plt.Rectangle((0, 0), 1, 1, color=colours[1])][:len(labels) - len(owners)]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    shown = f"first {layers} of {pool.num_layers} layers" if layers < pool.num_layers else f"{layers} layers"
    ax.set_title(f"KV pool: {pool.num_slots} slots x {shown}, {pool.num_kv_heads} KV heads x "
                 f"{pool.head_dim} dims per cell")
    fig.tight_layout()
    return fig


def draw_slot_reads(metadata, names: list[str], num_slots: int | None = None):
    """Which pool slots each sequence of one packed step reads (light) and writes (dark), from its
    `AttentionMetadata` (matplotlib figure, one row per sequence, one column per slot)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    if len(names) != len(metadata.kv_lens):
        raise ValueError(f"Give one name per sequence: {len(metadata.kv_lens)} sequences, {len(names)} names.")
    width = num_slots or int(metadata.kv_indices.max()) + 1
    grid = torch.zeros(len(names), width, dtype=torch.int64)
    written = torch.zeros(len(names), width, dtype=torch.bool)
    new_tokens = torch.diff(metadata.last_token, prepend=torch.tensor([-1], device=metadata.last_token.device))
    start = 0
    for b, (n, q) in enumerate(zip(metadata.kv_lens.tolist(), new_tokens.tolist())):
        grid[b, metadata.kv_indices[b, :n].cpu()] = 1
        written[b, metadata.slot_mapping[start:start + q].cpu()] = True
        start += q
    grid[written] = 2
    fig, ax = plt.subplots(figsize=(min(12, max(6, width * 0.22)), 0.5 * len(names) + 1.3))
    ax.imshow(grid, cmap=ListedColormap(["#f4f4f4", "#9ecae1", "#08519c"]), vmin=0, vmax=2, aspect="auto")
    ax.set_yticks(range(len(names)), names)
    ax.set_xticks(range(0, width, max(1, width // 16)))
    ax.set_xlabel("pool slot")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#9ecae1", "#08519c")]
    ax.legend(handles, ["read (cached context)", "written and read (new tokens)"], loc="upper left",
              bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title("one packed step: the slots each sequence's attention touches")
    fig.tight_layout()
    return fig
