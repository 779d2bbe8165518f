"""Pictures of the KV pool and of the slots one packed step touches (chapters 4-5): text, and
matplotlib figures (matplotlib is imported only by the functions that draw).

A token's slot is one column of the pool: the same index in every layer, for K and for V.
"""

from __future__ import annotations

import torch

from kvlearn.viz.palette import INK, STATES, owner_color


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
    per slot, coloured by owner (free: white, held by nobody named: grey). A token's slot is one
    column: the same index in every layer."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    marks = _slot_owners(pool, owners)
    layers = min(pool.num_layers, max_layers)
    row = [{-1: 0, -2: 1}.get(m, m + 2) for m in marks]  # 0 free, 1 unnamed, 2.. owners
    grid = [row] * (2 * layers)
    colours = [STATES["free"], INK["held by others"]] + [owner_color(k) for k in range(len(owners))]
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
    """Which pool slots each sequence of one packed step reads (cached: green) and writes (new:
    pink), from its `AttentionMetadata` (matplotlib figure, one row per sequence, one column per slot)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    if len(names) != len(metadata.kv_lens):
        raise ValueError(f"Give one name per sequence: {len(metadata.kv_lens)} sequences, {len(names)} names.")
    width = num_slots or int(metadata.kv_indices.max()) + 1
    grid = torch.zeros(len(names), width, dtype=torch.int64)
    written = torch.zeros(len(names), width, dtype=torch.bool)
    new_tokens = torch.diff(metadata.last_token, prepend=torch.tensor([-1], device=metadata.last_token.device))
    start = 0
    for b, (n, q) in enumerate(zip(metadata.kv_lens.tolist(), new_tokens.tolist(), strict=True)):
        grid[b, metadata.kv_indices[b, :n].cpu()] = 1
        written[b, metadata.slot_mapping[start:start + q].cpu()] = True
        start += q
    grid[written] = 2
    fig, ax = plt.subplots(figsize=(min(12, max(6, width * 0.22)), 0.5 * len(names) + 1.3))
    colours = [STATES["free"], STATES["cached"], STATES["new"]]
    ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=2, aspect="auto")
    ax.set_yticks(range(len(names)), names)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # as many slot labels as fit the width
    ax.set_xlabel("pool slot")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours[1:]]
    ax.legend(handles, ["read (cached context)", "written and read (new tokens)"], loc="upper left",
              bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title("one packed step: the slots each sequence's attention touches")
    fig.tight_layout()
    return fig
