"""The bench's report: are the tokens the same, were the bars reached, and the table, plot and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from kvlearn.bench.peers import SystemResult
from kvlearn.serving.workloads import Workload
from kvlearn.viz.plots import save_figure

# The bars the course sets itself, as ratios measured in one run on the same machine.
BARS = (("radix tok/s vs HF generate", "radix", "hf", 5.0),
        ("radix tok/s vs HF continuous batching", "radix", "hf-cb", 2.0),
        ("radix tok/s vs vLLM CPU", "radix", "vllm", 1.0))
# Where vLLM's own cache has nothing to share, kvlearn's radix tree cannot save work either.
VLLM_BAR_NO_SHARING = 0.8
FLOOR_BAR = 1.02  # radix computed prefill tokens <= 1.02 x the unique-token floor
EFFICIENCY_BAR = 0.5  # a decode step reads its weights at >= half the plain read bandwidth

TIE_TOLERANCE = 1e-3  # logits this close are a tie that float rounding order may break either way


def top_logits_tie(model, context: list[int], a: int, b: int) -> float | None:
    """If tokens a and b both score within TIE_TOLERANCE of the best next-token logit after
    `context` (plain Hugging Face forward), return their gap; else None."""
    with torch.no_grad():
        logits = model(torch.tensor([context], device=model.device)).logits[0, -1].float()
    best = logits.max()
    if best - logits[a] <= TIE_TOLERANCE and best - logits[b] <= TIE_TOLERANCE:
        return float(abs(logits[a] - logits[b]))
    return None


def compare_tokens(results: list[SystemResult], workload: Workload, model=None) -> tuple[list[str], list[str]]:
    """Compare every system's greedy tokens with the reference (Hugging Face `generate` when it
    ran, else the first system). Returns (mismatches, ties): a first difference where both tokens
    are top logits within TIE_TOLERANCE (checked with `model`) is a tie, not a mismatch."""
    ref = next((r for r in results if r.system == "hf"), results[0])
    mismatches, ties = [], []
    for r in results:
        for i, (want, got) in enumerate(zip(ref.outputs, r.outputs, strict=True)):
            if want == got:
                continue
            k = next((j for j, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), min(len(want), len(got)))
            where = f"{r.system} vs {ref.system}, prompt {i}, token {k}"
            gap = None
            if model is not None and k < min(len(want), len(got)):
                gap = top_logits_tie(model, list(workload.prompts[i]) + want[:k], want[k], got[k])
            if gap is None:
                mismatches.append(f"{where}: {got[k:k + 5]} instead of {want[k:k + 5]}")
            else:
                ties.append(f"{where}: tokens {want[k]} and {got[k]} tie (logit gap {gap:.1e}); "
                            "both are greedy within float rounding, the rest follows from there")
    return mismatches, ties


def check_bars(results: list[SystemResult], workload: Workload,
               decode_step: dict | None = None) -> list[tuple[str, float, float, bool]]:
    """(bar, measured, target, reached) for each bar whose systems were run, and the decode-step
    efficiency bar when `decode_step` (from `kvlearn.bench.decode.step_efficiency`) is given."""
    by = {r.system: r for r in results}
    out = []
    for name, a, b, target in BARS:
        if b == "vllm" and workload.name == "no_sharing":
            target = VLLM_BAR_NO_SHARING
        if a in by and b in by:
            ratio = by[a].tokens_per_s / by[b].tokens_per_s
            out.append((name, round(ratio, 2), target, ratio >= target))
    if "radix" in by:
        ratio = by["radix"].computed_prefill_tokens / workload.unique_token_floor
        out.append(("radix computed prefill / unique-token floor", round(ratio, 3), FLOOR_BAR, ratio <= FLOOR_BAR))
    if decode_step is not None:
        e = decode_step["efficiency"]
        out.append(("decode-step weight read / plain read bandwidth", e, EFFICIENCY_BAR, e >= EFFICIENCY_BAR))
    return out


def table(results: list[SystemResult], workload: Workload) -> str:
    """The comparison as aligned text."""
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    width = max([27, *(len(r.name) for r in results)])
    head = (f"{'system':<{width}} {'tok/s':>7} {'wall s':>7} {'prefill computed':>16} {'x floor':>7} {'hit rate':>8} "
            f"{'peak KV slots':>13}")
    lines = [f"{workload!r}", head, "-" * len(head)]
    for r in results:
        ratio = None if r.computed_prefill_tokens is None else r.computed_prefill_tokens / workload.unique_token_floor
        lines.append(f"{r.name:<{width}} {r.tokens_per_s:>7.1f} {r.wall_time_s:>7.1f} "
                     f"{fmt(r.computed_prefill_tokens, ','):>16} {fmt(ratio, '.2f'):>7} "
                     f"{fmt(r.hit_rate, '.1%'):>8} {fmt(r.peak_slots, ','):>13}")
    return "\n".join(lines)


def plot(results: list[SystemResult], workload: Workload):
    """Two panels: output tokens/s, and computed prefill tokens against the floor."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r.name for r in results]
    ax1.barh(names, [r.tokens_per_s for r in results], color="#4c72b0")
    ax1.set_xlabel("output tokens / s (higher is better)")
    ax1.invert_yaxis()
    counted = [r for r in results if r.computed_prefill_tokens is not None]
    ax2.barh([r.name for r in counted], [r.computed_prefill_tokens for r in counted], color="#dd8452")
    ax2.axvline(workload.unique_token_floor, color="black", linestyle="--", label="unique-token floor")
    ax2.set_xlabel("prompt tokens computed (lower is better)")
    ax2.invert_yaxis()
    ax2.legend(loc="best")
    fig.suptitle(f"{workload.name}: {workload.num_requests} requests, {workload.num_prompt_tokens:,} prompt tokens")
    fig.tight_layout()
    return fig


def write_outputs(results: list[SystemResult], workload: Workload, max_new_tokens: int, out_dir: Path,
                  mismatches=(), ties=(), decode_step: dict | None = None) -> list[Path]:
    """figures/bench_<workload>.json (table, bars, decode-step efficiency, tokens) and .png (the plot)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "workload": {"name": workload.name, "requests": workload.num_requests,
                     "prompt_tokens": workload.num_prompt_tokens, "unique_token_floor": workload.unique_token_floor,
                     "max_new_tokens": max_new_tokens},
        "torch_threads": torch.get_num_threads(),
        "systems": [dict(asdict(r), label=r.name, tokens_per_s=round(r.tokens_per_s, 2),
                         output_tokens=r.output_tokens, wall_time_s=round(r.wall_time_s, 3)) for r in results],
        "bars": [dict(zip(("bar", "measured", "target", "reached"), b, strict=True))
                 for b in check_bars(results, workload, decode_step)],
        "decode_step": decode_step,
        "token_mismatches": mismatches,
        "ties": ties,
    }
    json_path = out_dir / f"bench_{workload.name}.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    return [json_path, save_plot(plot(results, workload), out_dir, f"bench_{workload.name}")]


def save_plot(fig, out_dir: Path, name: str) -> Path:
    """Write the figure as out_dir/name.png and release it."""
    import matplotlib.pyplot as plt

    path = save_figure(fig, name, out_dir)
    plt.close(fig)
    return path


