"""The serving engine: many requests, one model, continuous batching over a prefix cache.

Each `step()` asks the scheduler for a batch (decodes of running requests plus admissions whose
cached prefix is skipped), runs it as one packed forward through the model runner, and hands the
greedy tokens back to the scheduler, which finishes, caches and frees. Whatever the cache mode
("radix", "blocks" or "none"), the tokens are the same as Hugging Face `generate` on each prompt
alone: a cache changes what is computed, never what comes out.

The engine borrows the model and leaves it as it found it.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvlearn.errors import KVCapacityError, check_choice, check_positive_int
from kvlearn.model import chat_ids, eos_token_ids
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner
from kvlearn.serving.cache_modes import CACHE_MODES, WRITE_POLICIES, default_page_size, make_kv_manager
from kvlearn.serving.kv_factories import registered_kv
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import SCHEDULES, Scheduler, StepReport

DEFAULT_NUM_SLOTS = 8192        # about 377 MB of float32 KV for SmolLM2-135M


def slots_without_sharing(prompts, max_new_tokens: int, page_size: int = 16) -> int:
    """A pool that holds every prompt and its output in whole pages without any sharing: nobody
    is short of memory."""
    return sum(-(-(len(p) + max_new_tokens) // page_size) for p in prompts) * page_size


@dataclass
class GenerationOutput:
    """One request's result: `token_ids` are the generated tokens only (EOS included if reached)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"GenerationOutput(r{self.request_id}, {len(self.token_ids)} tokens: {shown!r})"


def check_tier_options(cache: str, host_slots, disk_dir, write_policy: str, disk_max_bytes=None) -> None:
    """Refuse tier options the engine cannot honour, before anything is built (the folder itself is
    checked by the tiers' factory; the disk capacity's lower bound, one entry, depends on the model)."""
    check_choice("write_policy", write_policy, WRITE_POLICIES)
    if host_slots is not None:
        check_positive_int("host_slots", host_slots, " (tokens of KV the host tier holds)")
    if disk_max_bytes is not None:
        check_positive_int("disk_max_bytes", disk_max_bytes, " (bytes the disk tier may use)")
        if disk_dir is None:
            raise ValueError("disk_max_bytes limits the disk tier: give disk_dir too (or leave it None).")
    if (host_slots is not None or disk_dir is not None) and cache != "radix":
        raise ValueError(f"host_slots and disk_dir need cache='radix' (the tiers hang below the radix "
                         f"tree), got cache={cache!r}.")


def with_rates(counters: dict, wall_time_s: float) -> dict:
    """Scheduler counters plus hit_rate and wall time (rounded, so they print cleanly)."""
    stats = dict(counters)
    prefill = stats["cached_tokens"] + stats["computed_prefill_tokens"]
    stats["hit_rate"] = round(stats["cached_tokens"] / prefill, 4) if prefill else 0.0
    stats["wall_time_s"] = round(wall_time_s, 3)
    return stats


class Engine:
    """Greedy generation for many prompts at once, with KV in one pool and a prefix cache.

    cache: "radix" (chapter 3's tree), "blocks" (chapter 2's hashed blocks) or "none".
    num_slots: KV pool size in tokens (default DEFAULT_NUM_SLOTS). page_size: tokens per page of
    the pool; in "blocks" mode the block size (default 16), else 1. max_batch_tokens: tokens
    computed per step at most (decodes count one each). chunked_prefill: a prompt longer than what
    is left of that budget is computed in chunks over several steps while the others keep decoding
    (with False it waits until nothing else runs, then runs whole, exceeding the budget).
    schedule: "fcfs" or "lpm" (longest cached prefix first). max_running: requests that can hold
    KV at once (rows of the ReqToTokenPool). plain_text: tokenize string prompts as plain text, so
    that a typed `<|im_start|>` cannot forge a chat turn (by default, as in transformers, it becomes
    the control token; see `kvlearn.model.chat_ids`). fast: run the model through the engine's own
    packed copy of the weights (`kvlearn.fast`; the same tokens, several times faster on CPU, and
    the model's size again in memory); the chapters teach the plain path. host_slots, disk_dir, write_policy: chapter 8's tiers
    below the pool ("radix" only): a host pool of host_slots tokens and/or an existing, writable
    folder of KV pages; "write_back" copies KV down when it is evicted, "write_through" when it is
    cached. With both left at None there are no tiers. disk_max_bytes: the disk tier's capacity
    (least recently used pages are deleted first); None: no limit. share_in_step ("radix" without
    tiers): a request whose prompt shares a prefix with one admitted in the same step runs at once
    on its partner's slots, as in vLLM, instead of waiting one step for the partner's prompt to
    reach the cache, as in SGLang (the default; see `kvlearn.serving.scheduler`).

    One caller at a time: an engine is not thread-safe; a second thread that calls `step` or
    `generate` while another is inside one gets a RuntimeError.

    `stats` covers the steps since the last `reset_stats()` (`generate` resets first unless
    requests queued by `add_request` are still running).
    """

    def __init__(self, model, tokenizer, cache: str = "radix", num_slots: int | None = None,
                 page_size: int | None = None, max_batch_tokens: int = 2048, chunked_prefill: bool = True,
                 schedule: str = "fcfs",
                 max_running: int = DEFAULT_MAX_REQUESTS, host_slots: int | None = None, disk_dir=None,
                 write_policy: str = "write_back", disk_max_bytes: int | None = None, plain_text: bool = False,
                 fast: bool = False, share_in_step: bool = False):
        check_choice("cache", cache, CACHE_MODES)
        check_tier_options(cache, host_slots, disk_dir, write_policy, disk_max_bytes)
        if share_in_step and (cache != "radix" or host_slots is not None or disk_dir is not None):
            raise ValueError("share_in_step needs cache='radix' without tiers (host_slots, disk_dir): "
                             "only there can a request read slots another request fills in the same step.")
        check_choice("schedule", schedule, SCHEDULES)
        check_positive_int("max_batch_tokens", max_batch_tokens)
        check_positive_int("max_running", max_running)
        if not hasattr(tokenizer, "apply_chat_template"):
            raise TypeError(f"tokenizer must be the model's tokenizer (from load_model), got {type(tokenizer).__name__}.")
        page_size = default_page_size(cache) if page_size is None else page_size
        num_slots = DEFAULT_NUM_SLOTS if num_slots is None else num_slots
        # The pool checks the sizes (num_slots a multiple of page_size) before anything is built.
        self.pool = KVPool.for_model(model.config, num_slots=num_slots, dtype=model.dtype, device=model.device,
                                     page_size=page_size)
        self.model, self.tokenizer, self.cache_mode, self.plain_text = model, tokenizer, cache, bool(plain_text)
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.runner = ModelRunner(model, self.pool, fast=fast)
        # A later chapter's KV manager when the options ask for it (chapter 8's tiers), else ours.
        options = SimpleNamespace(cache=cache, host_slots=host_slots, disk_dir=disk_dir, write_policy=write_policy,
                                  disk_max_bytes=disk_max_bytes, max_running=max_running)
        self.kv = registered_kv(options, self.pool, model) or make_kv_manager(cache, self.pool, max_running)
        self.scheduler = Scheduler(self.kv, max_batch_tokens, schedule, self.eos_token_ids,
                                   chunked_prefill=chunked_prefill, share_in_step=share_in_step)
        self._busy = threading.Lock()
        self._request_ids = itertools.count()
        self.reset_stats()

    @property
    def cache(self):
        """The prefix cache itself: a RadixCache, a BlockManager, or None."""
        return self.kv.cache

    def __repr__(self) -> str:
        s = self.scheduler
        return (f"Engine(cache={self.cache_mode!r}, schedule={s.schedule_policy!r}, slots={self.pool.num_slots}, "
                f"page_size={self.pool.page_size}, max_batch_tokens={s.max_batch_tokens}, "
                f"waiting={len(s.waiting)}, running={len(s.running)})")

    # --- requests -------------------------------------------------------------------------------
    def _request(self, prompt, max_new_tokens: int) -> Request:
        """A request for a prompt: strings go through the chat template, then every prompt, text or
        ids, is checked the same way (ints, by `Sequence`; inside the model's vocabulary, here)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("Empty prompt: give some text or a non-empty list of token ids.")
            prompt = chat_ids(self.tokenizer, prompt, plain_text=self.plain_text)
        elif isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        elif not isinstance(prompt, (list, tuple)):
            raise TypeError(f"A prompt is a string or a list of token ids, got {type(prompt).__name__}.")
        if not prompt:
            raise ValueError("Empty prompt: give some text or a non-empty list of token ids.")
        req = Request(-1, prompt, max_new_tokens, self.pool.page_size)
        if max(req.token_ids) >= self.vocab_size:
            raise ValueError(f"Token id {max(req.token_ids)} is outside the vocabulary [0, {self.vocab_size}) of the model: "
                             "tokenize with this model's tokenizer (tokens added to the tokenizer after "
                             "loading have no embedding in the model).")
        return req

    def _make_requests(self, prompts, max_new_tokens) -> list[Request]:
        """Check every prompt before any is queued, so bad input leaves the engine unchanged."""
        check_positive_int("max_new_tokens", max_new_tokens)
        requests = [self._request(p, max_new_tokens) for p in prompts]
        for i, req in enumerate(requests):
            if not self.kv.fits(req):
                raise KVCapacityError(
                    f"Prompt {i} needs KV for up to {req.max_tokens} tokens ({req.num_prompt_tokens} prompt + "
                    f"{max_new_tokens} new - 1) but the whole pool holds {self.kv.capacity}: use a bigger "
                    "num_slots, a shorter prompt or a smaller max_new_tokens.")
        return requests

    def _queue(self, requests: list[Request]) -> None:
        for req in requests:
            req.rid = next(self._request_ids)
            self.scheduler.add(req)

    def add_request(self, prompt, max_new_tokens: int = 32) -> Request:
        """Queue one prompt (text or token ids); `step()` runs it."""
        requests = self._make_requests([prompt], max_new_tokens)
        with self._one_caller():
            self._queue(requests)
        return requests[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- running ----------------------------------------------------------------------------------
    @contextmanager
    def _one_caller(self):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("This Engine is already running a step or generate in another thread: an "
                               "engine serves one caller at a time (use one engine per thread).")
        try:
            yield
        finally:
            self._busy.release()

    def step(self) -> StepReport:
        """One scheduling step and one forward pass; returns what happened."""
        with self._one_caller(), self.runner.active():
            return self._step()

    def _step(self) -> StepReport:
        if not self.scheduler.has_unfinished():
            raise RuntimeError("Nothing to run: add a request first (add_request or generate).")
        start = time.perf_counter()
        try:
            batch = self.scheduler.schedule()
            if not batch:
                raise RuntimeError(f"The scheduler found nothing to run with {len(self.scheduler.waiting)} "
                                   "waiting requests: this is a kvlearn bug, please report it.")
            # The scheduler built valid input (checked prompts, allocated slots): no per-step re-check.
            logits = self.runner.run(batch.input_ids, batch.kv_indices)
            self.scheduler.postprocess(batch, logits.argmax(-1).tolist())
        except BaseException:
            # An error or Ctrl-C anywhere in the step: the running requests leave ("aborted"), giving
            # back their KV, so the engine stays whole; waiting ones hold nothing and stay queued.
            self.scheduler.abort(list(self.scheduler.running))
            raise
        self._wall_time += time.perf_counter() - start
        return self.scheduler.report

    def generate(self, prompts, max_new_tokens: int = 32, progress: bool = False) -> list[GenerationOutput]:
        """Greedy-generate for every prompt (text or token ids); outputs in prompt order."""
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts (strings or token-id lists).")
        # One runner session for the whole call: the attention implementation is switched once, and
        # put back when control returns to the caller (also on error).
        with self._one_caller(), self.runner.active():
            requests = self._make_requests(prompts, max_new_tokens)
            if not self.scheduler.has_unfinished():  # else requests queued by add_request() would be half counted
                self.reset_stats()
            self._queue(requests)
            bar = None
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(requests) * max_new_tokens, desc=f"kvlearn {self.cache_mode}", unit="tok",
                           leave=False)
            try:
                while any(r.status in ("waiting", "running") for r in requests):
                    self._step()
                    if bar is not None:
                        bar.n = sum(len(r.output_ids) for r in requests)
                        bar.refresh()
            except BaseException:  # this call's requests that still wait leave the queue too
                self.scheduler.abort(requests)
                raise
            finally:
                if bar is not None:
                    bar.close()
        return [GenerationOutput(r.rid, r.token_ids[:r.num_prompt_tokens], r.output_ids,
                                 self.tokenizer.decode(r.output_ids, skip_special_tokens=True))
                for r in requests]

    # --- stats and cache ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.scheduler.reset_stats()
        self._wall_time = 0.0
        self._counters_start = self.kv.counters()

    @property
    def stats(self) -> dict:
        """The scheduler's counters since the last reset (see `Scheduler`), plus hit_rate =
        cached / (cached + computed) prefill tokens and the wall time spent in `step`, and the tier
        counters (offloaded_tokens, loaded_from_host_tokens, loaded_from_disk_tokens; 0 without tiers)."""
        stats = with_rates(self.scheduler.stats, self._wall_time)
        stats.update({k: v - self._counters_start[k] for k, v in self.kv.counters().items()})
        return stats

    def evict_all(self) -> int:
        """Drop every cached token no request is using (tokens freed); with nothing running,
        every slot of the pool is free afterwards (`pool.num_free == pool.num_slots`), in every mode."""
        with self._one_caller():
            return self.kv.evict_all()
