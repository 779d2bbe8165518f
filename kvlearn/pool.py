"""The KV memory pool: one preallocated tensor that holds every token's keys and values.

The logical layer (block tables, radix tree) never stores K or V itself. It stores *slot indices*
into this pool, and the model's attention reads and writes K and V at those slots. Two pieces:

- `KVPool`: the storage, `[num_layers, 2, num_slots, num_kv_heads, head_dim]` allocated once, and
  the one page allocator (kvlearn.allocator's `PageAllocator`, or the class it is given) that says
  which of its pages are free.
- `ReqToTokenPool`: one row per live request listing the slot of each of its tokens, the table
  attention reads a request's context through.

A slot holds rows in the pool's format (`kv_cache_dtype`, vLLM's names; chapter 10's `kvlearn.quant`
adds quantized ones): a row's scale lives in its slot, so whatever moves a slot moves its scale.

Invariant: every slot is either free (in the allocator) or owned by exactly one caller; `alloc` and
`free` check their arguments before they change anything, so a refused call leaves the pool as it was.
"""

from __future__ import annotations

import torch

from kvlearn.allocator import PageAllocator, check_free_ids
from kvlearn.device import resolve_device
from kvlearn.errors import KVCapacityError, check_choice, check_int, check_positive_int
from kvlearn.formats import KV_CACHE_DTYPES
from kvlearn.memory import KVConfig, get_config, kv_bytes_per_token


def available_bytes(device: torch.device) -> int | None:
    """Memory a new tensor on `device` may still take: the GPU's free memory, or the machine's
    MemAvailable (/proc/meminfo); None where that is unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        return None


def check_fits(bytes_per_token: int, num_slots: int, device: torch.device) -> None:
    """MemoryError, before anything is allocated, for a pool larger than the memory left on `device`."""
    need, have = bytes_per_token * num_slots, available_bytes(device)
    if have is not None and need > have:
        gib = 1024 ** 3
        raise MemoryError(f"A KV pool of {num_slots:,} slots needs about {need / gib:,.2f} GiB ({bytes_per_token:,} "
                          f"bytes per token) but about {have / gib:,.2f} GiB of {device.type} memory are available: "
                          f"use a smaller num_slots (about {have // bytes_per_token:,} would fill it all).")


class Cast:
    """The format of "auto" and "bfloat16": a row is head_dim values in `dtype`. A format has `dtype`,
    `row` (entries per token and KV head), `encode(x) -> rows` and `decode(rows, dtype) -> x`."""

    def __init__(self, dtype: torch.dtype, head_dim: int):
        self.dtype, self.row = dtype, head_dim
    def encode(self, x): return x.to(self.dtype)
    def decode(self, rows, dtype): return rows.to(dtype)


KV_CACHE_DTYPES.update(auto=Cast, bfloat16=lambda dtype, head_dim: Cast(torch.bfloat16, head_dim))


class KVPool:
    """K and V for every layer in one preallocated tensor, handed out slot by slot (or page by page).

    `k[layer]` and `v[layer]` are `[num_slots, num_kv_heads, row]` views of it, in the format
    `self.format` of `kv_cache_dtype` ("auto": head_dim values in `dtype`); `bytes_per_token` counts scales.
    `allocator` is the page allocator, built as `allocator_cls(num_pages, device=...)`: chapter 4's `PageAllocator`
    when None, else exactly the class given (a learner's part, with the contract `kvlearn.parts.AllocatorPart`; the
    engine gives it behind a guard); `format_cls(dtype, head_dim)`, if given, builds `format` (chapter 10: a learner's
    quantizer, behind its guard). A pool larger than the memory left on its device is refused (MemoryError, with an
    estimate) before anything is allocated. With `page_size > 1` the allocator works in whole pages: `alloc(n)` needs
    `n` to be a multiple of `page_size` and returns the slots of `n // page_size` pages, each page `page_size`
    consecutive slots starting at a multiple of `page_size`; `free` takes back whole pages only.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device=None, page_size: int = 1,
                 allocator_cls=None, kv_cache_dtype: str = "auto", format_cls=None):
        check_choice("kv_cache_dtype", kv_cache_dtype, sorted(KV_CACHE_DTYPES))
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("num_slots", num_slots), ("page_size", page_size)):
            check_positive_int(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
        if num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size ({page_size}): "
                             f"use {num_slots - num_slots % page_size or page_size}.")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_slots, self.page_size, self.dtype, self.kv_cache_dtype = num_slots, page_size, dtype, kv_cache_dtype
        self.device = resolve_device(device)
        self.format = (format_cls or KV_CACHE_DTYPES[kv_cache_dtype])(dtype, head_dim)
        # The chapter-0 count, over a row; query heads do not change KV size, so one per KV head.
        shape = KVConfig("KVPool", "MHA", num_layers, num_kv_heads, num_kv_heads, self.format.row)
        self.bytes_per_token = kv_bytes_per_token(shape, self.format.dtype)
        check_fits(self.bytes_per_token, num_slots, self.device)
        self.kv = torch.zeros(num_layers, 2, num_slots, num_kv_heads, self.format.row, dtype=self.format.dtype,
                              device=self.device)
        assert self.nbytes == self.bytes_per_token * num_slots
        self.k = tuple(self.kv[layer, 0] for layer in range(num_layers))
        self.v = tuple(self.kv[layer, 1] for layer in range(num_layers))
        # Every slot of the pool is handed out through this allocator, in every cache mode.
        self.allocator = (allocator_cls or PageAllocator)(num_slots // page_size, device=self.device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)

    @classmethod
    def for_model(cls, config, num_slots: int | None = None, memory_budget_bytes: int | None = None,
                  dtype: torch.dtype = torch.float32, device=None, page_size: int = 1,
                  allocator_cls=None, kv_cache_dtype: str = "auto", format_cls=None) -> KVPool:
        """A pool shaped for `config` (transformers config or `kvlearn.memory.KVConfig`), sized by
        exactly one of `num_slots` or `memory_budget_bytes` (whole pages that fit the budget)."""
        if (num_slots is None) == (memory_budget_bytes is None):
            raise ValueError("Give exactly one of num_slots or memory_budget_bytes.")
        cfg = get_config(config)
        if cfg.attention == "MLA" or (cfg.v_head_dim and cfg.v_head_dim != cfg.head_dim):
            raise ValueError(f"{cfg.name} caches a latent (MLA) or has V heads narrower than K heads; "
                             "KVPool stores plain K and V per KV head (MHA / GQA models only).")
        if memory_budget_bytes is not None:
            num_slots = cls.slots_for_budget(cfg, memory_budget_bytes, dtype, page_size, kv_cache_dtype)
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots, dtype=dtype, device=device,
                   page_size=page_size, allocator_cls=allocator_cls, kv_cache_dtype=kv_cache_dtype,
                   format_cls=format_cls)

    @staticmethod
    def slots_for_budget(config, memory_budget_bytes: int, dtype: torch.dtype = torch.float32,
                         page_size: int = 1, kv_cache_dtype: str = "auto") -> int:
        """How many slots (whole pages) of KV fit in the budget, by the chapter-0 count over the format's rows."""
        check_positive_int("memory_budget_bytes", memory_budget_bytes)
        check_positive_int("page_size", page_size)
        check_choice("kv_cache_dtype", kv_cache_dtype, sorted(KV_CACHE_DTYPES))
        head_dim = get_config(config).head_dim
        fmt = KV_CACHE_DTYPES[kv_cache_dtype](dtype, head_dim)
        per_token = kv_bytes_per_token(config, fmt.dtype) * fmt.row // head_dim
        slots = memory_budget_bytes // per_token // page_size * page_size
        if slots == 0:
            raise ValueError(f"A budget of {memory_budget_bytes} bytes does not hold one page of "
                             f"{page_size} token(s) at {per_token} bytes per token: give at least "
                             f"{per_token * page_size} bytes.")
        return slots

    @property
    def num_free(self) -> int:
        """Free slots (always a whole number of pages)."""
        return self.allocator.num_free * self.page_size

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V (`[len(slots), num_kv_heads, head_dim]` each) of one layer at `slots`.
        Shapes and slot range are checked before anything is written."""
        check_int("layer", layer)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}.")
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64:
            raise TypeError(f"slots must be a 1-D int64 tensor (as returned by alloc), got {type(slots).__name__}.")
        want = (slots.numel(), self.num_kv_heads, self.head_dim)
        if slots.dim() != 1 or tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"store() needs 1-D slots and K, V of shape [len(slots), num_kv_heads, head_dim]"
                             f" = {list(want)}; got slots {list(slots.shape)}, K {list(k.shape)}, V {list(v.shape)}.")
        self.write(layer, self._as_slots(slots), k, v)   # _as_slots: ValueError for a slot outside the pool

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`store` without the checks: attention calls it in every layer of every forward, on slots
        the runner has already checked once for the whole step. Each row is encoded in the pool's format."""
        self.k[layer].index_copy_(0, slots, self.format.encode(k))
        self.v[layer].index_copy_(0, slots, self.format.encode(v))

    def is_free(self, indices: torch.Tensor) -> torch.Tensor:
        """Boolean tensor: is each of these slots free? ValueError for a slot outside the pool."""
        return self.allocator.is_free(self._as_slots(indices) // self.page_size)

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` free slots; returns an int64 tensor of slot ids. Raises KVCapacityError (and takes
        nothing) when fewer than `n` are free."""
        check_int("n", n)
        if n % self.page_size:
            raise ValueError(f"With page_size={self.page_size}, alloc(n) takes whole pages: n={n} is not a "
                             f"multiple of {self.page_size}; ask for {-(-n // self.page_size) * self.page_size}.")
        if n > self.num_free:
            raise KVCapacityError(f"The KV pool has {self.num_free} free slots, {n} were asked for: free "
                                  "finished requests, evict cached prefixes, or build a bigger pool.")
        pages = self.allocator.alloc(n // self.page_size)
        return pages if self.page_size == 1 else self.slots_of(pages)   # a page is a slot

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        """The slots of these pages, page after page."""
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def free(self, indices) -> None:
        """Give slots back. They must be allocated, distinct and (page_size > 1) make up whole pages;
        otherwise ValueError and nothing is freed."""
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.int64 and not indices.numel():
            return   # nothing to give back (a frequent case: no duplicate slots to drop)
        if (self.page_size == 1 and isinstance(indices, torch.Tensor) and indices.dtype == torch.int64
                and indices.device == self.device):
            slots = indices.reshape(-1)   # the usual free: the allocator's own check, in slots, is all it needs
        else:
            slots = self._as_slots(indices)
        if self.page_size == 1:
            check_free_ids(slots, self.num_slots, "slot")
            pages = slots.sort().values
        else:
            pages, counts = torch.unique(slots // self.page_size, return_counts=True)
            if (counts != self.page_size).any():
                raise ValueError(f"With page_size={self.page_size}, free() takes whole pages: every page touched "
                                 f"must have all of its {self.page_size} slots listed, once each.")
        self.allocator.free(pages)

    def _as_slots(self, indices) -> torch.Tensor:
        """Slot ids (a tensor or a list of ints) as a flat int64 tensor on the pool's device, checked
        to be integers inside the pool."""
        if not isinstance(indices, torch.Tensor):
            try:
                indices = torch.as_tensor(indices)  # no dtype: floats and bools must reach the check below
            except (TypeError, RuntimeError, ValueError, OverflowError):
                raise TypeError(f"Slot indices must be a tensor or a list of ints, got {type(indices).__name__} "
                                f"{indices!r}.") from None
            if indices.numel() == 0:
                indices = indices.long()
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"Slot indices must be integers, got a {indices.dtype} tensor.")
        indices = indices.reshape(-1).to(device=self.device, dtype=torch.int64)
        if indices.numel() and (indices.min() < 0 or indices.max() >= self.num_slots):
            raise ValueError(f"Slot indices must be in [0, {self.num_slots}), got values from "
                             f"{int(indices.min())} to {int(indices.max())}.")
        return indices

    def __repr__(self) -> str:
        mib, kind = self.nbytes / (1 << 20), self.kv_cache_dtype
        kind = str(self.dtype).removeprefix("torch.") if kind == "auto" else kind
        return (f"KVPool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"slots={self.num_slots}, page_size={self.page_size}, free={self.num_free}, "
                f"dtype={kind}, {mib:.1f} MiB, device={self.device.type})")


class ReqToTokenPool:
    """Per live request, the pool slot of each of its tokens: `req_to_token[row, i]` is the slot of
    token i. A block table or a radix match fills a row; attention gathers a request's context
    through it. Rows are reused after `free`; entries past a row's length are meaningless."""

    def __init__(self, max_requests: int, max_context_len: int, device=None):
        check_positive_int("max_requests", max_requests)
        check_positive_int("max_context_len", max_context_len)
        self.device = resolve_device(device)
        # empty, not zeros: a row is only read up to its length, and untouched rows cost no memory
        self.req_to_token = torch.empty(max_requests, max_context_len, dtype=torch.int64, device=self.device)
        self.lengths = [0] * max_requests
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._live = [False] * max_requests

    @property
    def max_context_len(self) -> int:
        return self.req_to_token.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self, slots: torch.Tensor | None = None) -> int:
        """A free row for a new request, holding `slots` from token 0 (none: its length starts at 0).
        The slots are checked before the row is taken: on an error nothing changed."""
        if not self._free_rows:
            raise KVCapacityError(f"All {len(self.lengths)} request rows are in use: free a finished request first.")
        slots = self._as_slots([] if slots is None else slots, self._free_rows[-1], 0)
        row = self._free_rows.pop()
        self._live[row] = True
        self.req_to_token[row, :len(slots)] = slots
        self.lengths[row] = len(slots)
        return row

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that tokens start .. start+len(slots)-1 of request `row` live in `slots`; the row's
        length becomes start+len(slots) (so a write can only extend the known prefix)."""
        self._check_live(row)
        if not 0 <= start <= self.lengths[row]:
            raise ValueError(f"start={start} must be between 0 and the row's length {self.lengths[row]}: "
                             "a row has no holes.")
        slots = self._as_slots(slots, row, start)
        end = start + slots.numel()
        self.req_to_token[row, start:end] = slots
        self.lengths[row] = end

    def _as_slots(self, slots, row: int, start: int) -> torch.Tensor:
        """`slots` as a 1-D int64 tensor on the table's device, if row `row` has room for them from `start`."""
        if not (isinstance(slots, torch.Tensor) and slots.dtype == torch.int64 and slots.dim() == 1
                and slots.device == self.device):
            slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        if start + slots.numel() > self.max_context_len:
            raise ValueError(f"Request row {row} would hold {start + slots.numel()} tokens, more than "
                             f"max_context_len={self.max_context_len}.")
        return slots

    def slots(self, row: int) -> torch.Tensor:
        """The slots of the request's tokens so far, in token order (a view into the table)."""
        self._check_live(row)
        return self.req_to_token[row, :self.lengths[row]]

    def free(self, row: int) -> None:
        self._check_live(row)
        self.lengths[row] = 0
        self._live[row] = False
        self._free_rows.append(row)

    def _check_live(self, row: int) -> None:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self.lengths) \
                or not self._live[row]:
            raise ValueError(f"Row {row!r} is not a live request row: use a row returned by alloc() "
                             "and not yet freed.")

    def __repr__(self) -> str:
        live = len(self.lengths) - self.num_free
        return (f"ReqToTokenPool(rows={len(self.lengths)}, live={live}, "
                f"max_context_len={self.max_context_len})")
