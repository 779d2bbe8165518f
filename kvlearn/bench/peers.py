"""Benchmark peers: each system the bench compares, run on one workload, as a `SystemResult`.

- kvlearn's `Engine` with cache "radix", "blocks" and "none";
- Hugging Face `generate`, one request at a time (what a script would do);
- Hugging Face continuous batching (`generate_batch`, paged attention, prefix sharing on), the
  peer a user would otherwise pick;
- optionally vLLM's CPU build, in another Python (never a dependency of kvlearn).

Every runner borrows the model and leaves it as it found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvlearn.serving.workloads import Workload

KVLEARN_SYSTEMS = ("radix", "blocks", "none")
HF_SYSTEMS = ("hf", "hf-cb")
LABELS = {"radix": "kvlearn radix", "blocks": "kvlearn blocks", "none": "kvlearn no cache",
          "hf": "HF generate (1 at a time)", "hf-cb": "HF continuous batching", "vllm": "vLLM CPU"}
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
    label: str | None = None                     # the row's name; None: LABELS[system]

    @property
    def name(self) -> str:
        """The row's name in tables and plots."""
        return self.label or LABELS[self.system]

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_time_s if self.wall_time_s > 0 else float("inf")


# --- the systems ----------------------------------------------------------------------------------

def run_kvlearn(model, tokenizer, workload: Workload, cache: str, max_new_tokens: int,
                num_slots: int | None = None, schedule: str = "fcfs", progress: bool = False, fast: bool = False):
    """The kvlearn engine (`fast`: its packed-weights path). The time is serving only: building the
    engine (its KV pool, the packed weights) comes before it, as vLLM's start-up comes before its
    timed `generate`. Returns the result and the engine (for its cache and stats)."""
    from kvlearn.serving.engine import Engine, slots_without_sharing

    num_slots = num_slots or slots_without_sharing(workload.prompts, max_new_tokens)
    engine = Engine(model, tokenizer, cache=cache, num_slots=num_slots, schedule=schedule, fast=fast)
    return run_engine(engine, workload, max_new_tokens, cache, progress), engine


def run_engine(engine, workload: Workload, max_new_tokens: int, system: str, progress: bool = False,
               label: str | None = None) -> SystemResult:
    """Serve the workload on an engine already built (its parts, its pool) and time the serving only;
    `system` is its cache mode (a key of LABELS), `label` the row's name when not LABELS[system]
    (chapter 9 names the learner's parts that served)."""
    start = time.perf_counter()
    outputs = engine.generate(workload.prompt_lists(), max_new_tokens=max_new_tokens, progress=progress)
    wall = time.perf_counter() - start
    s = engine.stats
    return SystemResult(system, [o.token_ids for o in outputs], wall, s["computed_prefill_tokens"],
                        s["hit_rate"], s["peak_slots"], label)


def run_hf_generate(model, workload: Workload, max_new_tokens: int, progress: bool = False) -> SystemResult:
    """Plain `model.generate`, one prompt after the other: every prompt is prefilled in full."""
    from kvlearn.progress import progress_bar

    outputs = []
    start = time.perf_counter()
    for prompt in progress_bar(workload.prompts, desc="HF generate", unit="req", disable=not progress):
        ids = torch.tensor([prompt], device=model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    wall = time.perf_counter() - start
    # one DynamicCache at a time
    peak = max(len(p) + len(o) - 1 for p, o in zip(workload.prompts, outputs, strict=True))
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
llm = LLM(model=job["model"], dtype="float32", enable_prefix_caching=True, block_size=job["block_size"])
params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
llm.generate([TokensPrompt(prompt_token_ids=[7] * 8)], SamplingParams(temperature=0.0, max_tokens=2),
             use_tqdm=False)  # warm-up, as kvlearn and Hugging Face get one
prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - start
print("KVLEARN_RESULT " + json.dumps({"wall": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs]}))
"""
# vLLM's CPU backend: pages of a multiple of 32 tokens, its KV cache sized in GiB.
VLLM_BLOCK_SIZE = 32
VLLM_KV_CACHE_GIB = 2


def vllm_environment(threads: int) -> dict[str, str]:
    """What vLLM's CPU build needs to compute on the same `threads` cores as torch here: by default
    it reserves a core and binds its workers to one."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}


def run_vllm(python: str, workload: Workload, max_new_tokens: int) -> SystemResult:
    """vLLM (CPU build, prefix caching on) in a separate Python: vLLM pins its own torch and
    transformers. It loads kvlearn's converted copy of the model and computes on as many cores as
    torch does here; the time excludes vLLM's start-up (about 80 s) and a warm-up request."""
    from kvlearn.model import cache_dir

    job = json.dumps({"model": str(cache_dir()), "prompts": workload.prompt_lists(),
                      "max_new_tokens": max_new_tokens, "block_size": VLLM_BLOCK_SIZE})
    done = subprocess.run([python, "-c", _VLLM_SCRIPT], input=job, capture_output=True, text=True,
                          env=vllm_environment(torch.get_num_threads()))
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVLEARN_RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM run with {python} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(lines[-1].split(" ", 1)[1])
    return SystemResult("vllm", result["outputs"], result["wall"])


def warm_up(model, tokenizer, fast: bool = False, max_batch: int = 16) -> None:
    """One tiny run of each code path, so first-call costs (allocator, kernels) time no system:
    kvlearn decodes every batch size up to `max_batch` once, because on CPU its fast path builds a
    oneDNN kernel per product and row count on first use (about 0.6 ms each, 3 ms a step), as the
    vLLM peer's time leaves out its start-up and a warm-up request."""
    from kvlearn.model import chat_ids
    from kvlearn.serving.engine import Engine, slots_without_sharing

    ids = chat_ids(tokenizer, "Hi")
    Engine(model, tokenizer, cache="radix", num_slots=256, fast=fast).generate([ids, ids], max_new_tokens=2)
    prompts = [ids] * (max_batch + 1)
    engine = Engine(model, tokenizer, cache="none", num_slots=slots_without_sharing(prompts, max_batch + 1), fast=fast)
    for n, prompt in enumerate(prompts, 1):  # one request finishes per step: decode batches max_batch, ..., 1
        engine.add_request(prompt, max_new_tokens=n)
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        model.generate(torch.tensor([ids], device=model.device), max_new_tokens=2, do_sample=False)


