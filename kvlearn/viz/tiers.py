"""Pictures of a tiered radix tree (chapter 8): every node coloured by where its KV lives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlearn.viz.palette import STATES, legend
from kvlearn.viz.radix import tree_digraph
from kvlearn.viz.text import edge_tokens, graphviz_escape, legend_table, tree_lines

if TYPE_CHECKING:
    import graphviz

# Fill colour by the memory tiers holding a node's KV (the course's palette; on both: a gradient of
# the two); a node also on disk gets a double border in the disk colour.
TIER_COLORS = legend("device", "device+host", "host")


def _memory(tiers: tuple[str, ...]) -> str:
    return "+".join(t for t in tiers if t != "disk")


def tiers_text(cache, tokenizer=None, width: int = 28) -> str:
    """The tree as indented text: per node its id, tokens, tiers, lock_ref and last access time."""
    def label(node) -> str:
        return (f"#{node.id} {edge_tokens(node.key, tokenizer, width)}  {len(node.key)} tok  "
                f"[{' + '.join(cache.tiers(node))}]  lock_ref={node.lock_ref}  t={node.last_access}")

    lines = tree_lines(cache.root, lambda node: [node.children[k] for k in sorted(node.children)], label)
    return "\n".join([repr(cache), *lines])


def draw_tiers(cache, tokenizer=None, title: str = "", width: int = 20) -> graphviz.Digraph:
    """Graphviz picture of a TieredRadixCache: purple on the device, teal only on the host, both
    colours on both; a double brown border when its pages are also on disk; locked nodes drawn bold."""
    g = tree_digraph("tiers", graphviz_escape(title or repr(cache)), ranksep="0.4")
    g.node(f"n{cache.root.id}", "root", fillcolor=STATES["free"])
    for node in cache.nodes()[1:]:
        tiers = cache.tiers(node)
        g.node(f"n{node.id}", f"#{node.id}  {len(node.key)} tok\\n{' + '.join(tiers)}\\nt={node.last_access}",
               fillcolor=TIER_COLORS[_memory(tiers)], penwidth="2.5" if node.lock_ref else "1",
               **({"peripheries": "2", "color": STATES["disk"]} if "disk" in tiers else {"peripheries": "1"}))
        label = " " + graphviz_escape(edge_tokens(node.key, tokenizer, width))
        g.edge(f"n{node.parent.id}", f"n{node.id}", label=label)
    note = "double border: also on disk; bold: locked"
    g.node("legend", f"<{legend_table(TIER_COLORS, note)}>", shape="plaintext", style="")
    return g
