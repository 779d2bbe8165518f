"""Chapter 0: greedy decoding with and without a KV cache, timed and counted.

Without a cache every new token re-runs the model over the whole sequence, so step t costs work
proportional to t (and attention to t squared); with a cache each step feeds one token and reads
the keys and values kept from earlier steps. Both must produce exactly the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvlearn.errors import check_positive_int
from kvlearn.model import eos_token_ids


@torch.no_grad()
def greedy_decode(model, prompt_ids, max_new_tokens: int, use_cache: bool = True, stop_at_eos: bool = True,
                  progress=None):
    """Greedy decoding written out by hand, to compare the two ways of producing each next token.

    use_cache=False recomputes the whole sequence every step (step t costs a forward over
    prompt + t tokens); use_cache=True keeps K and V in transformers' DynamicCache and feeds only the
    newest token. Returns (new_token_ids, seconds_per_step). `progress` is called once per step.
    """
    from transformers import DynamicCache

    check_positive_int("max_new_tokens", max_new_tokens)
    eos = eos_token_ids(model)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    cache = DynamicCache(config=model.config) if use_cache else None
    step_input, tokens, seconds = ids, [], []
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        out = model(input_ids=step_input, cache=cache, use_cache=use_cache)
        token = int(out.logits[0, -1].argmax())
        seconds.append(time.perf_counter() - start)
        tokens.append(token)
        if progress:
            progress()
        if stop_at_eos and token in eos:
            break
        new = torch.tensor([[token]], device=model.device)
        step_input = new if use_cache else torch.cat([step_input, new], dim=1)
    return tokens, seconds


def forward_flops(config, num_new: int, num_context: int) -> int:
    """Approximate FLOPs of one forward that computes `num_new` tokens at the end of a `num_context`-token
    sequence: 2 per multiply-add in the projections and MLP of each new token, plus attention scores and
    weighted sums over the positions each new token can see (causal)."""
    d, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * hd * 2 + d * kv_heads * hd * 2 + 3 * d * config.intermediate_size
    weights = config.num_hidden_layers * per_layer + d * config.vocab_size
    seen = num_new * (num_context - num_new) + num_new * (num_new + 1) // 2  # query-key pairs
    attention = 2 * 2 * config.num_hidden_layers * heads * hd * seen
    return 2 * num_new * weights + attention


@dataclass
class Comparison:
    """Both decodes of one prompt: the tokens are equal; times and FLOPs are per step."""

    prompt_len: int
    tokens: list[int]
    seconds_no_cache: list[float]
    seconds_cache: list[float]
    flops_no_cache_steps: list[int]
    flops_cache_steps: list[int]

    @property
    def flops_no_cache(self) -> int:
        return sum(self.flops_no_cache_steps)

    @property
    def flops_cache(self) -> int:
        return sum(self.flops_cache_steps)

    def report(self) -> str:
        ms = lambda s: f"{1000 * s:7.1f} ms"  # noqa: E731
        lines = [f"prompt {self.prompt_len} tokens, {len(self.tokens)} new tokens, identical with and without cache"]
        for label, seconds, flops in (("no cache", self.seconds_no_cache, self.flops_no_cache),
                                      ("KV cache", self.seconds_cache, self.flops_cache)):
            lines.append(f"{label} : total {ms(sum(seconds))}, last step {ms(seconds[-1])}, {flops / 1e9:6.1f} GFLOP")
        lines.append(f"speed-up {sum(self.seconds_no_cache) / sum(self.seconds_cache):.1f}x, "
                     f"work ratio {self.flops_no_cache / self.flops_cache:.1f}x")
        return "\n".join(lines)


def compare(model, prompt_ids, max_new_tokens: int, progress=None) -> Comparison:
    """Decode greedily twice (recompute vs cache) and check the tokens agree."""
    slow, t_slow = greedy_decode(model, prompt_ids, max_new_tokens, use_cache=False, stop_at_eos=False,
                                 progress=progress)
    fast, t_fast = greedy_decode(model, prompt_ids, max_new_tokens, use_cache=True, stop_at_eos=False,
                                 progress=progress)
    if slow != fast:
        raise AssertionError("cached and uncached greedy decoding disagree: the cache is wrong")
    p, cfg = len(prompt_ids), model.config
    lengths = [p + t for t in range(len(fast))]  # sequence length fed at each step
    no_cache = [forward_flops(cfg, n, n) for n in lengths]
    cache = [forward_flops(cfg, p, p)] + [forward_flops(cfg, 1, n) for n in lengths[1:]]
    return Comparison(p, fast, t_slow, t_fast, no_cache, cache)


def plot_step_times(comparison: Comparison):
    """Per decode step: measured time (left) and counted work (right) against sequence length."""
    import matplotlib.pyplot as plt

    c = comparison
    positions = [c.prompt_len + t for t in range(1, len(c.tokens))]
    # Step 0 is the prompt's prefill in both loops, not a decode step: leave it out.
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, unit, scale, (slow, fast) in (
            (left, "time per new token (ms)", 1e3, (c.seconds_no_cache, c.seconds_cache)),
            (right, "work per new token (GFLOP)", 1e-9, (c.flops_no_cache_steps, c.flops_cache_steps))):
        ax.plot(positions, [scale * v for v in slow[1:]], label="recompute everything")
        ax.plot(positions, [scale * v for v in fast[1:]], label="with KV cache")
        ax.set_xlabel("sequence length at this step (tokens)")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("SmolLM2-135M greedy decoding: measured on this CPU (left), counted (right)")
    return fig
