"""Pictures of a tiered radix tree (chapter 8): every node coloured by where its KV lives."""

from __future__ import annotations

import graphviz

from kvlearn.viz import _edge_tokens, _gv

# Fill colour by the memory tiers holding a node's KV; a node also on disk gets a double border.
TIER_COLORS = {"device": "#cfe2f3", "device+host": "#d9ead3", "host": "#fff2cc"}


def _memory(tiers: tuple[str, ...]) -> str:
    return "+".join(t for t in tiers if t != "disk")


def tiers_text(cache, tokenizer=None, width: int = 28) -> str:
    """The tree as indented text: per node its id, tokens, tiers, lock_ref and last access time."""
    lines = [repr(cache)]

    def walk(node, indent):
        kids = [node.children[k] for k in sorted(node.children)]
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{indent}{'└─' if last else '├─'} #{child.id} {_edge_tokens(child.key, tokenizer, width)}  "
                         f"{len(child.key)} tok  [{' + '.join(cache.tiers(child))}]  lock_ref={child.lock_ref}  "
                         f"t={child.last_access}")
            walk(child, indent + ("   " if last else "│  "))

    walk(cache.root, "")
    return "\n".join(lines)


def draw_tiers(cache, tokenizer=None, title: str = "", width: int = 20) -> graphviz.Digraph:
    """Graphviz picture of a TieredRadixCache: blue on the device, yellow only on the host, green
    on both; a double border when its pages are also on disk; locked nodes drawn bold."""
    g = graphviz.Digraph("tiers", graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": "0.4",
                                              "label": _gv(title or repr(cache)), "labelloc": "t",
                                              "fontname": "Helvetica"},
                         node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                    "fontsize": "10"},
                         edge_attr={"fontname": "Helvetica", "fontsize": "10"})
    g.node(f"n{cache.root.id}", "root", fillcolor="white")
    for node in cache.nodes()[1:]:
        tiers = cache.tiers(node)
        g.node(f"n{node.id}", f"#{node.id}  {len(node.key)} tok\\n{' + '.join(tiers)}\\nt={node.last_access}",
               fillcolor=TIER_COLORS[_memory(tiers)], peripheries="2" if "disk" in tiers else "1",
               penwidth="2.5" if node.lock_ref else "1")
        g.edge(f"n{node.parent.id}", f"n{node.id}", label=" " + _gv(_edge_tokens(node.key, tokenizer, width)))
    cells = "".join(f'<TD BGCOLOR="{color}">{name}</TD>' for name, color in TIER_COLORS.items())
    g.node("legend", f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2"><TR>{cells}<TD BORDER="0">'
                     'double border: also on disk; bold: locked</TD></TR></TABLE>>', shape="plaintext", style="")
    return g
