"""Chapter 7 on real traffic: prefix-cache hit rate against cache capacity (the Mooncake paper's
Figure 9), one curve per trace, beside the paper's numbers."""

from __future__ import annotations

from kvlearn.viz.palette import INK, owner_color


def plot_hit_rate_curves(curves: dict, paper: dict | None = None, local_cache_tokens: int | None = None):
    """`curves[name]`: replay results (`capacity_tokens`, `hit_rate`; capacity None = unbounded)
    of one trace. Each trace is a curve over the bounded capacities (log scale) with its unbounded
    hit rate as a dashed line, and `paper[name]` (Table 2's cache ratio) as a dotted one. With
    `local_cache_tokens`, a vertical line marks that capacity and each curve's point there is
    labelled with its share of the trace's unbounded hit rate."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    paper = paper or {}
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for k, (name, results) in enumerate(curves.items()):
        color = owner_color(k)
        bounded = sorted((r.capacity_tokens, r.hit_rate) for r in results if r.capacity_tokens is not None)
        best = max(r.hit_rate for r in results)
        ax.plot(*zip(*bounded), "o-", color=color, markersize=3, label=f"{name}: LRU replay")
        ax.axhline(best, color=color, linestyle="--", linewidth=1, label=f"{name}: unbounded, {best:.1%}")
        if name in paper:
            ax.axhline(paper[name], color=color, linestyle=":", linewidth=1.5,
                       label=f"{name}: paper (Table 2), {paper[name]:.0%}")
        at = dict(bounded).get(local_cache_tokens)
        if at is not None:
            ax.annotate(f"{at / best:.0%} of max", (local_cache_tokens, at), textcoords="offset points",
                        xytext=(6, -10), fontsize=8, color=color)
    if local_cache_tokens is not None:
        ax.axvline(local_cache_tokens, color=INK["edge"], linestyle="--", linewidth=1,
                   label=f"one node's cache ({local_cache_tokens / 1e6:g}M tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens, log)")
    ax.set_ylabel("prompt tokens cached")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Hit rate against cache capacity (Mooncake traces, Figure 9)")
    fig.tight_layout()
    return fig
