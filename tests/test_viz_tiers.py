"""Tiered radix tree pictures (kvlearn.viz.tiers, chapter 8): text and graphviz agree on the tiers."""

from kvlearn.pool import KVPool
from kvlearn.tiers import TieredRadixCache
from kvlearn.tiers.host import host_pool_for
from kvlearn.viz.tiers import TIER_COLORS, draw_tiers, tiers_text


def two_branches():
    device = KVPool(1, 1, 1, 8)
    tree = TieredRadixCache(device, host_pool_for(device, 16))
    for key in ([1, 2, 3, 4], [1, 2, 5, 6]):
        slots = device.alloc(len(key))
        device.free(slots[:tree.insert(key, slots)])
    return tree


def test_text_names_each_nodes_tiers():
    tree = two_branches()
    assert tiers_text(tree).splitlines()[1:] == [
        "└─ #2 [1 2]  2 tok  [device]  lock_ref=0  t=2",
        "   ├─ #1 [3 4]  2 tok  [device]  lock_ref=0  t=1",
        "   └─ #3 [5 6]  2 tok  [device]  lock_ref=0  t=2",
    ]
    tree.evict(2)  # the least recently used leaf goes down to the host
    assert "#1 [3 4]  2 tok  [host]" in tiers_text(tree)


def test_picture_colours_nodes_by_tier():
    tree = two_branches()
    tree.evict(2)
    source = draw_tiers(tree, title="t").source
    assert f'n1 [label="#1  2 tok\\nhost\\nt=1" fillcolor="{TIER_COLORS["host"]}"' in source
    assert f'n3 [label="#3  2 tok\\ndevice\\nt=2" fillcolor="{TIER_COLORS["device"]}"' in source
    assert "double border: also on disk" in source and 'label=t ' in source
