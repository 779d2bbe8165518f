"""Pictures of block tables (chapters 1-2): each sequence's logical blocks pointing at the
physical blocks of a BlockManager, as text and as a graphviz picture.

A physical block is in one of four states, the same in picture and text: free, cached (free, but
`hash_to_block_id` still points at it), in use (ref_count 1), shared (ref_count > 1).
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from kvlearn.blocks import short_hash
from kvlearn.sequence import shorten
from kvlearn.viz.palette import INK, legend, owner_color
from kvlearn.viz.text import edge_tokens, elide, legend_table

if TYPE_CHECKING:
    import graphviz

# Fill colours of a physical block by state (the course's palette): the same four states in picture and text.
_BLOCK_COLORS = legend("free", "cached", "in use", "shared")


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
            return repr(elide(tokenizer.decode(list(ids)), width))
        return f"[{_tokens(ids, 16)}]"

    states = [_block_state(manager, b) for b in manager.blocks]
    lines = [f"{manager.num_blocks} blocks of {manager.block_size} tokens: "
             + ", ".join(f"{states.count(s)} {s}" for s in _BLOCK_COLORS)]
    for seq in seqs:
        lines.append(f"seq {seq.seq_id}: {seq.num_tokens} tokens, {seq.num_cached_tokens} cached, "
                     f"block_table {seq.block_table}")
        for i, block_id in enumerate(seq.block_table):
            lines.append(f"  logical {i:>2} -> block {block_id:>2}  {tokens(seq.block(i))}")
    listed = [(b, state) for b, state in zip(manager.blocks, states, strict=True)
              if state != "free" or b.hash is not None]
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
            f'<TR><TD BGCOLOR="{INK["header"]}">{title}</TD></TR>{"".join(rows)}</TABLE>>')


def draw_blocks(manager, seqs, tokenizer=None, width: int = 40) -> graphviz.Digraph:
    """Logical blocks of each sequence (left) pointing at the physical blocks (right).

    Physical blocks are coloured by state (kvlearn.viz.palette): free (white), freed but still
    cached (green), in use by one sequence (blue), shared by several (orange). With a tokenizer, a
    block's tokens show as the text they decode to (in quotes, at most `width` characters), else
    as ids.
    """
    import graphviz

    def tokens(ids) -> str:
        text = edge_tokens(ids, tokenizer, width) if tokenizer is not None else f"[{_tokens(ids)}]"
        return escape(text, quote=False)   # decoded text may hold <, > and & (chat templates do)

    g = graphviz.Digraph("blocks", graph_attr={"rankdir": "LR", "nodesep": "0.3", "ranksep": "1.2"},
                         node_attr={"shape": "plaintext", "fontname": "Helvetica", "fontsize": "11"})
    for k, seq in enumerate(seqs):
        rows = [f'<TR><TD PORT="l{i}" ALIGN="LEFT">{i}: {tokens(seq.block(i))}</TD></TR>'
                for i in range(len(seq.block_table))]
        title = f"<B>seq {seq.seq_id}</B> ({seq.num_cached_tokens}/{seq.num_tokens} cached)"
        g.node(f"seq{seq.seq_id}", _html_table(title, rows))
        color = owner_color(k)
        for i, block_id in enumerate(seq.block_table):
            g.edge(f"seq{seq.seq_id}:l{i}:e", f"pool:p{block_id}:w", color=color)
    rows = []
    for b in manager.blocks:
        held = f"  {tokens(b.token_ids)}" if b.token_ids else ""
        rows.append(f'<TR><TD PORT="p{b.block_id}" BGCOLOR="{_BLOCK_COLORS[_block_state(manager, b)]}" ALIGN="LEFT">'
                    f"block {b.block_id}  ref {b.ref_count}  {short_hash(b.hash)}{held}</TD></TR>")
    rows.append(f'<TR><TD BORDER="0">{legend_table(_BLOCK_COLORS)}</TD></TR>')
    g.node("pool", _html_table("<B>physical blocks</B>", rows))
    return g
