"""What every launcher of `kvlearn.kernels` checks before it hands tensors to a kernel, in one place.

A kernel sees bare pointers and the strides it is given: it adds offsets to them, and nothing stops
it from reading or writing past a tensor (a segfault, or another tensor's numbers) or from dividing
by an empty softmax (NaN). So each launcher calls one `check_*` function of this module, which
refuses such input with a message that names the argument and says what to do: TypeError for a
wrong dtype or a kernel that is not one (`kvlearn.errors`' rule), ValueError for everything else.

- Shapes, dtypes, devices and layouts are checked on every call: they are on the host, free.
- Ranges are in the tensors' values (slots inside the pool, 1 <= kv_len <= the table's width in
  positions, table entries inside the pool, 1 <= new tokens <= kv_len): reading them on CUDA costs a
  device sync per layer. They always run on a CPU; on CUDA only after `check_ranges(True)`, which
  `python -m kvlearn gpu-check` calls. Without it, CUDA trusts the engine, which builds them right.

What the kernels assume, and these checks keep true:
- every tensor's last dimension is contiguous; the other strides are kernel arguments;
- v_cache has k_cache's layout (the kernels address both with k_cache's strides), as a `KVPool`'s
  `k[layer]` and `v[layer]` have;
- float tensors are float32, float16 or bfloat16 (what `tl.dot` multiplies); index tensors int64 or
  int32 (a kernel widens a slot to int64 before it multiplies it by a stride, so an int32 table
  cannot overflow the offset of a large pool);
- head_dim is any size: a tile holds `tile(head_dim)` numbers (the next power of two, at least 16,
  which `tl.dot` needs on a GPU), and the kernels mask the ones past head_dim;
- slot -1 in `slot_mapping` is padding: `store_kvcache` writes that token nowhere, as nano-vllm's
  store kernel and vLLM's `reshape_and_cache` do (a batch padded to a fixed size, e.g. for CUDA
  graphs). Any other negative slot is refused (unchecked, on CUDA, the kernel skips it too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kvlearn.errors import check_bool, check_positive_int
from kvlearn.kernels import LazyKernel

# Whether this process's kernels run in Triton's interpreter: `triton.jit` decides when it wraps a
# kernel, by TRITON_INTERPRET at that moment (the kernels of kvlearn.kernels are wrapped when their
# modules are first imported, right after this one). The helpers of triton.language that they call
# (tl.max, tl.sum, tl.cdiv) were wrapped when triton itself was first imported, and must agree.
INTERPRETED = bool(knobs.runtime.interpret)
LANGUAGE_INTERPRETED = isinstance(tl.max, InterpretedFunction)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)
# What each letter of a shape pattern counts; one letter has one size across a launcher's tensors.
SIZES = {"T": "number of tokens", "B": "number of sequences", "H": "number of query heads",
         "K": "number of KV heads", "D": "head_dim", "S": "number of slots", "W": "table entries per sequence",
         "C": "number of sequences + 1 (cumulative new-token counts)", "1": "1 (one scale per row)"}

_ranges_on_cuda = False


def check_ranges(on: bool) -> None:
    """Check ranges on CUDA too (on=True), at a device sync per launch, or not (False, the default).
    On a CPU they always run."""
    global _ranges_on_cuda
    _ranges_on_cuda = check_bool("on", on)


def tile(n: int) -> int:
    """The tile size that holds n numbers of one row: the next power of two (`tl.arange` makes only
    those), at least 16 (the smallest side of a `tl.dot` on a GPU)."""
    return max(16, triton.next_power_of_2(n))


def dot_dtype(cache_dtype: torch.dtype):
    """The dtype a kernel's products run in: the cache's, with float32 accumulation (a 16-bit cache
    uses the tensor cores). Under the interpreter a bfloat16 cache's products run in float32: its
    `tl.dot` multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584, unsupported)."""
    if cache_dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[cache_dtype]


def check_launch(device) -> None:
    """ValueError, saying what to do, when the kernels cannot run on `device` in this process: on a
    CPU they must be interpreted, and interpreted kernels need triton.language's helpers interpreted."""
    if INTERPRETED and not LANGUAGE_INTERPRETED:
        raise ValueError("TRITON_INTERPRET=1 was set after triton was first imported (loading a model imports it), "
                         "so triton's own helpers were built for a GPU and the interpreter cannot run the kernels: set "
                         "it before anything imports triton, in the environment before Python starts or first thing "
                         "in the notebook (then restart its kernel).")
    if torch.device(device).type != "cuda" and not INTERPRETED:
        raise ValueError("Triton's kernels were built for a GPU in this process (TRITON_INTERPRET was not set when "
                         "kvlearn.kernels was first imported), so they cannot run on the CPU: set TRITON_INTERPRET=1 "
                         "before Python starts (in a notebook: restart the kernel), or use attention_backend='torch'.")


def check_kernel(name: str, kernel, like):
    """Return `kernel` if it is a Triton kernel (`@triton.jit`) with `like`'s parameters, by name and
    in order (the launcher passes them so); else TypeError. A `LazyKernel` is the kernel it names."""
    if isinstance(kernel, LazyKernel):
        kernel = kernel.kernel
    if not isinstance(kernel, (JITFunction, InterpretedFunction)):
        raise TypeError(f"{name} must be a Triton kernel (a function decorated with @triton.jit), got "
                        f"{type(kernel).__name__} {kernel!r}: put @triton.jit on the line above its def.")
    if kernel.arg_names != like.arg_names:
        raise TypeError(f"{name} must take exactly the parameters of {like.__name__}, in order: "
                        f"({', '.join(like.arg_names)}); {kernel.__name__} takes ({', '.join(kernel.arg_names)}): "
                        "copy the signature, the launcher passes those.")
    return kernel


def check_store(key, value, k_cache, v_cache, slot_mapping, scales=(None, None)) -> None:
    """`store_kvcache`'s arguments: key, value [T, K, D]; caches [S, K, D] (with `scales`, int8 codes:
    see `_check_tensors`); slot_mapping [T], each slot in 0 .. S-1 or -1 (padding)."""
    _check_tensors(dict(key=(key, "TKD"), value=(value, "TKD")), dict(slot_mapping=(slot_mapping, "T")),
                   k_cache, v_cache, scales)
    if not _ranges_wanted(key.device):
        return
    slots = k_cache.shape[0]
    if (t := _first((slot_mapping < -1) | (slot_mapping >= slots))) is not None:
        raise ValueError(f"slot_mapping[{t[0]}] is {int(slot_mapping[t])}, outside k_cache's {slots} slots: give each "
                         f"token a slot from 0 to {slots - 1} (one the pool allocated), or -1 for a padding token, "
                         "which is written nowhere.")


def check_decode(query, k_cache, v_cache, table, kv_lens, page_size, num_splits) -> None:
    """`paged_decode_attention`'s arguments: query [B, H, D]; caches [S, K, D] with K dividing H;
    table [B, W]; kv_lens [B], 1 <= kv_lens[b] <= W * page_size; the table entries that
    kv_lens[b] reads inside the pool; num_splits None or >= 1."""
    if num_splits is not None:
        check_positive_int("num_splits", num_splits, " (pieces of each context, merged by stage 2)")
    _check_attention(query, "BHD", k_cache, v_cache, table, kv_lens, page_size, {}, (None, None))


def check_extend(query, k_cache, v_cache, table, kv_lens, cu_q, page_size, max_q_len, scales=(None, None)) -> None:
    """`extend_attention`'s arguments: query [T, H, D]; caches, table, kv_lens as in `check_decode`
    (B sequences; with `scales`, int8 codes as in `check_store`); cu_q [B + 1] from 0 to T, sequence
    b's new tokens 1 <= cu_q[b+1] - cu_q[b] <= kv_lens[b]; max_q_len None or at least the largest."""
    if max_q_len is not None:
        check_positive_int("max_q_len", max_q_len, " (the most new tokens of one sequence)")
    _check_attention(query, "THD", k_cache, v_cache, table, kv_lens, page_size, dict(cu_q=(cu_q, "C")), scales)
    batch = kv_lens.shape[0]
    if cu_q.shape[0] != batch + 1:
        raise ValueError(f"cu_q must have one entry per sequence and one more ({batch + 1}, as kv_lens has {batch} "
                         f"sequences), got shape {tuple(cu_q.shape)}: build it as F.pad(q_lens.cumsum(0), (1, 0)) "
                         "from each sequence's new-token count.")
    if not _ranges_wanted(query.device):
        return
    tokens = query.shape[0]
    if int(cu_q[0]) != 0 or int(cu_q[-1]) != tokens:
        raise ValueError(f"cu_q must run from 0 to query's {tokens} tokens (sequence b's new tokens are query's rows "
                         f"cu_q[b] .. cu_q[b+1] - 1), got cu_q[0] = {int(cu_q[0])} and cu_q[-1] = {int(cu_q[-1])}: "
                         "build it as F.pad(q_lens.cumsum(0), (1, 0)).")
    q_lens = cu_q[1:] - cu_q[:-1]
    if (b := _first((q_lens < 1) | (q_lens > kv_lens))) is not None:
        b = b[0]
        raise ValueError(f"Sequence {b} has {int(q_lens[b])} new tokens (cu_q[{b + 1}] - cu_q[{b}]) and kv_lens[{b}] = "
                         f"{int(kv_lens[b])}: its new tokens are the last of its context, so 1 <= new tokens <= "
                         "kv_len; give kv_lens[b] its cached prefix plus its new tokens.")
    if max_q_len is not None and max_q_len < int(q_lens.max()):
        raise ValueError(f"max_q_len is {max_q_len}, but a sequence has {int(q_lens.max())} new tokens: pass the "
                         "largest new-token count, or max_q_len=None to have it computed.")


def _check_attention(query, pattern, k_cache, v_cache, table, kv_lens, page_size, more, scales) -> None:
    """What `check_decode` and `check_extend` share: tensors, GQA groups, page_size and contexts."""
    check_positive_int("page_size", page_size, " (slots per table entry)")
    _check_tensors(dict(query=(query, pattern)), dict(table=(table, "BW"), kv_lens=(kv_lens, "B"), **more),
                   k_cache, v_cache, scales)
    heads, kv_heads = query.shape[1], k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query has {heads} heads, not a multiple of k_cache's {kv_heads} KV heads: grouped-query "
                         "attention gives every KV head the same number of query heads; pass the caches of the "
                         "model's num_key_value_heads.")
    if not _ranges_wanted(query.device):
        return
    width, pages = table.shape[1] * page_size, k_cache.shape[0] // page_size
    if (b := _first((kv_lens < 1) | (kv_lens > width))) is not None:
        raise ValueError(f"kv_lens[{b[0]}] is {int(kv_lens[b])}, but a sequence attends over 1 to {width} positions "
                         f"(at least its new token, whose K and V store_kvcache wrote first; at most what table's "
                         f"{table.shape[1]} entries of {page_size} slot(s) each hold): give kv_lens[b] its cached "
                         "prefix plus its new tokens, and widen the table if that needs more.")
    read = torch.arange(table.shape[1], device=table.device)[None, :] * page_size < kv_lens[:, None]
    if (at := _first(read & ((table < 0) | (table >= pages)))) is not None:
        pool = f"{pages} slots" if page_size == 1 else f"{pages} pages of {page_size} slots"
        raise ValueError(f"table[{at[0]}, {at[1]}] is {int(table[at])}, outside k_cache's {pool}: fill the entries "
                         f"that kv_lens reads with ids from 0 to {pages - 1}, as the pool allocated them.")


def _check_tensors(floats: dict, indices: dict, k_cache, v_cache, scales) -> None:
    """Device, dtypes, shapes (a pattern per tensor, one letter per dimension, `SIZES`) and layouts
    of a launch's tensors, each given as name=(tensor, pattern), and of the caches [S, K, D]: floats,
    or, with `scales` (k_scale, v_scale: float32 [S, K, 1]), an int8 pool's codes, row (s, k) standing
    for codes[s, k] * scale[s, k] (chapter 10: `kvlearn.quant.Int8Format.unpack` of a pool's rows)."""
    caches = dict(k_cache=(k_cache, "SKD"), v_cache=(v_cache, "SKD"))
    quantized = any(scale is not None for scale in scales)
    codes = caches if quantized else {}
    floats = {**floats, **({} if quantized else caches)}
    scaled = dict(k_scale=(scales[0], "SK1"), v_scale=(scales[1], "SK1")) if quantized else {}
    named = {**floats, **indices, **codes, **scaled}
    if any(t is None for t, _ in named.values()):
        raise ValueError("Give both k_scale and v_scale (an int8 pool's), or neither (a float pool).")
    check_launch(next(iter(named.values()))[0].device)
    devices = {name: t.device for name, (t, _) in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"The tensors are on different devices ({devices}): put them on one device.")
    for group, allowed, what, fix in ((floats, FLOAT_DTYPES, "float32, float16 or bfloat16", "float()"),
                                      (indices, INDEX_DTYPES, "int64 or int32 (slot, page or position numbers)",
                                       "long()"),
                                      (codes, (torch.int8,), "int8 codes, with k_scale and v_scale", "to(torch.int8)"),
                                      (scaled, (torch.float32,), "float32 (one scale per row)", "float()")):
        for name, (t, _) in group.items():
            if t.dtype not in allowed:
                raise TypeError(f"{name} must be {what}, got {t.dtype}: pass {name}.{fix}.")
    sizes = {}
    for name, (t, pattern) in named.items():
        if t.dim() != len(pattern):
            raise ValueError(f"{name} must be {len(pattern)}-D [{', '.join(SIZES[c] for c in pattern)}], got shape "
                             f"{tuple(t.shape)}: pass it in that layout.")
        for letter, n in zip(pattern, t.shape, strict=True):
            first, size = sizes.setdefault(letter, (name, n))
            if size != n:
                raise ValueError(f"{name}'s {SIZES[letter]} is {n} (shape {tuple(t.shape)}), but {first}'s is {size}: "
                                 "give both the same.")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                             f"{tuple(t.stride())}: pass {name}.contiguous().")
    for k, v in (("k_cache", "v_cache"), ("k_scale", "v_scale"))[:1 + quantized]:
        (k_t, _), (v_t, _) = named[k], named[v]
        if v_t.dtype != k_t.dtype or v_t.stride() != k_t.stride():
            raise ValueError(f"{v} must have {k}'s dtype and strides (the kernels address both with {k}'s), got "
                             f"{v_t.dtype} {tuple(v_t.stride())} and {k_t.dtype} {tuple(k_t.stride())}: pass a "
                             f"KVPool's k[layer] and v[layer], or both .contiguous() in one dtype.")


def _ranges_wanted(device) -> bool:
    return torch.device(device).type != "cuda" or _ranges_on_cuda


def _first(bad: torch.Tensor) -> tuple | None:
    """The index of the first True in `bad`, or None (reading it is a device sync on CUDA)."""
    where = bad.nonzero()
    return tuple(where[0].tolist()) if len(where) else None
