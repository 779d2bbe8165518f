"""Chunked prefill and inter-token latency: `python -m kvlearn.bench.chunked [--long 1500] [--json]`.

Sixteen short chats are decoding when one long prompt (a document of `--long` tokens) arrives.
Three engines serve the same requests, step by step, and the time of every generated token is
recorded:

- no chunks, budget 2048: the long prompt joins the next step whole, and every chat waits for
  that one long step (the inter-token latency spike chunked prefill exists to remove);
- no chunks, budget 256: the prompt does not fit the budget, so it waits until the chats finish
  and then runs alone (the chats are spared, the long request's first token is late);
- chunks, budget 256: the prompt is computed 256 tokens at a time, each chunk beside the chats'
  decodes.

Inter-token latency (ITL) is the gap between two consecutive tokens of one chat; TTFT is the time
from the long prompt's arrival to its first token. All three runs must produce the same tokens.
Timings depend on the machine and its load; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

RUNS = (("no chunks, budget 2048", False, 2048), ("no chunks, budget 256", False, 256),
        ("chunked, budget 256", True, 256))


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    """A long document as token ids: the course's workload prompts one after another, cut to size."""
    from kvlearn.serving.workloads import make_workload

    ids: list[int] = []
    while len(ids) < num_tokens:
        for prompt in make_workload("few_shot", tokenizer).prompts:
            ids.extend(prompt)
    return ids[:num_tokens]


def serve(engine, chats, document, arrive_at_step: int, max_new_tokens: int):
    """Run the chats, add `document` after `arrive_at_step` steps; return per-request token times
    (seconds since the start), the document's arrival time and every request's output ids."""
    start = time.perf_counter()
    requests = [engine.add_request(p, max_new_tokens=max_new_tokens) for p in chats]
    times = {r.rid: [] for r in requests}
    doc = arrival = None
    step = 0
    while engine.has_unfinished() or doc is None:
        if step == arrive_at_step:
            doc, arrival = engine.add_request(document, max_new_tokens=max_new_tokens), time.perf_counter() - start
            requests.append(doc)
            times[doc.rid] = []
        engine.step()
        step += 1
        now = time.perf_counter() - start
        for r in requests:
            times[r.rid].extend([now] * (len(r.output_ids) - len(times[r.rid])))
    return times, arrival, doc.rid, [r.output_ids for r in requests]


def percentile(values, q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q))


def measure(model, tokenizer, long_tokens: int = 1500, num_chats: int = 16, max_new_tokens: int = 32,
            arrive_at_step: int = 4, fast: bool = True) -> dict:
    """One row per run in RUNS: ITL p50/p99/max of the chats, TTFT of the long prompt, wall time."""
    from kvlearn.serving.engine import Engine
    from kvlearn.serving.workloads import make_workload

    chats = make_workload("no_sharing", tokenizer, num_requests=num_chats).prompt_lists()
    document = long_prompt(tokenizer, long_tokens)
    rows, outputs = [], []
    for label, chunked, budget in RUNS:
        engine = Engine(model, tokenizer, cache="radix", num_slots=8192, max_batch_tokens=budget,
                        chunked_prefill=chunked, fast=fast)
        times, arrival, doc_rid, out = serve(engine, chats, document, arrive_at_step, max_new_tokens)
        gaps = [b - a for rid, t in times.items() if rid != doc_rid for a, b in itertools.pairwise(t)]
        rows.append({"run": label, "chunked_prefill": chunked, "max_batch_tokens": budget,
                     "itl_p50_ms": round(percentile(gaps, 0.5) * 1e3, 1),
                     "itl_p99_ms": round(percentile(gaps, 0.99) * 1e3, 1),
                     "itl_max_ms": round(max(gaps) * 1e3, 1),
                     "long_ttft_s": round(times[doc_rid][0] - arrival, 3),
                     "wall_s": round(max(t[-1] for t in times.values()), 3), "steps": engine.stats["steps"]})
        outputs.append(out)
    same = all(o == outputs[0] for o in outputs)
    return {"long_prompt_tokens": long_tokens, "chats": num_chats, "max_new_tokens": max_new_tokens,
            "fast": fast, "same_tokens": same, "runs": rows}


def describe(result: dict) -> str:
    lines = [f"{result['chats']} short chats decoding, one {result['long_prompt_tokens']}-token prompt "
             f"arriving; {result['max_new_tokens']} greedy tokens each; radix cache",
             f"{'run':24}{'ITL p50 ms':>11}{'p99 ms':>9}{'max ms':>9}{'long TTFT s':>13}{'wall s':>8}{'steps':>7}"]
    for r in result["runs"]:
        lines.append(f"{r['run']:24}{r['itl_p50_ms']:>11.1f}{r['itl_p99_ms']:>9.1f}{r['itl_max_ms']:>9.1f}"
                     f"{r['long_ttft_s']:>13.3f}{r['wall_s']:>8.2f}{r['steps']:>7}")
    lines.append("same tokens in every run" if result["same_tokens"] else "TOKENS DIFFER between runs")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=1500, help="tokens of the long prompt")
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--plain", action="store_true", help="the chapters' plain path instead of the fast one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from kvlearn.model import load_model

    model, tokenizer = load_model()
    result = measure(model, tokenizer, args.long, args.chats, args.max_new_tokens, fast=not args.plain)
    print(json.dumps(result) if args.json else describe(result))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
