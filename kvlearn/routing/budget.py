"""Memory, estimated before it is taken: what this process may still take, what a fleet and the
requests queued at its replicas take, how much trace text that memory holds once parsed, and what
a generated trace takes. `route` refuses, with the estimate, what would not fit.

The per-object sizes are CPython's, measured with tracemalloc and rounded up: a token in a list
is one 8-byte pointer (its int object is the trace's, shared), a queued request's own objects
(`Request`, its sequence, its entries in the scheduler and the event loop) about 450 bytes.
"""

from __future__ import annotations

import math

import torch

from kvlearn import pool

GB = 1024 ** 3
REPLICA_OVERHEAD_BYTES = 16_384   # a simulated replica's Python objects (scheduler, KV manager, tree)
REQUEST_OVERHEAD_BYTES = 1_024    # a queued request's objects besides its token list (measured about 450)
TOKEN_BYTES = 8                   # one token of a request's token list
PARSED_BYTES_PER_TEXT_BYTE = 16   # a trace's objects per byte of its text, at the peak of reading (measured up to 13)
GENERATED_BYTES_PER_TOKEN = 64    # a generated token: its int, its tuple slot, the generator's work (measured up to 45)
MAX_TRACE_TEXT_BYTES = 4 * GB     # text of one trace, decompressed: far above any published trace (Mooncake's
                                  # conversation trace is 3 MB for 12,031 requests)


def size(nbytes: float) -> str:
    """Bytes for a reader: GB from a tenth of one, MB below."""
    return f"{nbytes / GB:,.1f} GB" if nbytes >= GB / 10 else f"{nbytes / 2**20:,.1f} MB"


def available_bytes() -> tuple[int | None, int | None]:
    """(memory, address space) this process may still take: the machine's MemAvailable, and an
    address-space limit (ulimit -v) less what the process maps already; None where unknown."""
    import resource

    memory, space = pool.available_bytes(torch.device("cpu")), None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * resource.getpagesize()
        except (OSError, ValueError, IndexError):
            mapped = 0
        space = max(soft - mapped, 0)
    return memory, space


def fewest_available_bytes() -> int | None:
    """The smaller of `available_bytes`' two figures; None where neither is known."""
    known = [b for b in available_bytes() if b is not None]
    return min(known) if known else None


def fleet_bytes(replicas: int, slots: int, page_size: int, max_requests: int,
                max_context: int | None = None) -> tuple[int, int]:
    """What `simulate_fleet` preallocates: (bytes in all, rows of each replica's request table).
    Each replica holds a pool of `slots` (K and V of one float32 number each), its page allocator,
    and a request table (chapter 4's ReqToTokenPool) of min(max_requests, pages) rows x `slots`
    int64 slots, the largest part. The table is allocated empty, so a row costs memory only as far
    as the requests it holds reach: with `max_context` (the trace's longest request, in tokens)
    each row counts min(slots, max_context rounded up to pages)."""
    pages = slots // page_size
    rows = min(max_requests, max(pages, 1))
    width = slots if max_context is None else min(slots, -(-max_context // page_size) * page_size)
    return replicas * (rows * width * 8 + slots * 8 + pages * 9 + REPLICA_OVERHEAD_BYTES), rows


def queued_bytes(trace) -> int:
    """The most the requests of `trace` take while they wait or run at the replicas: every request
    at once (a burst can queue them all), each a list of its prompt and output tokens."""
    return sum((r.num_prompt_tokens + r.max_new_tokens) * TOKEN_BYTES + REQUEST_OVERHEAD_BYTES for r in trace)


def check_fleet_memory(replicas: int, slots: int, page_size: int, max_requests: int, trace=None) -> None:
    """Refuse, before anything is built, a fleet that would not fit in the memory left: the
    address space takes every request table whole, the memory only as far as the trace's longest
    request reaches; both take the trace's queued requests (`queued_bytes`) on top."""
    max_context = None if trace is None else max(r.num_prompt_tokens + r.max_new_tokens for r in trace)
    queued = 0 if trace is None else queued_bytes(trace)
    virtual, rows = fleet_bytes(replicas, slots, page_size, max_requests)
    resident, _ = fleet_bytes(replicas, slots, page_size, max_requests, max_context)
    memory, space = available_bytes()
    for tables, have, what in ((virtual, space, "of address space"), (resident, memory, "of memory")):
        if have is not None and tables + queued > have:
            requests = ""
            if trace is not None:
                tokens = sum(r.num_prompt_tokens + r.max_new_tokens for r in trace)
                requests = (f", and its {len(trace):,} requests take up to {size(queued)} more if they all wait at "
                            f"once ({tokens:,} prompt and output tokens): {size(tables + queued)} in all")
            raise MemoryError(
                f"the fleet would preallocate about {size(tables)} {what} ({replicas:,} replicas x {slots:,} slots, "
                f"each replica's request table {rows} rows x {slots:,} slots = {size(rows * slots * 8)}){requests}; "
                f"but {size(have)} are available: use fewer --replicas, a smaller --slots-per-replica, or a shorter "
                "trace.")


def trace_text_limit() -> tuple[int, str]:
    """(bytes, why): the most trace text (decompressed) a reader takes in, the smaller of
    MAX_TRACE_TEXT_BYTES and what the memory left holds once parsed (PARSED_BYTES_PER_TEXT_BYTE)."""
    have = fewest_available_bytes()
    if have is None or have // PARSED_BYTES_PER_TEXT_BYTE >= MAX_TRACE_TEXT_BYTES:
        return MAX_TRACE_TEXT_BYTES, f"kvlearn reads at most {MAX_TRACE_TEXT_BYTES / GB:g} GB of trace text"
    return have // PARSED_BYTES_PER_TEXT_BYTE, (
        f"parsed, about {PARSED_BYTES_PER_TEXT_BYTE} bytes a byte of text, it would not fit in the {size(have)} of "
        "memory available")


def log_uniform_mean(low: int, high: int) -> float:
    """The mean of exp(uniform(log low, log high)), the generator's lengths."""
    return float(low) if low == high else (high - low) / math.log(high / low)


def check_generated_memory(num_requests: int, num_tenants: int, system_tokens: tuple[int, int],
                           question_tokens: tuple[int, int], output_tokens: tuple[int, int]) -> None:
    """Refuse, before drawing anything, a generated trace that would not fit in the memory left:
    each tenant's system prompt and worked examples (three of up to 400 tokens), and each request's
    question and answer (its earlier turns are shared parts), at their mean lengths."""
    tokens = (num_tenants * (log_uniform_mean(*system_tokens) + 3 * 400)
              + num_requests * (log_uniform_mean(*question_tokens) + log_uniform_mean(*output_tokens)))
    need, have = tokens * GENERATED_BYTES_PER_TOKEN, fewest_available_bytes()
    if have is not None and need > have:
        raise MemoryError(f"a generated trace of {num_requests:,} requests over {num_tenants:,} tenants would take "
                          f"about {size(need)} ({tokens:,.0f} tokens) but {size(have)} are available: generate fewer "
                          "requests or tenants.")
