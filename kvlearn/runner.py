"""The model runner: one packed forward of several sequences over the KV pool.

The caller (the engine) decides which sequences run and where their KV lives; the runner turns
"these new tokens, these context slots" into input_ids, positions, slot_mapping and padded
per-sequence KV indices, runs the model once with the paged attention of `kvlearn.attention`,
and returns each sequence's last-token logits.

The runner borrows the model: it switches the attention implementation to its own only while it
runs and puts the previous one back afterwards, even on error, so `model.generate` is unaffected.
Switching walks every module, so a caller that runs many steps opens one session
(`with runner.active(): ...`) and the steps inside it switch nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kvlearn.attention import AttentionMetadata, paged_attention, register
from kvlearn.errors import check_positive_int
from kvlearn.memory import get_config
from kvlearn.pool import KVPool


class ModelRunner:
    """Runs a Hugging Face causal LM (Llama-like, GQA) with its K and V in a `KVPool`.

    model_forward: None to run the model itself, or a callable that runs the step in its place,
    `model_forward(input_ids, query_lens, kv_indices, pool) -> logits`: input_ids [T] the new tokens
    of every sequence in one row, `query_lens[i]` of them sequence i's, `kv_indices` as in `forward`;
    it writes the new K/V into the pool and returns [num_seqs, vocab] float logits of each sequence's
    last new token, as the model would (the engine's fast path: `kvlearn.fast.FastLlama(model).forward`).

    attention: None for `kvlearn.attention.paged_attention`, or a function with its signature and
    contract that every layer calls instead (a learner's part, `kvlearn.parts.AttentionPart`, passed
    as `attention_fn`: nothing registered with transformers changes). Not with `model_forward`, which
    computes attention its own way (and never touches the model's attention setting).
    """

    def __init__(self, model, pool: KVPool, model_forward=None, attention=None):
        if not isinstance(pool, KVPool):
            raise TypeError(f"pool must be a kvlearn.KVPool, got {type(pool).__name__}.")
        shape = get_config(model.config)
        expected = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        got = (pool.num_layers, pool.num_kv_heads, pool.head_dim)
        if got != expected:
            raise ValueError(f"Pool shape (layers, kv_heads, head_dim)={got} does not match the model's "
                             f"{expected}: build it with KVPool.for_model(model.config, ...).")
        if pool.kv.device != model.device:
            raise ValueError(f"Pool is on {pool.kv.device} but the model is on {model.device}: put both on one device.")
        if attention is not None and not callable(attention):
            raise TypeError(f"attention must be a function like kvlearn.attention.paged_attention, got "
                            f"{type(attention).__name__}.")
        if attention is not None and model_forward is not None:
            raise ValueError("Give attention or model_forward, not both: model_forward computes attention its own way.")
        self.model, self.pool = model, pool
        self.attention = paged_attention if attention is None else attention
        self.vocab_size = model.config.vocab_size
        self.attn_implementation = register()
        self.model_forward = model_forward
        self._in_session = False

    @contextmanager
    def active(self):
        """The session of the module docstring; nested sessions are part of the outer one. The model
        must not be used for anything else inside it."""
        if self._in_session or self.model_forward is not None:
            yield
            return
        # transformers 5.24 sets the implementation publicly (set_attn_implementation) but offers no
        # public getter: the config's `_attn_implementation` property is the only way to read it.
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attn_implementation)
        self._in_session = True
        try:
            yield
        finally:
            self._in_session = False
            self.model.set_attn_implementation(previous)

    def forward(self, input_ids: list[list[int]], kv_indices: list[torch.Tensor]) -> torch.Tensor:
        """One packed forward. For sequence i: `input_ids[i]` are its NEW tokens (>= 1) and
        `kv_indices[i]` the slots of its WHOLE context (cached prefix + new tokens), so its new
        tokens sit at positions len(kv_indices[i]) - len(input_ids[i]) .. len(kv_indices[i]) - 1 and
        their K/V are written at kv_indices[i][-len(input_ids[i]):]. Returns [num_seqs, vocab]
        float logits of each sequence's last new token."""
        return self.run(input_ids, self._check(input_ids, kv_indices))

    def run(self, input_ids: list[list[int]], kv_indices: list[torch.Tensor],
            every_token: bool = False) -> torch.Tensor:
        """`forward` without the checks, for callers that built valid input themselves (the engine's
        scheduler): token ids in the vocabulary, int64 slot tensors on the pool's device that are
        allocated, with fresh slots for the new tokens. `every_token`: the logits of every new token,
        [T, vocab] in the packed row's order, instead of each sequence's last (teacher forcing, chapter 10)."""
        query_lens = [len(ids) for ids in input_ids]
        ids = torch.tensor([t for seq in input_ids for t in seq], dtype=torch.int64, device=self.pool.device)
        if self.model_forward is not None:
            if every_token:
                raise ValueError("every_token needs the model's own forward: "
                                 "model_forward returns last-token logits only.")
            return self.model_forward(ids, query_lens, kv_indices, self.pool)
        md = AttentionMetadata.build(query_lens, kv_indices, device=self.pool.device)
        with torch.no_grad(), self.active():  # a no-op inside the caller's session
            out = self.model(input_ids=ids[None], position_ids=md.positions[None], use_cache=False,
                             logits_to_keep=0 if every_token else md.last_token, kv_pool=self.pool,
                             attn_metadata=md, attention_fn=self.attention)
        return out.logits[0].float()

    def _check(self, input_ids, kv_indices) -> list[torch.Tensor]:
        """Reject bad input before anything is written to the pool."""
        if not isinstance(input_ids, (list, tuple)) or not isinstance(kv_indices, (list, tuple)):
            raise TypeError("input_ids and kv_indices must be lists (one entry per sequence).")
        if not input_ids or len(input_ids) != len(kv_indices):
            raise ValueError(f"Need one kv_indices entry per sequence and at least one sequence; got "
                             f"{len(input_ids)} input_ids and {len(kv_indices)} kv_indices.")
        checked = []
        for i, (ids, slots) in enumerate(zip(input_ids, kv_indices, strict=True)):
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"input_ids[{i}] must be a non-empty list of int token ids.")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"input_ids[{i}] has a token id outside [0, {self.vocab_size}).")
            if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
                raise TypeError(f"kv_indices[{i}] must be a 1-D int64 tensor of pool slots "
                                "(as returned by KVPool.alloc).")
            if len(slots) < len(ids):
                raise ValueError(f"kv_indices[{i}] has {len(slots)} slots but the sequence has {len(ids)} new "
                                 "tokens: it must cover the cached prefix plus the new tokens.")
            checked.append(slots.to(self.pool.device))
        every = torch.cat(checked)
        if self.pool.is_free(every).any():   # is_free refuses slots outside the pool (ValueError)
            raise ValueError("kv_indices name slots that are free in the pool: alloc() them first.")
        new_slots = torch.cat([s[len(s) - len(ids):] for ids, s in zip(input_ids, checked, strict=True)])
        cached = torch.cat([s[:len(s) - len(ids)] for ids, s in zip(input_ids, checked, strict=True)])
        if new_slots.unique().numel() != new_slots.numel() or torch.isin(new_slots, cached).any():
            raise ValueError("A new token would be written to the slot of another new token or of a cached "
                             "context token: give each new token a freshly allocated slot.")
        return checked

    def __repr__(self) -> str:
        own = "".join(f", {name}={getattr(fn, '__qualname__', type(fn).__name__)}" for name, fn in
                      (("model_forward", self.model_forward), ("attention", self.attention))
                      if fn not in (None, paged_attention))
        return f"ModelRunner({type(self.model).__name__}, {self.pool!r}{own})"


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[list[int]]:
    """Static batching, the baseline chapter 6 improves on: prefill all prompts in one packed step,
    then decode them together, one token each per step, until each hits EOS or max_new_tokens.
    Slots come from the pool a page at a time and all go back at the end (also on error).
    Returns the generated tokens of each prompt (EOS included when reached)."""
    check_positive_int("max_new_tokens", max_new_tokens)
    pool = runner.pool
    owned = [torch.empty(0, dtype=torch.int64, device=pool.device) for _ in prompts]
    context = [0] * len(prompts)                 # tokens whose K/V are in the pool
    pending = [list(p) for p in prompts]         # tokens to feed in the next step
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    try:
        while live:
            for i in live:
                short = context[i] + len(pending[i]) - len(owned[i])
                if short > 0:
                    pages = -(-short // pool.page_size)
                    owned[i] = torch.cat([owned[i], pool.alloc(pages * pool.page_size)])
            logits = runner.forward([pending[i] for i in live],
                                    [owned[i][:context[i] + len(pending[i])] for i in live])
            for i, token in zip(live, logits.argmax(-1).tolist(), strict=True):
                context[i] += len(pending[i])
                outputs[i].append(token)
                pending[i] = [token]
            live = [i for i in live if outputs[i][-1] != eos_token_id and len(outputs[i]) < max_new_tokens]
    finally:
        for slots in owned:
            pool.free(slots)
    return outputs
