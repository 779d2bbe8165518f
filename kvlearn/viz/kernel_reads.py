"""What a decode kernel read: which program (sequence, KV head, split) loaded which slots of the pool,
recorded from a real run in Triton's interpreter, and drawn over the block table (chapter 5).

Triton-Viz records a kernel's loads the same way: while one launch runs, `record_reads` watches the
interpreter's loads (`kvlearn.kernels.watch`) and notes, for the program running (its grid index),
each address a load did not mask that falls inside k_cache or v_cache, as a slot of the pool.
Interpreter only: on a GPU nothing is recorded (a ValueError says so). Triton is imported inside
the functions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvlearn.kernels.watch import AddressError, Spans, watch
from kvlearn.viz.palette import INK, MASK, STATES


@dataclass
class KernelReads:
    """One launch's reads: `slots[(b, g, s)]`, the pool slots program (b, g, s) loaded K or V from
    (sorted), beside what it should read: the slots of positions `start .. end - 1` of its split
    (`expected`), from the table, `kv_lens`, `page_size` and `num_splits` of the launch; `kernel`
    names the kernel that ran, `stopped` why the rules stopped it (None: it ran to its end)."""

    slots: dict[tuple[int, int, int], list[int]]
    table: torch.Tensor
    kv_lens: list[int]
    page_size: int
    num_splits: int
    num_slots: int
    kernel: str = "the package's decode_kernel"   # whose kernel ran: its name
    stopped: str | None = None                     # why it was stopped before its end, if it was

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
    if k_cache.is_cuda:
        raise ValueError("record_reads needs kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).")
    spans, reads = Spans(k_cache=k_cache, v_cache=v_cache), {}

    def see(kind, program, addresses):
        found = spans.where(addresses) if kind == "load" else np.array([], dtype=np.int64)
        for i, (name, t) in enumerate(spans.tensors.items()):
            if (found == i).any():
                slots = spans.elements(addresses[found == i], name) // t.stride(0)
                reads.setdefault(program, set()).update(slots.tolist())

    with watch(see):
        yield reads


def kernel_reads(kernel, query, k_cache, v_cache, table, kv_lens, scale: float, page_size: int = 1,
                 num_splits: int = 1) -> KernelReads:
    """Run `paged_decode_attention(..., stage1=kernel)` once (None: the package's kernel), recording
    what its stage 1 read. A kernel stopped by `kvlearn.kernels.decode_rules` (an access outside its
    rules) keeps what it read until then, and `stopped` says why."""
    from kvlearn.kernels.decode import paged_decode_attention

    stopped = None
    with record_reads(k_cache, v_cache) as reads:
        try:
            paged_decode_attention(query, k_cache, v_cache, table, kv_lens, scale, page_size, num_splits,
                                   stage1=kernel)
        except AddressError as error:
            stopped = str(error)
    return KernelReads({prog: sorted(read) for prog, read in sorted(reads.items())}, table.cpu(), kv_lens.tolist(),
                       page_size, num_splits, k_cache.shape[0],
                       "the package's decode_kernel" if kernel is None else kernel.__name__, stopped)


def draw_kernel_reads(reads: KernelReads, title: str | None = None):
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
    if title is None:
        title = f"what each program of {reads.kernel} read"
        title += f"\n(stopped: {reads.stopped})" if reads.stopped else ""
    ax.set_title(title, fontsize=9 if reads.stopped else None)
    fig.tight_layout()
    return fig
