"""Chapter 7 on real traffic: prefix-cache hit rate against cache capacity (the Mooncake paper's
Figure 9), one curve per trace, beside the paper's numbers; and a fleet of local caches against one
shared pool (its Figure 10)."""

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
        ax.plot(*zip(*bounded, strict=True), "o-", color=color, markersize=3, label=f"{name}: LRU replay")
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


def plot_pooled_vs_local(runs: dict, paper_gain: dict | None = None, one_cache: dict | None = None):
    """The Mooncake paper's Figure 10 as kvlearn measures it. `runs[trace]`: `route --json` rows
    of one fleet (`policy`, `hit_rate`, `pool_tokens`): one bar per local-cache policy, then the
    pooled run's bar (`pool_tokens` > 0), labelled with its gain over the best and the worst local
    policy. `one_cache[trace]`: the hit rate of one LRU cache of the fleet's whole memory that sees
    every request (`replay`), a dashed line; `paper_gain[trace]`: the paper's pooled-over-local
    factor, in the panel's title."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    from kvlearn.viz.palette import state_color

    paper_gain, one_cache = paper_gain or {}, one_cache or {}
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.8), squeeze=False)
    for ax, (name, rows) in zip(axes[0], runs.items(), strict=True):
        local = [r for r in rows if not r["pool_tokens"]]
        pooled = [r for r in rows if r["pool_tokens"]]
        labels = [r["policy"] for r in local] + [f"{r['policy']}\n+ pool" for r in pooled]
        colors = [owner_color(k) for k in range(len(local))] + [state_color("host")] * len(pooled)
        heights = [r["hit_rate"] for r in local + pooled]
        ax.bar(range(len(heights)), heights, color=colors, edgecolor=INK["edge"])
        for x, h in enumerate(heights):
            ax.annotate(f"{h:.1%}", (x, h), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        if pooled and local:
            best, worst = max(r["hit_rate"] for r in local), min(r["hit_rate"] for r in local)
            ax.annotate(f"{pooled[0]['hit_rate'] / best:.2f}x the best local,\n"
                        f"{pooled[0]['hit_rate'] / worst:.2f}x the worst", (len(heights) - 1, heights[-1]),
                        textcoords="offset points", xytext=(-6, 14), ha="right", fontsize=7)
        if name in one_cache:
            ax.axhline(one_cache[name], color=INK["edge"], linestyle="--", linewidth=1,
                       label=f"one LRU cache of the fleet's memory: {one_cache[name]:.1%}")
            ax.legend(fontsize=7, loc="upper left")
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylim(0, max(heights + [one_cache.get(name, 0)]) * 1.45)
        ax.set_ylabel("prompt tokens cached")
        gain = f" (paper: pooled {paper_gain[name]:.2f}x local)" if name in paper_gain else ""
        ax.set_title(f"{name}{gain}", fontsize=9)
    fig.suptitle("Ten replicas: local caches under each policy, or one shared pool (Figure 10)", fontsize=10)
    fig.tight_layout()
    return fig
