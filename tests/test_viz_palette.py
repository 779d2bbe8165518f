"""One picture language: every viz module takes its colours from kvlearn.viz.palette, a state has
one colour in every picture, and the matplotlib figures have no overlapping tick labels and no
legend over their data."""

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import kvlearn.viz  # noqa: E402
from kvlearn import BlockManager, KVPool, RadixCache, Sequence  # noqa: E402
from kvlearn.attention import AttentionMetadata  # noqa: E402
from kvlearn.bench.decode import plot_throughput  # noqa: E402
from kvlearn.tiers import TieredRadixCache  # noqa: E402
from kvlearn.tiers.host import host_pool_for  # noqa: E402
from kvlearn.viz import draw_blocks, draw_pool, draw_radix, draw_slot_reads  # noqa: E402
from kvlearn.viz.palette import ALIASES, STATES, state_color  # noqa: E402
from kvlearn.viz.quant import draw_kv_channels, plot_quality_vs_bytes  # noqa: E402
from kvlearn.viz.teaching import (  # noqa: E402
    draw_free_queue,
    draw_kv_reuse,
    draw_packed_mask,
    draw_timeline,
    plot_reuse_vs_block_size,
    plot_workloads,
)
from kvlearn.viz.tiers import draw_tiers  # noqa: E402

VIZ = Path(kvlearn.viz.__file__).parent
HEX = re.compile(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b")
COLOUR_WORDS = re.compile(r"\b(tab10|tab20|cm\.\w+|color=f?\"C\d)")


# --- one palette -----------------------------------------------------------------------------------

def test_no_viz_module_names_a_colour_of_its_own():
    own = {path.name: HEX.findall(path.read_text()) + COLOUR_WORDS.findall(path.read_text())
           for path in sorted(VIZ.glob("*.py")) if path.name != "palette.py"}
    assert {name: found for name, found in own.items() if found} == {}


def test_every_module_that_draws_in_colour_imports_the_palette():
    importing = {path.name for path in VIZ.glob("*.py") if "from kvlearn.viz.palette import" in path.read_text()}
    assert importing >= {"blocks.py", "radix.py", "pool.py", "tiers.py", "teaching.py"}


def test_states_have_distinct_colours_and_aliases_share_theirs():
    assert len(set(STATES.values())) == len(STATES)
    assert state_color("evictable") == STATES["cached"] and state_color("in use") == STATES["locked"]
    assert state_color("device+host") == f"{STATES['device']}:{STATES['host']}"
    assert set(ALIASES.values()) <= set(STATES)


def legend_of(source: str) -> dict[str, str]:
    """{state: colour} of a graphviz picture's legend cells."""
    return {name: colour for colour, name in re.findall(r'<TD BGCOLOR="([^"]+)">([^<]+)</TD>', source)
            if not name.startswith(("block ", "seq "))}


def pictures():
    radix = RadixCache()
    radix.insert([1, 2, 3], torch.arange(3))
    radix.lock(radix.match_prefix([1, 2]).last_node)
    device = KVPool(1, 1, 1, 8)
    tiers = TieredRadixCache(device, host_pool_for(device, 16))
    for key in ([1, 2, 3, 4], [1, 2, 5, 6]):
        slots = device.alloc(len(key))
        device.free(slots[:tiers.insert(key, slots)])
    tiers.evict(2)
    blocks = BlockManager(6, block_size=2)
    done, a, b = Sequence([7, 7, 7], block_size=2), Sequence([1, 2, 3], block_size=2), Sequence([1, 2, 4], block_size=2)
    for seq in (done, a, b):
        blocks.allocate(seq)
    blocks.deallocate(done)                        # its full block stays cached
    return {"radix": draw_radix(radix).source, "tiers": draw_tiers(tiers).source,
            "blocks": draw_blocks(blocks, [a, b]).source}


def test_the_same_state_has_the_same_colour_in_radix_tiers_and_blocks_pictures():
    seen: dict[str, set] = {}
    for picture, source in pictures().items():
        for name, colour in legend_of(source).items():
            assert colour == state_color(name), (picture, name)
            seen.setdefault(ALIASES.get(name, name), set()).add(colour)
    assert {"cached", "locked", "new", "split", "device", "host", "free"} <= set(seen)
    assert all(len(colours) == 1 for colours in seen.values())
    by_colour = {}
    for name, (colour,) in seen.items():
        assert by_colour.setdefault(colour, name) == name, f"{colour} means {by_colour[colour]} and {name}"


def test_nodes_are_filled_with_their_states_colour():
    source = pictures()
    assert re.search(rf'n\d+ \[label="#\d+  1 tok[^\]]*fillcolor="{STATES["cached"]}"', source["radix"])
    assert re.search(rf'n\d+ \[label="#\d+  2 tok[^\]]*fillcolor="{STATES["locked"]}"', source["radix"])
    assert f'fillcolor="{STATES["host"]}"' in source["tiers"] and f'fillcolor="{STATES["device"]}"' in source["tiers"]


# --- matplotlib figures: readable ------------------------------------------------------------------

def metadata():
    return AttentionMetadata.build([4, 3, 1],
                                   [torch.arange(10, 14), torch.arange(20, 27), torch.tensor([3, 7, 5, 20, 8])])


def timeline_reports():
    def rep(step, **kw):
        return SimpleNamespace(step=step, **{"prefills": [], "decodes": [], "deferred": [], "preempted": [],
                                             "finished": [], **kw})

    return [rep(1, prefills=[(0, 0, 5), (1, 0, 5)]), rep(2, decodes=[0, 1], deferred=[2]),
            rep(3, decodes=[0], preempted=[1], finished=[0]), rep(4, prefills=[(2, 3, 2)])]


WORKLOADS = ["shared_system", "short_system", "few_shot", "multi_turn", "branching", "no_sharing"]
MODES = ("radix", "blocks", "none")
FIGURES = {
    "kv_reuse": lambda: draw_kv_reuse(num_prompt=6, num_new=8),
    "packed_mask": lambda: draw_packed_mask(metadata(), ["prefill", "prefill after a hit", "decode"]),
    "free_queue": lambda: draw_free_queue([("start", [0, 1, 2, 3], []), ("X finishes", [2, 3], [0, 1]),
                                           ("Z arrives", [], [1])]),
    "timeline": lambda: draw_timeline(timeline_reports(), 3),
    "reuse_vs_block_size": lambda: plot_reuse_vs_block_size(
        [1, 2, 4, 8, 16, 32], {b: {"chat": 100 - 2 * b, "few_shot": 80 - b} for b in [1, 2, 4, 8, 16, 32]},
        {"chat": 100, "few_shot": 80}, {"chat": 120, "few_shot": 100}),
    "workloads": lambda: plot_workloads(WORKLOADS,
                                        {m: [1.0 + k * 0.1 + i for i in range(6)] for k, m in enumerate(MODES)},
                                        {m: [500 + 100 * k + 50 * i for i in range(6)] for k, m in enumerate(MODES)}),
    "pool": lambda: draw_pool(pool_with_owners(),
                              {"B, 2 slots": torch.tensor([0, 1]), "C, 4 slots": torch.arange(4, 8)}),
    "slot_reads": lambda: draw_slot_reads(metadata(), ["prefill", "hit", "decode"]),
    "decode_throughput": lambda: plot_throughput({1: 20.0, 2: 38.0, 4: 70.0, 8: 120.0, 16: 190.0}),
    "kv_channels": lambda: draw_kv_channels(torch.randn(64, 64) * torch.linspace(1, 8, 64), torch.randn(64, 64),
                                            "layer 3, KV head 0"),
    "quality_vs_bytes": lambda: plot_quality_vs_bytes(QUALITY),
}
QUALITY = [dict(label=label, bytes_per_token=size, ppl_change_pct=ppl, mean_kl=kl, simulated=sim)
           for label, size, ppl, kl, sim in (
    ("auto", 46080, 0.0, 0.0, False), ("bfloat16", 23040, 0.05, 2e-5, False), ("fp8_e4m3", 12240, 0.3, 3e-3, False),
    ("int8", 12240, 0.02, 6e-4, False), ("int4 per token, symmetric", 6480, 32.0, 0.26, True),
    ("int4 KIVI", 7920, -0.2, 5e-3, True))]


def pool_with_owners():
    pool = KVPool(2, 1, 4, 16)
    pool.alloc(8)
    return pool


def overlapping_ticks(fig) -> list[str]:
    """Pairs of visible, non-empty tick labels of one axis whose drawn boxes intersect."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    clashes = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            boxes = [t.get_window_extent(renderer) for t in labels]
            for (a, box_a), (b, box_b) in itertools.combinations(zip(labels, boxes, strict=True), 2):
                if box_a.overlaps(box_b):
                    clashes.append(f"{a.get_text()!r} / {b.get_text()!r}")
    return clashes


def legend_over_data(fig) -> list[str]:
    """Data a legend drawn inside its axes covers: line points and bar tops."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    covered = []
    for ax in fig.axes:
        box = ax.get_legend().get_window_extent(renderer) if ax.get_legend() else None
        if box is None or not box.overlaps(ax.get_window_extent(renderer)):
            continue
        for line in ax.lines:
            points = ax.transData.transform(line.get_xydata())
            covered += [line.get_label() for x, y in points if box.contains(x, y)]
        for patch in ax.patches:
            top = patch.get_window_extent(renderer)
            if box.contains(top.x0 + top.width / 2, top.y1):
                covered.append("a bar")
    return covered


@pytest.mark.parametrize("name", FIGURES)
def test_figure_has_no_overlapping_tick_labels_and_no_legend_over_data(name):
    fig = FIGURES[name]()
    try:
        assert overlapping_ticks(fig) == []
        assert legend_over_data(fig) == []
    finally:
        plt.close(fig)


def test_the_checks_see_a_crowded_figure():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(6), range(6), label="rising line")
    ax.set_xticks(range(6), [f"a_long_workload_{i}" for i in range(6)])
    ax.legend(loc="upper left", bbox_to_anchor=(0.3, 0.9))
    try:
        assert overlapping_ticks(fig) and legend_over_data(fig) == ["rising line"]
    finally:
        plt.close(fig)


def test_workload_labels_break_at_underscores_and_throughput_axes_are_linear():
    fig = FIGURES["workloads"]()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][:2] == ["shared\nsystem", "short\nsystem"]
    plt.close(fig)
    fig = FIGURES["decode_throughput"]()
    assert (fig.axes[0].get_xscale(), fig.axes[0].get_yscale()) == ("linear", "linear")
    plt.close(fig)
