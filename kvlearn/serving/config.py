"""Chapter 6: every option of the serving engine, in one place, checked once.

`Engine(model, tokenizer, EngineConfig(...))` or, the same, `Engine(model, tokenizer, cache=...,
num_slots=...)`: keyword options are the fields below. `EngineConfig` checks every field when it is
made (TypeError or ValueError naming the field and what to give), so an engine is never half built
from bad options; what only the model or a folder can tell (the pool's bytes, whether a disk folder
is writable) and the pool's sizes (chapter 4's `KVPool` checks its own) are checked by the part
that needs them, before anything is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from kvlearn.errors import check_bool, check_choice, check_positive_int
from kvlearn.formats import KV_CACHE_DTYPES
from kvlearn.kernels import ATTENTION_BACKENDS
from kvlearn.serving.cache_modes import CACHE_MODES, WRITE_POLICIES, default_page_size
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.part_registry import REGISTRY, served
from kvlearn.serving.scheduler import SCHEDULES

DEFAULT_NUM_SLOTS = 8192  # about 377 MB of float32 KV for SmolLM2-135M
# The parts a learner may hand the engine (kvlearn.parts), and the cache modes each one serves.
PART_MODES = {part.name: part.modes for part in REGISTRY if part.modes}


@dataclass
class EngineConfig:
    """The engine's options. `None` sizes are filled in with their defaults when the config is made."""

    # --- the cache and the pool (chapters 2-4) ---
    cache: str = "radix"                 # "radix" (chapter 3's tree), "blocks" (chapter 2's hashed blocks) or "none"
    num_slots: int | None = None         # KV pool size in tokens (None: DEFAULT_NUM_SLOTS)
    page_size: int | None = None         # tokens per page of the pool, a block in "blocks" mode (None: 16, else 1)
    max_requests: int = DEFAULT_MAX_REQUESTS  # requests that can hold KV at once (rows of the ReqToTokenPool)
    kv_cache_dtype: str = "auto"         # what a slot stores, vLLM's names (kvlearn.formats; chapter 10)
    parts: dict = field(default_factory=dict)  # learners' parts by name (kvlearn.parts), built like the package's
                                         # own (the records of kvlearn.serving.part_registry); one not given: ours

    # --- the scheduler (chapter 6) ---
    max_batch_tokens: int = 2048         # tokens computed per step at most (each decode counts one)
    chunked_prefill: bool = True         # a prompt longer than the step's budget left is computed in chunks over
                                         # several steps (False: it waits until nothing else runs, then runs whole)
    schedule: str = "fcfs"               # "fcfs" or "lpm" (longest cached prefix first)

    # --- the model (chapter 5) ---
    plain_text: bool = False             # tokenize string prompts as plain text, so a typed `<|im_start|>` cannot
                                         # forge a chat turn (by default it becomes the control token, as HF does)
    fast: bool = False                   # run the model through the engine's packed copy of the weights (kvlearn.fast:
                                         # the same tokens, several times faster on CPU, the model again in memory;
                                         # it has its own attention, so with parts["attention"] the plain path runs)
    attention_backend: str = "auto"      # the plain path's attention (kvlearn.kernels): "torch" (chapter 5's), "triton"
                                         # (Triton kernels: on CUDA, or on a CPU under TRITON_INTERPRET=1), "auto"
                                         # (triton on CUDA when it imports, else torch), as SGLang's --attention-backend
                                         # parts["decode_kernel"] (a learner's stage-1 kernel) needs "triton"

    # --- tiers below the pool (chapter 8; "radix" only; with host_slots and disk_dir None there are none) ---
    host_slots: int | None = None        # tokens of KV a host pool holds
    disk_dir: str | os.PathLike | None = None  # an existing, writable folder of KV pages, reused across restarts
    write_policy: str = "write_back"     # "write_back": KV goes down when it is evicted; "write_through": when cached
    disk_max_bytes: int | None = None    # the disk tier's capacity (least recently used pages go first); None: no limit

    def __post_init__(self):
        check_choice("cache", self.cache, CACHE_MODES)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("write_policy", self.write_policy, WRITE_POLICIES)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, sorted(KV_CACHE_DTYPES))
        self.page_size = default_page_size(self.cache) if self.page_size is None else self.page_size
        self.num_slots = DEFAULT_NUM_SLOTS if self.num_slots is None else self.num_slots
        check_bool("chunked_prefill", self.chunked_prefill)
        check_bool("plain_text", self.plain_text)
        check_bool("fast", self.fast)
        check_positive_int("max_batch_tokens", self.max_batch_tokens)
        check_positive_int("max_requests", self.max_requests)
        if self.host_slots is not None:
            check_positive_int("host_slots", self.host_slots, " (tokens of KV the host tier holds)")
        if self.disk_max_bytes is not None:
            check_positive_int("disk_max_bytes", self.disk_max_bytes, " (bytes the disk tier may use)")
            if self.disk_dir is None:
                raise ValueError("disk_max_bytes limits the disk tier: give disk_dir too (or leave it None).")
        if "decode_kernel" in self.parts and self.attention_backend != "triton":
            raise ValueError("parts['decode_kernel'] is a stage-1 kernel of the Triton attention: give "
                             "attention_backend='triton' with it (on a CPU, under TRITON_INTERPRET=1).")
        if self.attention_backend == "triton" and (self.fast or "attention" in self.parts):
            raise ValueError("attention_backend='triton' serves in the model's own layers, but "
                             + ("fast=True computes attention its own way" if self.fast else
                                "parts['attention'] is the attention there") + ": give one of the two.")
        if self.kv_cache_dtype != "auto" and (self.fast or {"attention", "decode_kernel"} & set(self.parts) or (
                self.attention_backend == "triton" and (self.kv_cache_dtype != "int8" or "quantizer" in self.parts))):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is read by chapter 5's torch attention ('int8' "
                             "by Triton's too, without a quantizer part): give fast=False, attention_backend='torch', "
                             "no attention or decode_kernel part.")
        if self.tiered and self.cache != "radix":
            raise ValueError(f"host_slots and disk_dir need cache='radix' (the tiers hang below the radix "
                             f"tree), got cache={self.cache!r}.")
        names = ", ".join(map(repr, PART_MODES))
        if not isinstance(self.parts, dict):
            raise TypeError(f"parts must be a dict from part name ({names}) to a class, got "
                            f"{type(self.parts).__name__}.")
        for name, part in self.parts.items():
            if name not in PART_MODES:
                raise ValueError(f"Unknown part {name!r}: the parts are {names}.")
            if not callable(part):
                raise TypeError(f"parts[{name!r}] must be a class (or a function) built like the package's "
                                f"{name}, got {type(part).__name__} {part!r}; the parts are {names}.")
            if self.cache not in PART_MODES[name]:
                raise ValueError(f"parts[{name!r}] serves cache={PART_MODES[name][0]!r}, but cache={self.cache!r}.")
            if name == "quantizer" and self.kv_cache_dtype != "int8":
                raise ValueError(f"parts['quantizer'] serves kv_cache_dtype='int8', not {self.kv_cache_dtype!r}.")
            if name == "radix_cache" and self.tiered:
                raise ValueError("parts['radix_cache'] cannot serve with tiers (host_slots, disk_dir): chapter 8's "
                                 "tree is the package's.")
            served(self.parts, name)   # a learner's part goes through its guard once: it checks the contract

    @property
    def tiered(self) -> bool:
        """Whether there are tiers below the pool (chapter 8)."""
        return self.host_slots is not None or self.disk_dir is not None

    @classmethod
    def from_options(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """`config` with `options` (field names) replacing its fields; a name that is not a field
        is a TypeError that lists the fields."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"Unknown engine option(s) {', '.join(unknown)}: the options are {', '.join(names)}.")
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}.")
        return cls(**options) if config is None else replace(config, **options)
