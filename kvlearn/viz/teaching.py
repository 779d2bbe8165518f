"""Small teaching pictures for chapters 0, 2, 3, 5 and 6 (matplotlib figures, saved with
`kvlearn.viz.plots.save_figure`): what a cache saves, a packed step's mask, the free-block queue
over time, a requests x steps timeline of the engine, reuse against block size, and what a cache is
worth on each workload. Colours come from `kvlearn.viz.palette`."""

from __future__ import annotations

import torch

from kvlearn.viz.palette import INK, MASK, REQUESTS, STATES


def _grid(ax, grid, colors, labels, title):
    """Draw an int grid with one colour per value and a legend naming the values."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, aspect="auto")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec=INK["edge"]) for c in colors]
    return handles, labels


def draw_kv_reuse(num_prompt: int, num_new: int):
    """Which keys and values each forward pass computes, without and with a KV cache: one row per
    pass (the prefill, then one per new token), one column per token position."""
    import matplotlib.pyplot as plt

    steps, width = num_new, num_prompt + num_new - 1  # the last new token is never fed back
    panels = []
    for cached in (False, True):
        grid = torch.zeros(steps, width, dtype=torch.int64)
        for s in range(steps):
            seen = num_prompt + s  # positions 0 .. seen-1 exist at pass s
            first_new = (num_prompt + s - 1 if s else 0) if cached else 0
            grid[s, :seen] = 1             # read from the cache
            grid[s, first_new:seen] = 2    # computed in this pass
        panels.append(grid)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.28 * steps + 1.6), sharey=True)
    colors = [STATES["free"], STATES["cached"], STATES["new"]]
    labels = ["not yet", "read from the cache", "K and V computed"]
    for ax, grid, title in zip(axes, panels, ("without a cache", "with a KV cache"), strict=True):
        handles, names = _grid(ax, grid, colors, labels, title)
        ax.set_xlabel("token position")
    axes[0].set_ylabel("forward pass")
    axes[1].legend(handles[1:], names[1:], loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def draw_packed_mask(metadata, names: list[str]):
    """The mask of one packed step as an image: one panel per sequence, rows its new tokens,
    columns its context; allowed (blue), causally hidden (white), padding (grey)."""
    import matplotlib.pyplot as plt

    query_lens = torch.diff(metadata.last_token.cpu(), prepend=torch.tensor([-1])).tolist()
    kv_lens = metadata.kv_lens.tolist()
    if len(names) != len(kv_lens):
        raise ValueError(f"Give one name per sequence: {len(kv_lens)} sequences, {len(names)} names.")
    mask = metadata.mask.reshape(len(kv_lens), -1, metadata.mask.shape[-1]).cpu()
    rows, cols = max(query_lens), mask.shape[-1]
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 1.5, 0.3 * rows + 1.6), squeeze=False)
    colors, labels = list(MASK.values()), list(MASK)
    for ax, b, name in zip(axes[0], range(len(names)), names, strict=True):
        grid = torch.zeros(rows, cols, dtype=torch.int64)
        q, n = query_lens[b], kv_lens[b]
        grid[:q, :n] = 1
        grid[:q][mask[b, :q].bool()] = 2
        handles, labels = _grid(ax, grid, colors, labels, f"{name}: {q} new, {n} context")
        ax.set_xlabel("context position")
        ax.set_ylabel("new token")
    axes[0, -1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def draw_free_queue(snapshots: list[tuple[str, list[int], list[int]]]):
    """The order in which a block manager hands out blocks, after each event: one row per
    (label, free pages, cached blocks least recently freed first); leftmost is handed out first."""
    import matplotlib.pyplot as plt

    width = max(len(free) + len(cached) for _, free, cached in snapshots)
    fig, ax = plt.subplots(figsize=(0.55 * width + 3, 0.55 * len(snapshots) + 1.2))
    for row, (_, free, cached) in enumerate(snapshots):
        for col, (block, color) in enumerate([(b, STATES["free"]) for b in free] +
                                             [(b, STATES["cached"]) for b in cached]):
            ax.add_patch(plt.Rectangle((col, row), 0.95, 0.9, fc=color, ec=INK["edge"]))
            ax.text(col + 0.47, row + 0.45, str(block), ha="center", va="center")
    ax.set_xlim(0, width)
    ax.set_ylim(len(snapshots), 0)
    ax.set_yticks([r + 0.45 for r in range(len(snapshots))], [label for label, _, _ in snapshots])
    ax.set_xticks([])
    ax.set_xlabel("handed out first  →  last")
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=STATES[s], ec=INK["edge"]) for s in ("free", "cached")]
    ax.legend(handles, ["free page", "cached (evicted when taken)"], loc="upper left",
              bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


TIMELINE_STATES = ("waiting", "prefill", "decode", "deferred", "preempted", "done")


def timeline(reports, num_requests: int) -> torch.Tensor:
    """[requests, steps] state codes (indices into TIMELINE_STATES) from the engine's step reports."""
    grid = torch.zeros(num_requests, len(reports), dtype=torch.int64)
    done = set()
    for s, rep in enumerate(reports):
        grid[sorted(done), s] = TIMELINE_STATES.index("done")
        for state, rids in (("prefill", [r for r, _, _ in rep.prefills]), ("decode", rep.decodes),
                            ("deferred", rep.deferred), ("preempted", rep.preempted)):
            grid[rids, s] = TIMELINE_STATES.index(state)
        done.update(rep.finished)
    return grid


def draw_timeline(reports, num_requests: int):
    """A requests x steps picture of what the engine did with each request at each step."""
    import matplotlib.pyplot as plt

    grid = timeline(reports, num_requests)
    colors = [REQUESTS[state] for state in TIMELINE_STATES]
    fig, ax = plt.subplots(figsize=(0.4 * len(reports) + 3, 0.45 * num_requests + 1.3))
    handles, labels = _grid(ax, grid, colors, list(TIMELINE_STATES), "what each request did at each step")
    ax.set_xticks(range(len(reports)), [str(r.step) for r in reports])
    ax.set_yticks(range(num_requests), [f"r{i}" for i in range(num_requests)])
    ax.set_xlabel("step")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def plot_reuse_vs_block_size(block_sizes, blocks: dict, radix: dict, total: dict):
    """Chapter 3: prompt tokens reused per workload, as a fraction of its prompt tokens, for block
    hashes of each size (`blocks[size][workload]`) against the page-1 radix tree (`radix[workload]`)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for k, name in enumerate(total):
        ax.plot(block_sizes, [blocks[b][name] / total[name] for b in block_sizes], "o-", color=f"C{k}",
                label=f"{name}: block hashes")
        ax.axhline(radix[name] / total[name], color=f"C{k}", linestyle="--", label=f"{name}: radix tree")
    ax.set_xscale("log", base=2)
    ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("prompt tokens reused")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.legend(fontsize=7, ncol=1, loc="lower left")
    ax.set_title("Prefix reuse: radix tree (page 1) vs full-block hashes")
    fig.tight_layout()
    return fig


def plot_workloads(names: list[str], computed_over_floor: dict[str, list[float]],
                   peak_slots: dict[str, list[int]]):
    """Chapter 6: per workload (`names`) and cache mode (the dicts' keys), prompt tokens computed
    over the unique-token floor (left, log scale, bars labelled) and peak KV slots (right). A
    name's underscores break its tick label into lines, so neighbouring labels never overlap."""
    import matplotlib.pyplot as plt
    import numpy as np

    x, width = np.arange(len(names)), 0.8 / len(computed_over_floor)
    ticks = [name.replace("_", "\n") for name in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    for k, mode in enumerate(computed_over_floor):
        offset = (k - (len(computed_over_floor) - 1) / 2) * width
        bars = ax1.bar(x + offset, computed_over_floor[mode], width, label=mode)
        ax1.bar_label(bars, fmt="%.1f", fontsize=7)
        ax2.bar(x + offset, peak_slots[mode], width, label=mode)
    ax1.set_yscale("log")
    ax1.set_ylabel("prompt tokens computed / floor (log)")
    ax2.set_ylabel("peak KV slots of running requests")
    for ax in (ax1, ax2):
        ax.set_xticks(x, ticks, fontsize=9)
        ax.legend()
    fig.tight_layout()
    return fig


def draw_strip(graphs, captions: list[str] | None = None, columns: int = 2):
    """Graphviz pictures side by side (with captions, if the pictures carry none), as one matplotlib
    figure: a PNG reads well where a widget or an SVG output does not (GitHub, HTML exports,
    untrusted notebooks)."""
    import io

    import matplotlib.pyplot as plt

    graphs = list(graphs)
    captions = [""] * len(graphs) if captions is None else list(captions)
    if len(graphs) != len(captions) or not graphs:
        raise ValueError(f"Give at least one picture, and one caption per picture: {len(graphs)} pictures, "
                         f"{len(captions)} captions.")
    images = [plt.imread(io.BytesIO(g.pipe(format="png")), format="png") for g in graphs]
    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, caption in zip(axes.flat, images, captions, strict=False):   # a grid may have spare cells
        ax.imshow(image)
        ax.set_title(caption, fontsize=9)
    fig.tight_layout()
    return fig
