"""Benchmarks: kvlearn's three cache modes next to Hugging Face, on one workload, in one process.

`python -m kvlearn bench` runs, on the same model object and the same prompts:

- kvlearn `Engine` with cache "radix", "blocks" and "none";
- Hugging Face `generate`, one request at a time (what a script would do);
- Hugging Face continuous batching (`generate_batch`, paged attention, prefix sharing on), the
  peer a user would otherwise pick;
- optionally vLLM's CPU build, in another Python given by `--vllm-python` (never a dependency).

It prints a table (output tokens/s, computed prefill tokens and their ratio to the workload's
unique-token floor, hit rate, peak KV slots), checks that every system produced the same greedy
tokens, checks the course's bars, and writes the table as JSON and a plot to figures/.
`simulate` runs the scheduler alone (no model) to count what each cache mode would compute.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlearn.plots import FIGURES, save_figure
from kvlearn.workloads import WORKLOADS, Workload, make_workload

KVLEARN_SYSTEMS = ("radix", "blocks", "none")
HF_SYSTEMS = ("hf", "hf-cb")
LABELS = {"radix": "kvlearn radix", "blocks": "kvlearn blocks", "none": "kvlearn no cache",
          "hf": "HF generate (1 at a time)", "hf-cb": "HF continuous batching", "vllm": "vLLM CPU"}
# The bars of the course (issue 6), as ratios measured in one run on the same machine.
BARS = (("radix tok/s vs HF generate", "radix", "hf", 5.0),
        ("radix tok/s vs HF continuous batching", "radix", "hf-cb", 2.0))
FLOOR_BAR = 1.02  # radix computed prefill tokens <= 1.02 x the unique-token floor
# Hugging Face continuous batching settings that make it share prefixes on CPU (DESIGN.md).
HF_CB_SETTINGS = dict(page_size=16, num_blocks=512, max_batch_tokens=512)


@dataclass
class SystemResult:
    """One system's run: its greedy tokens per prompt and what it cost."""

    system: str
    outputs: list[list[int]]
    wall_time_s: float
    computed_prefill_tokens: int | None = None   # None: the system does not say
    hit_rate: float | None = None
    peak_slots: int | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_time_s if self.wall_time_s > 0 else float("inf")


# --- the systems ----------------------------------------------------------------------------------

def default_num_slots(prompts, max_new_tokens: int, page_size: int = 16) -> int:
    """A pool that holds every prompt and its output in whole pages without any sharing: nobody
    is short of memory."""
    return sum(-(-(len(p) + max_new_tokens) // page_size) for p in prompts) * page_size


def run_kvlearn(model, tokenizer, workload: Workload, cache: str, max_new_tokens: int,
                num_slots: int | None = None, schedule: str = "fcfs", progress: bool = False) -> SystemResult:
    """The kvlearn engine; the time includes building the engine (its KV pool)."""
    from kvlearn.engine import Engine

    num_slots = num_slots or default_num_slots(workload.prompts, max_new_tokens)
    start = time.perf_counter()
    engine = Engine(model, tokenizer, cache=cache, num_slots=num_slots, schedule=schedule)
    outputs = engine.generate(workload.prompt_lists(), max_new_tokens=max_new_tokens, progress=progress)
    wall = time.perf_counter() - start
    s = engine.stats
    return SystemResult(cache, [o.token_ids for o in outputs], wall, s["computed_prefill_tokens"],
                        s["hit_rate"], s["peak_slots"])


def run_hf_generate(model, workload: Workload, max_new_tokens: int, progress: bool = False) -> SystemResult:
    """Plain `model.generate`, one prompt after the other: every prompt is prefilled in full."""
    from tqdm.auto import tqdm

    outputs = []
    start = time.perf_counter()
    for prompt in tqdm(workload.prompts, desc="HF generate", unit="req", disable=not progress):
        ids = torch.tensor([prompt], device=model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    wall = time.perf_counter() - start
    peak = max(len(p) + len(o) - 1 for p, o in zip(workload.prompts, outputs))  # one DynamicCache at a time
    return SystemResult("hf", outputs, wall, workload.num_prompt_tokens, 0.0, peak)


@contextmanager
def _counting_hf_prefix_hits():
    """Count the prompt tokens Hugging Face's paged cache found already cached, by wrapping its
    prefix lookup for the duration of the run (restored afterwards). Yields a one-item list."""
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        original = PagedAttentionCache.search_prefix_match
    except (ImportError, AttributeError):  # another transformers version: the count is unknown
        yield [None]
        return
    hits = [0]

    def counted(self, request_id, prompt_ids):
        matched = original(self, request_id, prompt_ids)
        hits[0] += matched
        return matched

    PagedAttentionCache.search_prefix_match = counted
    try:
        yield hits
    finally:
        PagedAttentionCache.search_prefix_match = original


def run_hf_continuous_batching(model, workload: Workload, max_new_tokens: int,
                               progress: bool = False) -> SystemResult:
    """`model.generate_batch` with paged attention and prefix sharing on (see HF_CB_SETTINGS)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = model.generation_config.eos_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    cb_config = ContinuousBatchingConfig(allow_block_sharing=True, **HF_CB_SETTINGS)
    with _counting_hf_prefix_hits() as hits:
        start = time.perf_counter()
        result = model.generate_batch(inputs=workload.prompt_lists(), generation_config=config,
                                      continuous_batching_config=cb_config, progress_bar=progress)
        wall = time.perf_counter() - start
    # Request ids are "req_<index in inputs>".
    by_index = {int(rid.rsplit("_", 1)[1]): out for rid, out in result.items()}
    outputs = [list(by_index[i].generated_tokens) for i in range(workload.num_requests)]
    computed = None if hits[0] is None else workload.num_prompt_tokens - hits[0]
    hit_rate = None if hits[0] is None else round(hits[0] / workload.num_prompt_tokens, 4)
    return SystemResult("hf-cb", outputs, wall, computed, hit_rate, None)


_VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
job = json.load(sys.stdin)
llm = LLM(model=job["model"], dtype="float32", enable_prefix_caching=True)
params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - start
print("KVLEARN_RESULT " + json.dumps({"wall": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run_vllm(python: str, workload: Workload, max_new_tokens: int) -> SystemResult:
    """vLLM (CPU build, prefix caching on) in a separate Python: vLLM pins its own transformers.
    It loads kvlearn's converted copy of the model; the time excludes vLLM's start-up."""
    from kvlearn.model import cache_dir

    job = json.dumps({"model": str(cache_dir()), "prompts": workload.prompt_lists(),
                      "max_new_tokens": max_new_tokens})
    done = subprocess.run([python, "-c", _VLLM_SCRIPT], input=job, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVLEARN_RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM run with {python} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(lines[-1].split(" ", 1)[1])
    return SystemResult("vllm", result["outputs"], result["wall"])


def simulate(workload, cache: str, max_new_tokens: int = 32, num_slots: int | None = None,
             page_size: int | None = None, schedule: str = "fcfs") -> dict:
    """Run the scheduler on a workload's prompts (a Workload or a list of token-id lists) without
    the model, and return its stats.

    The scheduler's decisions depend on token ids and pool size, not on the numbers in K and V,
    so the prefill counts, hit rate and peak slots are those of a real run, except where real
    outputs would have been shared: here every request generates the same filler token, and
    none stops early.
    """
    from kvlearn.engine import DEFAULT_BLOCK_SIZE
    from kvlearn.errors import KVCapacityError, check_positive_int
    from kvlearn.kv_manager import make_kv_manager
    from kvlearn.pool import KVPool
    from kvlearn.scheduler import Request, Scheduler

    check_positive_int("max_new_tokens", max_new_tokens)
    prompts = workload.prompt_lists() if isinstance(workload, Workload) else [list(p) for p in workload]
    if not prompts or not all(prompts):
        raise ValueError("simulate needs at least one prompt, and no empty prompt.")
    page_size = page_size or (DEFAULT_BLOCK_SIZE if cache == "blocks" else 1)
    num_slots = num_slots or default_num_slots(prompts, max_new_tokens, page_size)
    pool = KVPool(1, 1, 1, num_slots, page_size=page_size)  # slots only: one number each
    kv = make_kv_manager(cache, pool)
    scheduler = Scheduler(kv, schedule=schedule)
    for rid, prompt in enumerate(prompts):
        req = Request(rid, prompt, max_new_tokens)
        if not kv.fits(req):
            raise KVCapacityError(f"Prompt {rid} needs KV for {req.max_tokens} tokens but the pool holds "
                                  f"{kv.capacity}: use a bigger num_slots.")
        scheduler.add(req)
    filler = prompts[0][-1]  # any token id; never an end of sequence
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [filler] * len(batch))
    from kvlearn.engine import with_rates

    return with_rates(scheduler.stats, 0.0)


# --- comparing ------------------------------------------------------------------------------------

TIE_TOLERANCE = 1e-3  # logits this close are a tie that float rounding order may break either way


def warm_up(model, tokenizer) -> None:
    """One tiny run of each code path, so first-call costs (allocator, kernels) time no system."""
    from kvlearn.engine import Engine
    from kvlearn.model import chat_ids

    ids = chat_ids(tokenizer, "Hi")
    Engine(model, tokenizer, cache="radix", num_slots=256).generate([ids, ids], max_new_tokens=2)
    with torch.no_grad():
        model.generate(torch.tensor([ids], device=model.device), max_new_tokens=2, do_sample=False)


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
        for i, (want, got) in enumerate(zip(ref.outputs, r.outputs)):
            if want == got:
                continue
            k = next((j for j, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
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


def check_bars(results: list[SystemResult], workload: Workload) -> list[tuple[str, float, float, bool]]:
    """(bar, measured, target, reached) for each bar whose systems were run."""
    by = {r.system: r for r in results}
    out = []
    for name, a, b, target in BARS:
        if a in by and b in by:
            ratio = by[a].tokens_per_s / by[b].tokens_per_s
            out.append((name, round(ratio, 2), target, ratio >= target))
    if "radix" in by:
        ratio = by["radix"].computed_prefill_tokens / workload.unique_token_floor
        out.append(("radix computed prefill / unique-token floor", round(ratio, 3), FLOOR_BAR, ratio <= FLOOR_BAR))
    return out


def table(results: list[SystemResult], workload: Workload) -> str:
    """The comparison as aligned text."""
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    head = (f"{'system':<27} {'tok/s':>7} {'wall s':>7} {'prefill computed':>16} {'x floor':>7} {'hit rate':>8} "
            f"{'peak KV slots':>13}")
    lines = [f"{workload!r}", head, "-" * len(head)]
    for r in results:
        ratio = None if r.computed_prefill_tokens is None else r.computed_prefill_tokens / workload.unique_token_floor
        lines.append(f"{LABELS[r.system]:<27} {r.tokens_per_s:>7.1f} {r.wall_time_s:>7.1f} "
                     f"{fmt(r.computed_prefill_tokens, ','):>16} {fmt(ratio, '.2f'):>7} "
                     f"{fmt(r.hit_rate, '.1%'):>8} {fmt(r.peak_slots, ','):>13}")
    return "\n".join(lines)


def plot(results: list[SystemResult], workload: Workload):
    """Two panels: output tokens/s, and computed prefill tokens against the floor."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [LABELS[r.system] for r in results]
    ax1.barh(names, [r.tokens_per_s for r in results], color="#4c72b0")
    ax1.set_xlabel("output tokens / s (higher is better)")
    ax1.invert_yaxis()
    counted = [r for r in results if r.computed_prefill_tokens is not None]
    ax2.barh([LABELS[r.system] for r in counted], [r.computed_prefill_tokens for r in counted], color="#dd8452")
    ax2.axvline(workload.unique_token_floor, color="black", linestyle="--", label="unique-token floor")
    ax2.set_xlabel("prompt tokens computed (lower is better)")
    ax2.invert_yaxis()
    ax2.legend(loc="best")
    fig.suptitle(f"{workload.name}: {workload.num_requests} requests, {workload.num_prompt_tokens:,} prompt tokens")
    fig.tight_layout()
    return fig


def write_outputs(results: list[SystemResult], workload: Workload, max_new_tokens: int, out_dir: Path,
                  mismatches=(), ties=()) -> list[Path]:
    """figures/bench_<workload>.json (table, bars, tokens) and .png (the plot)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "workload": {"name": workload.name, "requests": workload.num_requests,
                     "prompt_tokens": workload.num_prompt_tokens, "unique_token_floor": workload.unique_token_floor,
                     "max_new_tokens": max_new_tokens},
        "torch_threads": torch.get_num_threads(),
        "systems": [dict(asdict(r), label=LABELS[r.system], tokens_per_s=round(r.tokens_per_s, 2),
                         output_tokens=r.output_tokens, wall_time_s=round(r.wall_time_s, 3)) for r in results],
        "bars": [dict(zip(("bar", "measured", "target", "reached"), b)) for b in check_bars(results, workload)],
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


# --- command line ---------------------------------------------------------------------------------

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
    p.add_argument("--out", default=str(FIGURES), help="folder for the JSON and the plot (default figures/)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


_SIZE_ARG = {"shared_system": "num_requests", "few_shot": "num_requests", "no_sharing": "num_requests",
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
    from tqdm.auto import tqdm

    from kvlearn.model import load_model

    model, tokenizer = load_model(device=args.device)
    sizes = {} if args.requests is None else {_SIZE_ARG[args.workload]: args.requests}
    try:
        workload = make_workload(args.workload, tokenizer, **sizes)
    except ValueError as err:
        parser.error(str(err))
    print(f"{workload!r}; {args.max_new_tokens} greedy tokens each; {torch.get_num_threads()} torch threads "
          f"on {model.device}")
    runs = systems + (["vllm"] if args.vllm_python else [])
    results = []
    warm_up(model, tokenizer)
    with tqdm(total=len(runs), desc="bench", unit="system") as bar:
        for system in runs:
            bar.set_postfix_str(system)
            if system in KVLEARN_SYSTEMS:
                results.append(run_kvlearn(model, tokenizer, workload, system, args.max_new_tokens,
                                           schedule=args.schedule))
            elif system == "hf":
                results.append(run_hf_generate(model, workload, args.max_new_tokens))
            elif system == "hf-cb":
                results.append(run_hf_continuous_batching(model, workload, args.max_new_tokens))
            else:
                results.append(run_vllm(args.vllm_python, workload, args.max_new_tokens))
            bar.update()
    print("\n" + table(results, workload))
    print("\nbars (ratios measured in this run; timings vary with machine load):")
    for name, measured, target, reached in check_bars(results, workload):
        sign = "<=" if "floor" in name else ">="
        print(f"  {'reached' if reached else 'MISSED ':<8} {name}: {measured} (target {sign} {target})")
    mismatches, ties = compare_tokens(results, workload, model)
    for path in write_outputs(results, workload, args.max_new_tokens, Path(args.out), mismatches, ties):
        print(f"wrote {path}")
    if ties:
        print("\nexact ties (not errors):\n  " + "\n  ".join(ties))
    if mismatches:
        print("\nNOT the same greedy tokens:\n  " + "\n  ".join(mismatches[:10]))
        return 1
    print(f"\nall {len(results)} systems produced the same greedy tokens for all {workload.num_requests} prompts"
          + (" (up to the exact ties above)" if ties else ""))
    return 0
