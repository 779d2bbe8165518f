"""What a decode kernel read: which program (sequence, KV head, split) loaded which slots of the pool,
recorded from a real run in Triton's interpreter, and drawn over the block table (chapter 5).

Triton-Viz records a kernel's loads the same way: while one launch runs, `record_reads` wraps the
interpreter's masked load (`interpreter_builder.create_masked_load`, which every `tl.load` of an
interpreted kernel ends in) and notes, for the program running (its grid index), each address the
load did not mask that falls inside k_cache or v_cache, as a slot of the pool. Interpreter only:
on a GPU nothing is recorded (a ValueError says so). Triton is imported inside the functions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvlearn.viz.palette import INK, MASK, STATES


@dataclass
class KernelReads:
    """One launch's reads: `slots[(b, g, s)]`, the pool slots program (b, g, s) loaded K or V from
    (sorted), beside what it should read: the slots of positions `start .. end - 1` of its split
    (`expected`), from the table, `kv_lens`, `page_size` and `num_splits` of the launch."""

    slots: dict[tuple[int, int, int], list[int]]
    table: torch.Tensor
    kv_lens: list[int]
    page_size: int
    num_splits: int
    num_slots: int

    def expected(self, b: int, s: int) -> list[int]:
        """The slots of split s of sequence b's context, in position order."""
        n = self.kv_lens[b]
        per = -(-n // self.num_splits)
        return [int(self.table[b, p // self.page_size]) * self.page_size + p % self.page_size
                for p in range(s * per, min(s * per + per, n))]

    def outside(self) -> dict[tuple[int, int, int], list[int]]:
        """Per program, the slots it read that are not its split's (empty lists left out)."""
        found = {prog: sorted(set(read) - set(self.expected(prog[0], prog[2]))) for prog, read in self.slots.items()}
        return {prog: read for prog, read in found.items() if read}


@contextmanager
def record_reads(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """While the block runs, every interpreted load that reads k_cache or v_cache adds the slots it
    read to the yielded dict {grid index (b, g, s): set of slots}."""
    from triton.runtime import interpreter

    if not isinstance(interpreter.interpreter_builder, interpreter.InterpreterBuilder) or k_cache.is_cuda:
        raise ValueError("record_reads needs kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).")
    builder, reads = interpreter.interpreter_builder, {}
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t) for t in (k_cache, v_cache)]

    def load(ptrs, mask, other, *rest):
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64).ravel()
        for start, end, t in spans:
            inside = addresses[(addresses >= start) & (addresses < end)]
            if len(inside):
                slots = (inside - start) // t.element_size() // t.stride(0)
                reads.setdefault(tuple(builder.grid_idx), set()).update(slots.tolist())
        return original(ptrs, mask, other, *rest)

    original = builder.create_masked_load
    builder.create_masked_load = load
    try:
        yield reads
    finally:
        del builder.create_masked_load   # the class's method again


def kernel_reads(kernel, query, k_cache, v_cache, table, kv_lens, scale: float, page_size: int = 1,
                 num_splits: int = 1) -> KernelReads:
    """Run `paged_decode_attention(..., stage1=kernel)` once (None: the package's kernel), recording
    what its stage 1 read."""
    from kvlearn.kernels.decode import paged_decode_attention

    with record_reads(k_cache, v_cache) as reads:
        paged_decode_attention(query, k_cache, v_cache, table, kv_lens, scale, page_size, num_splits, stage1=kernel)
    return KernelReads({prog: sorted(read) for prog, read in sorted(reads.items())}, table.cpu(), kv_lens.tolist(),
                       page_size, num_splits, k_cache.shape[0])


def draw_kernel_reads(reads: KernelReads, title: str = "what each program of the decode kernel read"):
    """A matplotlib figure: one row per program (b, g, s), one column per pool slot, pages outlined and
    labelled by the table entry that holds them; a slot is blue when the program read it and should
    have, pale when it should have and did not, red when it read it and should not have."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    programs = sorted(reads.slots)
    grid = np.zeros((len(programs), reads.num_slots), dtype=np.int64)
    for row, (b, g, s) in enumerate(programs):
        grid[row, reads.expected(b, s)] = 1
        read = np.array(reads.slots[(b, g, s)], dtype=np.int64)
        grid[row, read] = np.where(grid[row, read] == 1, 2, 3)
    colours = [MASK["hidden (future)"], MASK["padding"], STATES["cached"], INK["path"]]
    fig, ax = plt.subplots(figsize=(min(14, max(6, reads.num_slots * 0.08)), 0.35 * len(programs) + 1.6))
    ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(programs)), [f"seq {b}, KV head {g}, split {s}" for b, g, s in programs], fontsize=8)
    for boundary in range(0, reads.num_slots + 1, reads.page_size):
        if reads.page_size > 1:
            ax.axvline(boundary - 0.5, color=INK["edge"], linewidth=0.4)
    labels = {}
    for b in range(len(reads.kv_lens)):
        for i in range(-(-reads.kv_lens[b] // reads.page_size)):
            labels.setdefault(int(reads.table[b, i]), []).append(f"{b}:{i}")
    top = ax.secondary_xaxis("top")
    top.set_xticks([p * reads.page_size + (reads.page_size - 1) / 2 for p in labels],
                   [",".join(v) for v in labels.values()], fontsize=7, rotation=90)
    top.set_xlabel("table entry (sequence:entry) that holds the page")
    ax.set_xlabel(f"pool slot ({reads.page_size} per page)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours[1:]]
    ax.legend(handles, ["its split's, not read", "read, its split's", "read, not its split's"], loc="upper left",
              bbox_to_anchor=(1.01, 1), frameon=False, fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig
