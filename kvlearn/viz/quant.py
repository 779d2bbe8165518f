"""Chapter 10's pictures: K and V magnitudes by channel (where the outliers are), and what each KV
format costs in quality against what it saves in bytes per token."""

from __future__ import annotations

import torch

from kvlearn.viz.palette import FORMATS, HEAT, INK


def draw_kv_channels(k: torch.Tensor, v: torch.Tensor, title: str):
    """|K| and |V| of one layer's KV head, `k` and `v` [tokens, head_dim]: a heatmap each (tokens
    down, channels across), and under it each channel's largest |value|."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 5.2), height_ratios=[3, 1.3], sharex="col")
    for col, (name, x) in enumerate((("K", k), ("V", v))):
        x = x.abs().float()
        image = axes[0, col].imshow(x, aspect="auto", cmap=HEAT, interpolation="nearest")
        fig.colorbar(image, ax=axes[0, col], label=f"|{name}|")
        axes[0, col].set_title(f"|{name}|, {title}")
        axes[0, col].set_ylabel("token")
        axes[1, col].bar(range(x.shape[1]), x.amax(0), width=0.9, color=INK["edge"])
        axes[1, col].set_ylabel(f"max |{name}|")
        axes[1, col].set_xlabel("channel")
    fig.tight_layout()
    return fig


def plot_quality_vs_bytes(rows: list[dict]):
    """Per format (`rows`: dicts with `label`, `bytes_per_token`, `ppl_change_pct`, `mean_kl` and
    `simulated`), mean KL to the exact distribution (left, log scale) and the perplexity change
    (right, linear within ±0.1 % and logarithmic beyond) against bytes per token; stored formats and
    simulations in their own colours. A format with no KL (the reference itself) is drawn on the
    right only."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, label in ((left, "mean_kl", "mean KL to the exact distribution (log)"),
                           (right, "ppl_change_pct", "perplexity change (%)")):
        for kind, colour in FORMATS.items():
            chosen = [r for r in rows if r["simulated"] == (kind != "stored in the pool") and
                      (key != "mean_kl" or r[key] > 0)]
            ax.scatter([r["bytes_per_token"] for r in chosen], [r[key] for r in chosen], color=colour, label=kind,
                       zorder=3)
            for r in chosen:
                ax.annotate(r["label"], (r["bytes_per_token"], r[key]), textcoords="offset points", xytext=(5, 4),
                            fontsize=8)
        ax.set_xscale("log", base=2)
        ticks = [2 ** k for k in range(12, 17)]
        ax.set_xticks(ticks, [f"{t // 1024} KiB" for t in ticks])
        ax.set_xlim(ticks[0] * 0.9, ticks[-1])
        ax.set_xlabel("KV bytes per token (log)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.margins(y=0.12)   # room for the labels of the highest points
    left.set_yscale("log")
    right.set_yscale("symlog", linthresh=0.1)   # linear within ±0.1 %, logarithmic beyond
    right.set_ylabel("perplexity change (%, symmetric log)")
    right.axhline(0, color=INK["edge"], linewidth=0.8)
    right.legend(loc="upper right", frameon=False)
    fig.tight_layout()
    return fig
