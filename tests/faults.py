"""Fault injection for the engine: make one bookkeeping call raise, then check the engine is whole.

A *site* is a public method of one of the engine's parts (the pool, its allocator, the request rows,
the radix tree or block manager, the runner; with chapter 8's tiers also the tiered tree's
`load_back`, the host pool and the disk store), or a declared fault point (`kvlearn.errors.
fault_point`: the steps inside that move KV between tiers), as the pair ("fault", its name).
`inject(engine, path, name, k)` makes the k-th call of that site raise (once) before it runs, as an
error or a Ctrl-C at that call would. After the failed `generate`, the test runs the same prompts
again and expects the tokens of a fresh engine, then evicts the cache and expects (`whole`) every
slot free, every row free and nothing locked. No site is a private name.
"""

from __future__ import annotations

import errno
import os
import tempfile

import torch

from kvlearn.errors import set_fault_hook

SITES = {
    "pool": ("alloc", "free"),
    "pool.allocator": ("alloc", "free"),
    "kv.rows": ("alloc", "write", "free"),
    "kv.tree": ("match_prefix", "insert_prefix", "lock", "unlock", "evict", "evict_callback"),
    "kv.manager": ("allocate", "may_append", "hash_blocks", "deallocate", "evict_cached"),
    "runner": ("run",),
}
# Chapter 8's tiered tree (an engine with host_slots or disk_dir): what moves KV between tiers. Its
# inner steps ("tiers.backup", "tiers.persist", "disk.make_room", ...) are fault points, found by
# `count_calls` as they are reached.
TIER_SITES = {
    "kv.tree": ("load_back",),
    "kv.tree.host": ("alloc", "free"),
    "kv.tree.disk": ("get", "holds", "put", "touch"),
}
FAULT = "fault"  # the path of a site that is a fault point

# Chapter 8's disk under OS errors: a different kind of fault. The disk tier is a cache, so an OS
# error there must not fail `generate` at all: the page is dropped or the read misses (issue 25).
# Each disk operation, with the OS call behind it, fails with each errno a real folder can give.
DISK_OPERATIONS = {"write": (tempfile, "mkstemp"), "replace": (os, "replace"), "stamp": (os, "utime"),
                   "read": (os, "open"), "list": (os, "scandir"), "delete": (os, "unlink")}
DISK_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EIO)


class InjectedFault(Exception):
    """The fault a test injected."""


def tiny_model(vocab_size: int = 64):
    """A 2-layer Llama with random weights: the engine's code paths in milliseconds a step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    # float64: a random model's logits lie close together, and the cache changes the order of float
    # sums (another batch, a reused prefix); in float64 no near-tie flips a greedy token.
    return LlamaForCausalLM(config).to(torch.float64).eval()


def owner(engine, path: str):
    obj = engine
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def sites(engine) -> list[tuple[str, str]]:
    """The (object path, method) pairs this engine's cache mode has."""
    tables = [SITES] + ([TIER_SITES] if hasattr(owner(engine, "kv.tree"), "load_back") else [])
    return [(path, name) for table in tables for path, names in table.items() for name in names
            if owner(engine, path) is not None and hasattr(owner(engine, path), name)]


def count_calls(engine, run) -> dict[tuple[str, str], int]:
    """How often `run()` calls each site (the fault points it reaches included)."""
    counts = {}

    def reached(name):
        counts[FAULT, name] = counts.get((FAULT, name), 0) + 1
    set_fault_hook(reached)
    for path, name in sites(engine):
        obj, real = owner(engine, path), getattr(owner(engine, path), name)

        def counted(*args, _key=(path, name), _real=real, **kwargs):
            counts[_key] = counts.get(_key, 0) + 1
            return _real(*args, **kwargs)
        setattr(obj, name, counted)
    try:
        run()
    finally:
        restore(engine)
    return counts


def inject(engine, path: str, name: str, k: int, fault=InjectedFault) -> None:
    """Make the k-th call of `path.name` (of fault point `name` if path is FAULT) raise `fault`
    (once), before the real call runs."""
    calls = [0]
    if path == FAULT:
        def armed(reached):
            if reached == name:
                calls[0] += 1
                if calls[0] == k:
                    raise fault(f"injected at call {k} of fault point {name}")
        set_fault_hook(armed)
        return
    obj, real = owner(engine, path), getattr(owner(engine, path), name)

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            raise fault(f"injected at call {k} of {path}.{name}")
        return real(*args, **kwargs)
    setattr(obj, name, faulty)


def disk_fault(monkeypatch, folder, operation: str, error: int, k: int = 1, lasting: bool = False) -> list[int]:
    """Make the k-th call of a disk `operation` on a path inside `folder` raise OSError(`error`), as
    the OS would (with `lasting`, every call from the k-th on: a folder that stays broken). Returns
    a one-item list counting the calls that failed."""
    module, name = DISK_OPERATIONS[operation]
    real, folder, calls, failed = getattr(module, name), os.fspath(folder), [0], [0]

    def faulty(*args, **kwargs):
        path = kwargs.get("dir") if operation == "write" else (args[0] if args else None)
        if path is not None and not isinstance(path, int) and os.fspath(path).startswith(folder):
            calls[0] += 1
            if calls[0] == k or (lasting and calls[0] > k):
                failed[0] += 1
                raise OSError(error, os.strerror(error), os.fspath(path))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, faulty)
    return failed


def restore(engine) -> None:
    """Remove every injected or counting wrapper (instance attributes shadow the real methods) and
    disarm the fault points."""
    set_fault_hook(None)
    for path, name in sites(engine):
        obj = owner(engine, path)
        if name in vars(obj):
            if name == "evict_callback":  # a real attribute: the pool's free
                obj.evict_callback = engine.pool.free
            else:
                delattr(obj, name)


def whole(engine) -> list[str]:
    """What is wrong with an engine that should hold nothing (after evict_all); [] when whole."""
    problems = []
    kv, pool = engine.kv, engine.pool
    if engine.scheduler.running or engine.scheduler.waiting:
        problems.append("requests left in the queues")
    if pool.num_free != pool.num_slots:
        problems.append(f"leak: {pool.num_slots - pool.num_free} slots not free")
    if kv.rows.num_free != len(kv.rows.lengths):
        problems.append("a request row leaked")
    if kv.name == "radix":
        kv.tree.check_invariants()  # the tiered tree's include host conservation
        if kv.tree.total_size or kv.tree.root.lock_ref:
            problems.append(f"tree holds {kv.tree.total_size} tokens, root lock_ref {kv.tree.root.lock_ref}")
        host = getattr(kv.tree, "host", None)
        if host is not None and host.num_free + kv.tree.host_size != host.num_slots:
            problems.append(f"host leak: {host.num_free} free + {kv.tree.host_size} held != {host.num_slots}")
        disk = getattr(kv.tree, "disk", None)
        if disk is not None and list(disk.folder.glob(".tmp-*")):
            problems.append("a temporary disk file was left behind")
        if disk is not None and disk.max_bytes is not None and disk.used_bytes() > disk.max_bytes:
            problems.append(f"disk over capacity: {disk.used_bytes()} > {disk.max_bytes} bytes")
    if kv.name == "blocks" and (kv.manager.hash_to_block_id or kv.manager.num_free_blocks != kv.manager.num_blocks):
        problems.append("blocks still cached or in use")
    return problems
