"""`python -m kvlearn route`: simulate a trace on a fleet of replicas behind a routing policy.

    python -m kvlearn route --trace FILE.jsonl --replicas 8 --policy cache_aware
    python -m kvlearn route --generate 20000 --tenants 64 --replicas 16 --policy all --json
    python -m kvlearn route --calibrate --time-model my_machine.json
    python -m kvlearn route --trace conversation --replicas 10 --slots-per-replica 2999808 --page-size 512 \
        --max-batch-tokens 16384 --speedup 20 --policy all --pool-tokens 29998080 --json   # Figure 10

`--trace` reads a JSON Lines trace (see kvlearn.routing.traces; a Mooncake trace too, see
kvlearn.routing.mooncake); `--generate N` makes a seeded
multi-tenant one instead (`--save-trace` writes it out). `--policy all` runs every policy on the
same trace. The table (or, with --json, one JSON object per policy and line) reports the hit rate,
load imbalance (busiest replica's busy time over the mean), TTFT percentiles and throughput, all in
the simulated time of the time model (`--time-model`, default: the one committed with kvlearn;
`--speedup K` divides its compute costs by K, a what-if for replicas faster than the measured ones).
`--pool-tokens N` adds, after the local runs, a run of the same fleet with one shared prefix pool of
N tokens below every replica's cache (`kvlearn.routing.pooled`: Mooncake Store's idea), with
`--pool-policy` routing it. `--trace` also takes a bundled Mooncake trace's name (conversation, synthetic).
The page size of the replicas' pools is `--page-size` if given, else a Mooncake trace's block size
(`--block-size`, 512 by default: one hash id per block, so a page is a block and the radix trees hold
a node per block, not per token), else the cache mode's default; with the block size, a slot count
that is not whole pages is rounded down to whole pages. The output says which page size ran and why
(`--json`: `page_size`, `page_size_from`, `slots_per_replica`).
Before building the fleet, it estimates the memory the fleet takes (each replica's pool and request
table, and the trace's requests should they all queue at once: `kvlearn.routing.budget`) and
refuses, saying what to change, a fleet that does not fit in what is available; traces are read
within bounds (`kvlearn.routing.jsonlines`). Every error is one line `route: error: why`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from pathlib import Path

from kvlearn.errors import KVCapacityError, check_int, check_positive_int
from kvlearn.routing.budget import check_fleet_memory
from kvlearn.routing.mooncake import BLOCK_SIZE
from kvlearn.routing.policies import POLICIES, make_policy
from kvlearn.serving.cache_modes import default_page_size

# (field, header, width, format) of the table's columns; the first is left-aligned
COLUMNS = (("policy", "policy", 19, ""), ("hit_rate", "hit rate", 9, ".1%"),
           ("computed_prefill_tokens", "computed", 12, ","), ("load_imbalance", "imbalance", 10, ".2f"),
           ("ttft_p50_s", "TTFT p50 s", 11, ".3f"), ("ttft_p99_s", "TTFT p99 s", 11, ".3f"),
           ("throughput_tok_s", "tok/s", 9, ",.0f"), ("sim_wall_s", "wall s", 7, ".1f"))


def _line(cells) -> str:
    return " ".join(f"{cell:{'<' if i == 0 else '>'}{width}{fmt}}" for i, (cell, width, fmt) in enumerate(cells))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvlearn route",
                                description="Simulate a trace on a fleet of engine replicas behind a routing policy.")
    source = p.add_argument_group("trace (one of)")
    source.add_argument("--trace", metavar="FILE.jsonl", help="JSON Lines trace: id, arrival, prompt_ids or prompt, "
                                                              "max_new_tokens, optional session; or a Mooncake trace "
                                                              "(a file, or a bundled one: conversation, synthetic)")
    source.add_argument("--generate", type=int, metavar="N", help="a seeded multi-tenant trace of N requests")
    source.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per hash id of a Mooncake trace "
                                                                           "(lines with hash_ids, gzipped or not); "
                                                                           "also its default page size")
    gen = p.add_argument_group("generated trace")
    gen.add_argument("--tenants", type=int, default=32, help="tenants (apps with their own system prompt)")
    gen.add_argument("--rate", type=float, default=20.0, help="requests per second on average")
    gen.add_argument("--hot-tenant", type=float, default=0.0, metavar="SHARE",
                     help="extra share of sessions sent to tenant 0")
    gen.add_argument("--burstiness", type=float, default=1.0,
                     help="coefficient of variation of inter-arrivals (1 = Poisson)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--save-trace", metavar="FILE.jsonl", help="write the generated trace there")
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--replicas", type=int, default=4, help="engine replicas behind the router")
    fleet.add_argument("--policy", default="cache_aware", choices=POLICIES + ("all",))
    fleet.add_argument("--slots-per-replica", type=int, default=16384, help="KV slots (tokens) of each replica's pool")
    fleet.add_argument("--cache", default="radix", choices=("radix", "blocks"))
    fleet.add_argument("--page-size", type=int, help="tokens per page of each pool (default: a Mooncake trace's "
                                                     "block size, else 1 for radix, 16 for blocks)")
    fleet.add_argument("--max-batch-tokens", type=int, default=2048)
    fleet.add_argument("--time-model", metavar="FILE.json", help="a time model from --calibrate (default: kvlearn's)")
    fleet.add_argument("--speedup", type=float, default=1.0, metavar="K",
                       help="what-if: replicas K times faster at computing than the time model says (loads unchanged)")
    pooled = p.add_argument_group("pooled cache (Mooncake Store, LMCache)")
    pooled.add_argument("--pool-tokens", type=int, default=0, metavar="N",
                        help="also run the fleet with one shared prefix pool of N tokens that every replica loads "
                             "from (e.g. replicas x slots per replica); 0: local caches only")
    pooled.add_argument("--pool-policy", default="least_load", choices=POLICIES,
                        help="the routing policy of the pooled run (default least_load)")
    knobs = p.add_argument_group("cache_aware / exact knobs")
    knobs.add_argument("--cache-threshold", type=float)
    knobs.add_argument("--balance-abs-threshold", type=float)
    knobs.add_argument("--balance-rel-threshold", type=float)
    knobs.add_argument("--max-tree-pages", type=int, help="cache_aware: pages per replica's approximate tree")
    p.add_argument_group("prefix_hash knob").add_argument(
        "--load-factor", type=_load_factor, help="move a request off its ring replica when that one has more than "
                                                "this times the average requests in flight (default 1.25; inf: never)")
    p.add_argument("--json", action="store_true", help="one JSON object per policy, one per line")
    p.add_argument("--calibrate", action="store_true", help="time the real model and write a time model (to "
                                                            "--time-model, default time_model.json)")
    return p


def _load_factor(text: str) -> float:
    """`--load-factor`: a number > 0; inf for an unbounded prefix_hash."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (inf: unbounded), got {text!r}")
    return value


def _policy_options(args, policy: str) -> dict:
    if policy == "prefix_hash":
        return {} if args.load_factor is None else {"load_factor": args.load_factor}
    if policy not in ("cache_aware", "exact"):
        return {}
    options = {name: getattr(args, name)
               for name in ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
               if getattr(args, name) is not None}
    if policy == "cache_aware" and args.max_tree_pages is not None:
        options["max_tree_pages"] = args.max_tree_pages
    return options


def _trace(args) -> tuple[list, int | None]:
    """The trace, and its block size if it has one (a Mooncake trace's tokens per hash id), else None."""
    from kvlearn.routing.traces import check_trace_path, multi_tenant_trace, read_trace, write_trace

    if (args.trace is None) == (args.generate is None):
        raise ValueError("Give exactly one of --trace FILE.jsonl and --generate N.")
    if args.trace is not None:
        from kvlearn.routing.mooncake import BUNDLED, is_mooncake, mooncake_trace_path

        if args.save_trace:
            raise ValueError("--save-trace writes a generated trace: use it with --generate N, not --trace.")
        path = (mooncake_trace_path(args.trace) if args.trace in BUNDLED and not Path(args.trace).exists()
                else args.trace)
        trace = read_trace(path, block_size=args.block_size)
        return trace, (args.block_size if is_mooncake(path) else None)
    if args.save_trace:
        check_trace_path(args.save_trace)   # before generating, not after
    trace = multi_tenant_trace(args.generate, num_tenants=args.tenants, rate=args.rate,
                               hot_tenant_share=args.hot_tenant, burstiness=args.burstiness, seed=args.seed)
    if args.save_trace:
        write_trace(trace, args.save_trace)
    return trace, None


def _pages(args, block_size: int | None) -> tuple[int, str, int]:
    """(page size, why, slots per replica): `--page-size` if given, else the trace's block size
    (the slots then rounded down to whole pages), else the cache mode's default."""
    if args.page_size is not None:
        return args.page_size, "--page-size", args.slots_per_replica
    if block_size is None:
        return default_page_size(args.cache), f"the {args.cache} cache's default", args.slots_per_replica
    slots = args.slots_per_replica // block_size * block_size
    if not slots:
        raise ValueError(f"--slots-per-replica {args.slots_per_replica} holds no page of {block_size} tokens (the "
                         f"trace's block size): give at least {block_size}, or a smaller --page-size.")
    return block_size, "the trace's block size", slots


def _run(args) -> int:
    from kvlearn.routing.fleet import simulate_fleet
    from kvlearn.routing.timemodel import TimeModel, calibrate, default_time_model

    if args.calibrate:
        model = calibrate(progress=lambda line: print(line, file=sys.stderr))
        path = model.save(args.time_model or "time_model.json")
        print(f"{model}\nwritten to {path}; use it with --time-model {path}")
        return 0
    check_positive_int("--replicas", args.replicas, " (replicas in the fleet)")
    check_positive_int("--slots-per-replica", args.slots_per_replica, " (KV slots per replica)")
    if args.page_size is not None:
        check_positive_int("--page-size", args.page_size, " (tokens per page)")
    check_int("--pool-tokens", args.pool_tokens, what=" (tokens of the shared pool; 0: none)")
    if not args.speedup > 0 or math.isinf(args.speedup):
        raise ValueError(f"--speedup must be a number > 0, got {args.speedup}.")
    time_model = (TimeModel.load(args.time_model) if args.time_model else default_time_model()).faster(args.speedup)
    runs = [(name, 0) for name in (POLICIES if args.policy == "all" else (args.policy,))]
    if args.pool_tokens:
        runs.append((args.pool_policy, args.pool_tokens))
    for name, _ in runs:   # every policy's options checked before anything runs (on a policy of one replica)
        make_policy(name, 1, **_policy_options(args, name))
    trace, block_size = _trace(args)
    page_size, page_size_from, slots = _pages(args, block_size)
    rows = inspect.signature(simulate_fleet).parameters["max_requests"].default  # each replica's, by default
    check_fleet_memory(args.replicas, slots, page_size, rows, trace)
    if not args.json:
        rounded = f", {args.slots_per_replica:,} rounded down to whole pages" if slots != args.slots_per_replica else ""
        print(f"{len(trace):,} requests, {sum(r.num_prompt_tokens for r in trace):,} prompt tokens, "
              f"{args.replicas} replicas x {slots:,} slots ({args.cache}, pages of {page_size}: {page_size_from}"
              f"{rounded})" + (f", then one pool of {args.pool_tokens:,} tokens" if args.pool_tokens else ""))
        print(_line((header, width, "") for _, header, width, _ in COLUMNS))
    for name, pool_tokens in runs:
        result = simulate_fleet(trace, name, args.replicas, cache=args.cache, slots_per_replica=slots,
                                page_size=page_size, time_model=time_model, max_batch_tokens=args.max_batch_tokens,
                                progress=not args.json and len(trace) >= 5000, pool_tokens=pool_tokens,
                                **_policy_options(args, name))
        row = result.summary()
        if args.json:
            row.update(page_size=page_size, page_size_from=page_size_from, slots_per_replica=slots)
            print(json.dumps(row), flush=True)
        else:
            row["policy"] += " + pool" if pool_tokens else ""
            print(_line((row[key], width, fmt) for key, _, width, fmt in COLUMNS), flush=True)
    return 0


USER_ERRORS = (ValueError, TypeError, OSError, KVCapacityError, MemoryError)   # what a command reports in a line


def error_line(e: BaseException) -> str:
    """The message a command prints for one of USER_ERRORS: never empty (Python's own MemoryError
    has no message)."""
    if str(e):
        return str(e)
    if isinstance(e, MemoryError):
        return ("out of memory reading or simulating the trace: use a shorter trace, fewer --replicas or a smaller "
                "--slots-per-replica.")
    return f"{type(e).__name__} without a message: please report it with the command that raised it."


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except USER_ERRORS as e:
        print(f"route: error: {error_line(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # torch's allocator, should the estimate have missed: no raw traceback
        if "can't allocate memory" not in str(e):
            raise
        print("route: error: out of memory building or running the fleet: use fewer --replicas or a smaller "
              "--slots-per-replica.", file=sys.stderr)
        return 2
