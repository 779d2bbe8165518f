"""The serving engine: many requests, one model, continuous batching over a prefix cache.

Each `step()` asks the scheduler for a batch (decodes of running requests plus admissions whose
cached prefix is skipped), runs it as one packed forward through the model runner, and hands the
greedy tokens back to the scheduler, which finishes, caches and frees. Whatever the cache mode,
the tokens are Hugging Face `generate`'s on each prompt alone: a cache changes what is computed,
never what comes out. The engine borrows the model and leaves it as it found it.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from kvlearn.errors import KVCapacityError, PartError, check_positive_int
from kvlearn.fast import FastLlama
from kvlearn.kernels import attention_function, resolve_attention_backend
from kvlearn.model import chat_ids, eos_token_ids
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner
from kvlearn.serving.cache_modes import make_kv_manager
from kvlearn.serving.config import EngineConfig
from kvlearn.serving.hooks import registered_kv
from kvlearn.serving.part_registry import served
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler, StepReport


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


def stats_with_hit_rate(counters: dict, wall_time_s: float) -> dict:
    """Scheduler counters plus hit_rate and wall time (rounded, so they print cleanly)."""
    stats = dict(counters)
    prefill = stats["cached_tokens"] + stats["computed_prefill_tokens"]
    stats["hit_rate"] = round(stats["cached_tokens"] / prefill, 4) if prefill else 0.0
    stats["wall_time_s"] = round(wall_time_s, 3)
    return stats


class Engine:
    """Greedy generation for many prompts at once, with KV in one pool and a prefix cache.

    `Engine(model, tokenizer, config)` with an `EngineConfig`, or keyword options that are its
    fields (`Engine(model, tokenizer, cache="blocks", num_slots=4096)`); both together: the options
    replace the config's fields. Every option is documented in `kvlearn.serving.config`.

    One caller at a time: an engine is not thread-safe; a second thread that calls `step` or
    `generate` while another is inside one gets a RuntimeError. After `close()`, `generate`,
    `add_request`, `step` and `evict_all` raise RuntimeError.

    Parts (`parts={...}`, kvlearn.parts) that are not the package's serve behind thin checks
    (`kvlearn.serving.part_registry.served`); a part that breaks its contract raises
    `kvlearn.PartError` and the engine stops (every later call says so). `parts={"attention": fn}` serves
    through the plain path even with `fast=True` (the fast path computes attention its own way).

    `stats` covers the steps since the last `reset_stats()` (`generate` resets first unless
    requests queued by `add_request` are still running).
    """

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, **options):
        self.config = c = EngineConfig.from_options(config, **options)
        if not hasattr(tokenizer, "apply_chat_template"):
            raise TypeError(f"tokenizer must be the model's own (from load_model), got {type(tokenizer).__name__}.")
        # The pool checks its sizes before anything is built; a learner's part serves behind its guard (`served`).
        self.pool = KVPool.for_model(model.config, num_slots=c.num_slots, dtype=model.dtype, device=model.device,
                                     page_size=c.page_size, allocator_cls=served(c.parts, "allocator"),
                                     kv_cache_dtype=c.kv_cache_dtype, format_cls=served(c.parts, "quantizer"))
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        # A learner's attention (parts["attention"]) runs in the model's own layers: the plain path,
        # where attention_backend picks the package's attention otherwise (the fast path has its own).
        # `attention_backend` says what computes attention: "torch", "triton", "fast" or "part".
        fast = c.fast and "attention" not in c.parts
        if fast or "attention" in c.parts:
            self.attention_backend, attention = ("fast", None) if fast else ("part", served(c.parts, "attention"))
        else:
            backend = "torch" if c.attention_backend == "auto" and c.kv_cache_dtype != "auto" else c.attention_backend
            self.attention_backend = resolve_attention_backend(backend, model.device)
            # A learner's stage-1 decode kernel serves inside the Triton attention (config: backend "triton").
            attention = served(c.parts, "decode_kernel") or attention_function(self.attention_backend, self.pool)
        self.runner = ModelRunner(model, self.pool, model_forward=FastLlama(model).forward if fast else None,
                                  attention=attention)
        # A later chapter's KV manager when the options ask for it (chapter 8's tiers), a learner's
        # cache behind its guard, or one of chapter 6's modes.
        make = served(c.parts, "radix_cache") or served(c.parts, "block_manager") or partial(make_kv_manager, c.cache)
        self.kv = registered_kv(c, self.pool, model) or make(self.pool, c.max_requests)
        self.scheduler = (served(c.parts, "scheduler") or Scheduler)(
            self.kv, c.max_batch_tokens, c.schedule, self.eos_token_ids, chunked_prefill=c.chunked_prefill)
        self._busy = threading.Lock()
        self._request_ids = itertools.count()
        self.closed = False
        self.stopped: PartError | None = None   # a learner's part broke its contract: the engine serves no more
        self.reset_stats()

    @property
    def cache_mode(self) -> str:
        """"radix", "blocks" or "none"."""
        return self.config.cache

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
        prompt = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(f"A prompt is a string or a list of token ids, got {type(prompt).__name__}.")
        if not prompt:
            raise ValueError("Empty prompt: give some text or a non-empty list of token ids.")
        if isinstance(prompt, str):
            prompt = chat_ids(self.tokenizer, prompt, plain_text=self.config.plain_text)
        req = Request(-1, prompt, max_new_tokens, self.pool.page_size)
        if max(req.token_ids) >= self.vocab_size:
            raise ValueError(f"Token id {max(req.token_ids)} is outside the vocabulary [0, {self.vocab_size}): "
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
        self._check_open("add_request")
        requests = self._make_requests([prompt], max_new_tokens)
        with self._one_caller():
            self._queue(requests)
        return requests[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- running ----------------------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self.stopped is not None:
            raise RuntimeError(f"{call}: this Engine stopped when a part broke its contract ({self.stopped}). Fix "
                               "the part, then build a new Engine.")
        if self.closed:
            raise RuntimeError(f"{call}: this Engine is closed (close(), or the end of its `with` block); build a "
                               "new Engine to serve again.")

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
        self._check_open("step")
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
            # Greedy: the first largest logit of each row, as argmax; max(-1) finds the same index
            # about 3x faster on CPU (16 rows of 49,152: 0.16 ms against 0.5 ms).
            self.scheduler.postprocess(batch, logits.max(-1).indices.tolist())
        except PartError as error:   # a learner's part broke its contract: nothing more is asked of it
            self.stopped = error
            raise
        except BaseException:
            # An error or Ctrl-C anywhere in the step: the running requests leave ("aborted"), giving
            # back their KV, so the engine stays whole; waiting ones hold nothing and stay queued.
            self.scheduler.abort(list(self.scheduler.running))
            raise
        self._wall_time += time.perf_counter() - start
        return self.scheduler.report

    def generate(self, prompts, max_new_tokens: int = 32, progress: bool = False) -> list[GenerationOutput]:
        """Greedy-generate for every prompt (text or token ids); outputs in prompt order."""
        self._check_open("generate")
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts (strings or token-id lists).")
        # One runner session for the whole call: the attention implementation is switched once, and
        # put back when control returns to the caller (also on error).
        with self._one_caller(), self.runner.active():
            requests = self._make_requests(prompts, max_new_tokens)
            if not self.scheduler.has_unfinished():  # else requests queued by add_request() would be half counted
                self.reset_stats()
            self._queue(requests)
            from kvlearn.progress import progress_bar  # here: a bar is its only use (tqdm.auto looks for Jupyter)
            with progress_bar(total=len(requests) * max_new_tokens, desc=f"kvlearn {self.cache_mode}", unit="tok",
                              leave=False, disable=not progress) as bar:
                try:
                    while any(r.status.live for r in requests):
                        self._step()
                        bar.update(sum(len(r.output_ids) for r in requests) - bar.n)
                except BaseException:  # this call's requests that still wait leave the queue too
                    if self.stopped is None:
                        self.scheduler.abort(requests)
                    raise
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
        stats = stats_with_hit_rate(self.scheduler.stats, self._wall_time)
        stats.update({k: v - self._counters_start[k] for k, v in self.kv.counters().items()})
        return stats

    def close(self) -> None:
        """End of service: requests still queued or running are aborted (what they computed joins
        the cache), then the KV manager writes down what must outlive the engine (`KVManager.flush`:
        with chapter 8's write_back, the device's and host's KV goes to the disk folder, so a restart
        finds it). Idempotent; `with Engine(...) as engine:` calls it on the way out. Afterwards the
        engine serves nothing more. An engine a part stopped asks that part nothing more."""
        with self._one_caller():
            s = self.scheduler
            if self.stopped is not None:
                self.closed = True
                return
            try:
                s.abort(list(s.running) + list(s.waiting))
            finally:
                self.closed = True
                self.kv.flush()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def evict_all(self) -> int:
        """Drop every cached token no request is using (tokens freed); with nothing running,
        every slot of the pool is free afterwards (`pool.num_free == pool.num_slots`), in every mode."""
        self._check_open("evict_all")
        with self._one_caller():
            return self.kv.evict_all()
