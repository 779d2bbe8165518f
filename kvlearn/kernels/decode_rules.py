"""Where a stage-1 decode kernel may read and write, checked before each access in Triton's interpreter.

`paged_decode_attention(..., stage1=kernel)` runs a kernel that is not the package's (chapter 5's
exercise) under these rules (`obeyed`). Program (b, g, s) may:
- load only from the launch's tensors (query, k_cache, v_cache, table, kv_lens, part_out, part_lse);
- load from `table` only row b's entries of its split's positions, start // PAGE_SIZE ..
  (end - 1) // PAGE_SIZE: a lane that `ok` masks off loads nothing;
- store only into part_out and part_lse.
The first access that breaks a rule raises `AddressError` before it is made, naming the program,
the address and what it hit; its `rule` is the likely cause ("outside", "table row", "table index",
"table mask", "past" or "store"). In the interpreter a wrong index is a verdict, never a segfault. A
GPU checks none of this: a read outside memory there ends the CUDA context, and one inside it
silently reads another tensor's numbers.
"""

from __future__ import annotations

import numpy as np

from kvlearn.kernels.watch import AddressError, Spans

LOADS = ("query", "k_cache", "v_cache", "table", "kv_lens", "part_out", "part_lse")
STORES = ("part_out", "part_lse")
TABLE = LOADS.index("table")


def obeyed(query, k_cache, v_cache, table, kv_lens, part_out, part_lse, page_size: int, num_splits: int):
    """The `see` of `kvlearn.kernels.watch.watch` that holds one launch's programs to the rules."""
    spans = Spans(query=query, k_cache=k_cache, v_cache=v_cache, table=table, kv_lens=kv_lens,
                  part_out=part_out, part_lse=part_lse)
    lens, width, row = kv_lens.tolist(), table.shape[1], table.stride(0)

    def see(kind: str, program: tuple[int, int, int], addresses: np.ndarray) -> None:
        b, g, s = program
        who, verb = f"program (b={b}, kv_head={g}, split={s})", "read" if kind == "load" else "wrote"
        found = spans.where(addresses)
        outside = addresses[found < 0]
        near = spans.nearest(int(outside[0])) if len(outside) else None
        if kind == "load" and ((found == TABLE).any() or (near and near[0] == "table")):
            check_table(who, b, s, spans.elements(addresses, "table") - b * row)   # said as entries of row b
        if near:   # a slot just past the pool: its formula is off; far from everything: any offset may be
            rule = "slot" if near[0] in ("k_cache", "v_cache") and near_pool(int(outside[0])) else "outside"
            raise AddressError(f"{who} {verb} outside every tensor of the launch: at {near[0]} {near[1]}", rule)
        allowed = [spans.names.index(name) for name in (LOADS if kind == "load" else STORES)]
        wrong = found[~np.isin(found, allowed)]
        if len(wrong):
            raise AddressError(f"{who} wrote into {spans.names[wrong[0]]}: stage 1 writes only part_out and "
                               "part_lse", "store")

    def near_pool(address: int) -> bool:
        """Whether an address lies within the pool's size of k_cache's or v_cache's slots."""
        slots = [int(spans.elements(np.array([address]), name)[0]) // k_cache.stride(0)
                 for name in ("k_cache", "v_cache")]
        return any(-k_cache.shape[0] <= slot < 2 * k_cache.shape[0] for slot in slots)

    def check_table(who: str, b: int, s: int, entries: np.ndarray) -> None:
        n = lens[b]
        per = -(-n // num_splits)
        start, end = s * per, min(s * per + per, n)
        first, last = start // page_size, (end - 1) // page_size
        wrong = entries[(entries < first) | (entries > last)]
        if not len(wrong):
            return
        entry = int(wrong[0])
        if entry < 0 or entry >= width:
            said = f"table entry {entry} of a {width}-entry row (sequence {b}: kv_len {n}, pages of {page_size})"
        else:
            split = f"positions {start} .. {end - 1}, in entries {first} .. {last}" if end > start else "no position"
            said = f"table entry {entry} of row {b}, but its split holds {split}"
        if (wrong < 0).any():
            rule = "table row"       # another row's entries: the row's start, b * stride_tb, is off
        elif page_size > 1 and len(entries) > 2 and len(np.unique(entries)) == len(entries):
            rule = "table index"     # an entry per position, where positions of one page share one
        elif (wrong <= end // page_size).all():
            rule = "past"            # the mask lets position `end` through
        else:
            rule = "table mask"      # an unmasked load reads the entries of a whole tile
        raise AddressError(f"{who} read {said}", rule)

    return see
