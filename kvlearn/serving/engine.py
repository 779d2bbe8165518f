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
import time
from dataclasses import dataclass

import torch

from kvlearn.errors import KVCapacityError, check_positive_int
from kvlearn.model import chat_ids
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner
from kvlearn.serving.cache_modes import CACHE_MODES, make_kv_manager
from kvlearn.serving.scheduler import SCHEDULES, Request, Scheduler, StepReport

DEFAULT_NUM_SLOTS = 8192        # about 377 MB of float32 KV for SmolLM2-135M
DEFAULT_BLOCK_SIZE = 16         # "blocks" mode's tokens per block when page_size is not given


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
    computed per step at most (decodes count one each; a prompt alone may exceed it).
    schedule: "fcfs" or "lpm" (longest cached prefix first).

    `stats` covers the steps since the last `reset_stats()` (`generate` resets first unless
    requests queued by `add_request` are still running).
    """

    def __init__(self, model, tokenizer, cache: str = "radix", num_slots: int | None = None,
                 page_size: int | None = None, max_batch_tokens: int = 2048, schedule: str = "fcfs"):
        if cache not in CACHE_MODES:
            raise ValueError(f"Unknown cache {cache!r}: choose one of {', '.join(CACHE_MODES)}.")
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}.")
        if page_size is None:
            page_size = DEFAULT_BLOCK_SIZE if cache == "blocks" else 1
        check_positive_int("page_size", page_size)
        num_slots = check_positive_int("num_slots", DEFAULT_NUM_SLOTS if num_slots is None else num_slots)
        if num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size ({page_size}): "
                             f"use {max(num_slots // page_size, 1) * page_size}.")
        check_positive_int("max_batch_tokens", max_batch_tokens)
        self.model, self.tokenizer, self.cache_mode = model, tokenizer, cache
        self.vocab_size = model.config.vocab_size
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        self.pool = KVPool.for_model(model.config, num_slots=num_slots, dtype=model.dtype, device=model.device,
                                     page_size=page_size)
        self.runner = ModelRunner(model, self.pool)
        self.kv = make_kv_manager(cache, self.pool)
        self.scheduler = Scheduler(self.kv, max_batch_tokens, schedule, self.eos_token_ids)
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
    def _prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt: strings go through the chat template, id lists are checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("Empty prompt: give some text or a non-empty list of token ids.")
            return chat_ids(self.tokenizer, prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"A prompt is a string or a list of token ids, got {type(prompt).__name__}.")
        if not prompt:
            raise ValueError("Empty prompt: give some text or a non-empty list of token ids.")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"Token ids must be ints, got {type(t).__name__} {t!r}.")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"Token id {t} is outside the vocabulary [0, {self.vocab_size}): "
                                 "tokenize with this model's tokenizer.")
        return list(prompt)

    def _make_requests(self, prompts, max_new_tokens) -> list[Request]:
        """Check every prompt before any is queued, so bad input leaves the engine unchanged."""
        check_positive_int("max_new_tokens", max_new_tokens)
        requests = [Request(-1, self._prompt_ids(p), max_new_tokens) for p in prompts]
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
        self._queue(requests)
        return requests[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- running ----------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One scheduling step and one forward pass; returns what happened."""
        if not self.scheduler.has_unfinished():
            raise RuntimeError("Nothing to run: add a request first (add_request or generate).")
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError(f"The scheduler found nothing to run with {len(self.scheduler.waiting)} waiting "
                               "requests: this is a kvlearn bug, please report it.")
        logits = self.runner.forward(batch.input_ids, batch.kv_indices)
        self.scheduler.postprocess(batch, logits.argmax(-1).tolist())
        self._wall_time += time.perf_counter() - start
        return self.scheduler.report

    def generate(self, prompts, max_new_tokens: int = 32, progress: bool = False) -> list[GenerationOutput]:
        """Greedy-generate for every prompt (text or token ids); outputs in prompt order."""
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts (strings or token-id lists).")
        requests = self._make_requests(prompts, max_new_tokens)
        if not self.scheduler.has_unfinished():  # else requests queued by add_request() would be half counted
            self.reset_stats()
        self._queue(requests)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(requests) * max_new_tokens, desc=f"kvlearn {self.cache_mode}", unit="tok",
                       leave=False)
        while any(r.status != "finished" for r in requests):
            self.step()
            if bar is not None:
                bar.n = sum(len(r.output_ids) for r in requests)
                bar.refresh()
        if bar is not None:
            bar.close()
        return [GenerationOutput(r.rid, r.token_ids[:r.num_prompt_tokens], r.output_ids,
                                 self.tokenizer.decode(r.output_ids, skip_special_tokens=True))
                for r in requests]

    # --- stats and cache ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.scheduler.reset_stats()
        self._wall_time = 0.0

    @property
    def stats(self) -> dict:
        """The scheduler's counters since the last reset (see `Scheduler`), plus hit_rate =
        cached / (cached + computed) prefill tokens and the wall time spent in `step`."""
        return with_rates(self.scheduler.stats, self._wall_time)

    def evict_all(self) -> int:
        """Drop every cached token no request is using (tokens freed); with nothing running,
        every slot is free afterwards (`kv.free_slots == pool.num_slots`; in "blocks" mode the
        block manager keeps owning the pool's slots, so `pool.num_free` stays 0)."""
        return self.kv.evict_all()
