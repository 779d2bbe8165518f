"""Trust but verify: the guards a learner's part serves behind (chapter 6's hook, read in
`kvlearn.parts.guarded_kv.GUARDS`).

The package's own parts are called as they are: nothing here runs for them. A part that is not the
package's serves behind a guard that checks every answer before the engine uses it, against an
account of the guard's own, in code that `python -O` keeps:

- allocator: `AllocatorGuard`, the pool's account of the pages its callers hold;
- radix_cache: `RadixGuard` (kvlearn.parts.guard_caches): which slots the tree holds, for which
  token at which position, and which of them lie on locked paths;
- block_manager: `BlockManagerGuard` (the same module): which live block table holds each block,
  and which prefix the KV of each computed block belongs to;
- attention: `guard_attention(fn)`: the output's shape, dtype and no NaN.

A wrong answer raises `kvlearn.PartError` naming the part, the call, what it returned and what the
contract says. A cache guard whose part broke its contract is `broken`: its KV manager (the guarded
modes in `kvlearn.parts.guarded_kv`) asks the part nothing more, releases the requests the step
aborts from the guard's own account, and, once no request holds KV, empties the part and gives
back every slot it held (`drop_all`), so the engine serves on.
"""

from __future__ import annotations

import torch

from kvlearn.device import resolve_device
from kvlearn.errors import KVCapacityError, PartError


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value, edge: int = 8) -> str:
    """A short picture of a part's answer for an error message (a long list: its ends)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.is_floating_point():
            return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        items = list(value)
        inner = items if len(items) <= 2 * edge else items[:edge] + ["..."] + items[-edge:]
        return f"[{', '.join(map(str, inner))}] ({len(items)} items)"
    return f"{type(value).__name__} {value!r}"[:200]


class Guard:
    """What every guard shares: the part it wraps, and `fail`, which marks the guard broken and
    raises the PartError (also kept in `error`, so that a part that swallows it in a callback is
    still caught when its call returns)."""

    name: str   # the part's name ("radix_cache", ...)

    def __init__(self, part):
        self.part, self.broken, self.error = part, False, None

    def fail(self, call: str, returned: str, contract: str):
        self.broken = True
        self.error = PartError(self.name, self.part, call, returned, contract)
        raise self.error

    def check_int(self, call: str, value, low: int, high: int, what: str) -> int:
        if not is_int(value) or not low <= value <= high:
            self.fail(call, shown(value), f"{what}: an int in {low} .. {high}")
        return value

    def raise_swallowed(self) -> None:
        """After a call that runs the guard's callbacks: the error a callback raised, even if the part caught it."""
        if self.error is not None:
            raise self.error


class AllocatorGuard(Guard):
    """A learner's page allocator (kvlearn.parts "allocator"), built as `part_cls(num_pages,
    device=...)`, as the pool calls it: every page it hands out is checked against the guard's own
    account of the pages callers hold (`held`), and that account, not the part's, answers
    `num_free` and `is_free`. The pool builds it as it builds an allocator class:
    `functools.partial(AllocatorGuard, part_cls)(num_pages, device=...)`.

    Invariant: `held[p]` exactly when `alloc` handed out page p and `free` has not taken it back;
    an answer that breaks the part's contract raises `PartError` and leaves the account unchanged
    (the pages of a refused `alloc` that were rightly free go back to the part)."""

    name = "allocator"

    def __init__(self, part_cls, num_pages: int, device=None):
        self.num_pages, self.device = num_pages, resolve_device(device)
        super().__init__(part_cls(num_pages, device=self.device))
        self.held = torch.zeros(num_pages, dtype=torch.bool, device=self.device)
        self.num_held = 0

    @property
    def num_free(self) -> int:
        return self.num_pages - self.num_held

    @property
    def free_pages(self) -> list[int]:
        """The part's free list (for pictures): the pages it will hand out, in its order."""
        return self.part.free_pages

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        return ~self.held[pages.to(self.device)]

    def alloc(self, n: int) -> torch.Tensor:
        """The part's `alloc(n)`, checked: n distinct int64 page ids in range that nobody holds."""
        call = f"alloc({n})"
        try:
            pages = self.part.alloc(n)
        except KVCapacityError as err:   # the pool asks only for pages its account says are free
            raise PartError("allocator", self.part, call, f"KVCapacityError ({err})",
                            f"{self.num_free} of its {self.num_pages} pages are free, so alloc({n}) must "
                            "succeed") from err
        if not (isinstance(pages, torch.Tensor) and pages.dtype == torch.int64 and pages.dim() == 1
                and pages.numel() == n):
            got = f"a {pages.dtype} tensor of shape {list(pages.shape)}" if isinstance(pages, torch.Tensor) else shown(pages)
            self.fail(call, got, f"alloc(n) returns a 1-D int64 tensor of n={n} page ids")
        pages = pages.to(self.device)
        if n:
            in_range = (pages >= 0) & (pages < self.num_pages)
            first = torch.ones(n, dtype=torch.bool, device=self.device)   # the first time each id appears
            order = torch.sort(pages, stable=True)
            first[order.indices[1:]] = order.values[1:] != order.values[:-1]
            unheld = ~self.held[pages.clamp(0, self.num_pages - 1)]
            usable = in_range & first & unheld
            if not usable.all():
                i = int((~usable).nonzero()[0])
                why = (f"page {int(pages[i])} is not one of 0 .. {self.num_pages - 1}" if not in_range[i] else
                       f"page {int(pages[i])} appears twice" if not first[i] else
                       f"page {int(pages[i])} is held (handed out before and not freed since)")
                if usable.any():   # the pages it rightly took from its free list go back to it
                    self.part.free(pages[usable])
                self.fail(call, f"pages {shown(pages)}", f"a page is handed out at most once until it is freed: {why}")
        self.held[pages] = True
        self.num_held += n
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Distinct, in-range pages (the pool checked them): refused, nothing freed, unless every one
        is held; then the account and the part take them back (a part that refuses: PartError)."""
        if not pages.numel():
            return
        pages = pages.to(self.device)
        if not self.held[pages].all():
            bad = pages[~self.held[pages]][:5].tolist()
            raise ValueError(f"Double free: page(s) {bad} are free by the pool's account; free only what alloc handed out.")
        self.held[pages] = False
        self.num_held -= pages.numel()
        try:
            self.part.free(pages)
        except Exception as err:
            raise PartError("allocator", self.part, f"free(pages {shown(pages)})", f"{type(err).__name__} ({err})",
                            "free takes back distinct pages that alloc handed out; the pool counts them free "
                            "now, the part will not hand them out again") from err


def guard_attention(fn):
    """A learner's attention function (kvlearn.parts "attention") with its output checked in every
    layer: [T, heads, head_dim] like the query, the query's dtype and device, no NaN."""

    def guarded(query, key, value, layer, kv_pool, md, scale=None):
        out = fn(query, key, value, layer, kv_pool, md, scale)
        call = f"attention(layer {layer}, {query.shape[0]} tokens)"
        if not (isinstance(out, torch.Tensor) and out.shape == query.shape and out.dtype == query.dtype
                and out.device == query.device):
            raise PartError("attention", fn, call, shown(out), f"it returns [T, heads, head_dim] = "
                            f"{list(query.shape)} of {query.dtype} on {query.device}, like the query")
        if torch.isnan(out).any():
            raise PartError("attention", fn, call, "NaN in its output", "attention of finite inputs is finite")
        return out

    guarded.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
    return guarded
