"""`python -m kvlearn bench`: every cache strategy and its peers on one workload, side by side.

It runs each system of `kvlearn.bench.peers` on the same model object and prompts, prints a table
(output tokens/s, computed prefill tokens against the workload's unique-token floor, hit rate, peak
KV slots), checks that every system produced the same greedy tokens and whether the course's bars
were reached, and writes the table as JSON and a plot (`kvlearn.bench.report`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvlearn.bench.decode import describe_efficiency, step_efficiency
from kvlearn.bench.demo import device_arg
from kvlearn.bench.peers import (
    HF_SYSTEMS,
    KVLEARN_SYSTEMS,
    run_hf_continuous_batching,
    run_hf_generate,
    run_kvlearn,
    run_vllm,
    warm_up,
)
from kvlearn.bench.report import check_bars, compare_tokens, table, write_outputs
from kvlearn.serving.workloads import WORKLOADS, make_workload
from kvlearn.viz.plots import figures_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvlearn bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="shared_system", choices=sorted(WORKLOADS))
    p.add_argument("--requests", type=int, default=None,
                   help="requests (or conversations / branches, by workload); default: the workload's own")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--systems", default=",".join(KVLEARN_SYSTEMS + HF_SYSTEMS),
                   help="comma-separated, from: " + ", ".join(KVLEARN_SYSTEMS + HF_SYSTEMS))
    p.add_argument("--schedule", default="fcfs", choices=("fcfs", "lpm"))
    p.add_argument("--vllm-python", default=None, help="a Python with vLLM's CPU build, to add vLLM as a peer")
    p.add_argument("--out", default=None, help="folder for the JSON and the plot (default: the nearest figures/)")
    p.add_argument("--device", default=None, type=device_arg, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--plain", action="store_true",
                   help="run kvlearn on the plain path the chapters teach, not its packed-weights fast path")
    return p


_SIZE_ARG = {"shared_system": "num_requests", "short_system": "num_requests", "few_shot": "num_requests",
             "no_sharing": "num_requests",
             "multi_turn": "num_conversations", "branching": "num_branches"}


def main(argv: list[str]) -> int:
    """`python -m kvlearn bench [options]`; exit status 0 when every system gave the same tokens."""
    parser = _parser()
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(KVLEARN_SYSTEMS + HF_SYSTEMS))
    if unknown or not systems:
        parser.error(f"unknown system(s) {unknown}: choose from {', '.join(KVLEARN_SYSTEMS + HF_SYSTEMS)}")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    import matplotlib

    matplotlib.use("Agg")
    from kvlearn.model import load_model
    from kvlearn.progress import progress_bar

    model, tokenizer = load_model(device=args.device)
    sizes = {} if args.requests is None else {_SIZE_ARG[args.workload]: args.requests}
    try:
        workload = make_workload(args.workload, tokenizer, **sizes)
    except ValueError as err:
        parser.error(str(err))
    print(f"{workload!r}; {args.max_new_tokens} greedy tokens each; {torch.get_num_threads()} torch threads "
          f"on {model.device}; the engine's defaults (a request that shares a prefix with one admitted in "
          f"the same step waits a step)")
    runs = systems + (["vllm"] if args.vllm_python else [])
    results = []
    warm_up(model, tokenizer, fast=not args.plain)
    with progress_bar(total=len(runs), desc="bench", unit="system") as bar:
        for system in runs:
            bar.set_postfix_str(system)
            if system in KVLEARN_SYSTEMS:
                results.append(run_kvlearn(model, tokenizer, workload, system, args.max_new_tokens,
                                           schedule=args.schedule, fast=not args.plain)[0])
            elif system == "hf":
                results.append(run_hf_generate(model, workload, args.max_new_tokens))
            elif system == "hf-cb":
                results.append(run_hf_continuous_batching(model, workload, args.max_new_tokens))
            else:
                results.append(run_vllm(args.vllm_python, workload, args.max_new_tokens))
            bar.update()
    # One decode step of the workload's first 16 prompts on the runner's fast path, against a plain
    # read of as many bytes as the weights.
    decode_step = step_efficiency(model, workload.prompt_lists()[:16], fast=not args.plain)
    print("\n" + table(results, workload))
    print(describe_efficiency(decode_step))
    print("\nbars (ratios measured in this run; timings vary with machine load):")
    for name, measured, target, reached in check_bars(results, workload, decode_step):
        sign = "<=" if "floor" in name else ">="
        print(f"  {'reached' if reached else 'MISSED ':<8} {name}: {measured} (target {sign} {target})")
    mismatches, ties = compare_tokens(results, workload, model)
    for path in write_outputs(results, workload, args.max_new_tokens, Path(args.out) if args.out else figures_dir(),
                              mismatches, ties, decode_step):
        print(f"wrote {path}")
    if ties:
        print("\nexact ties (not errors):\n  " + "\n  ".join(ties))
    if mismatches:
        print("\nNOT the same greedy tokens:\n  " + "\n  ".join(mismatches[:10]))
        return 1
    print(f"\nall {len(results)} systems produced the same greedy tokens for all {workload.num_requests} prompts"
          + (" (up to the exact ties above)" if ties else ""))
    return 0
