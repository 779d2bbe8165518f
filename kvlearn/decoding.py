"""Chapter 0: greedy decoding with and without a KV cache, timed and counted.

Without a cache every new token re-runs the model over the whole sequence, so step t costs work
proportional to t (and attention to t squared); with a cache each step feeds one token and reads
the keys and values kept from earlier steps. Both must produce exactly the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@torch.no_grad()
def greedy_decode(model, prompt_ids, max_new_tokens: int, use_cache: bool = True, stop_at_eos: bool = True,
                  progress=None):
    """Greedy decoding written out by hand, to compare the two ways of producing each next token.

    use_cache=False recomputes the whole sequence every step (step t costs a forward over
    prompt + t tokens); use_cache=True keeps K and V in transformers' DynamicCache and feeds only the
    newest token. Returns (new_token_ids, seconds_per_step). `progress` is called once per step.
    """
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
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
        if stop_at_eos and token == model.config.eos_token_id:
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
    """Both decodes of one prompt: tokens must be equal, times show the cost of recomputing."""

    prompt_len: int
    tokens: list[int]
    seconds_no_cache: list[float]
    seconds_cache: list[float]
    flops_no_cache: int
    flops_cache: int

    def report(self) -> str:
        n = len(self.tokens)
        ms = lambda s: f"{1000 * s:7.1f} ms"  # noqa: E731
        return "\n".join([
            f"prompt {self.prompt_len} tokens, {n} new tokens, identical with and without cache",
            f"no cache : total {ms(sum(self.seconds_no_cache))}, last step {ms(self.seconds_no_cache[-1])}, "
            f"{self.flops_no_cache / 1e9:6.1f} GFLOP",
            f"KV cache : total {ms(sum(self.seconds_cache))}, last step {ms(self.seconds_cache[-1])}, "
            f"{self.flops_cache / 1e9:6.1f} GFLOP",
            f"speed-up {sum(self.seconds_no_cache) / sum(self.seconds_cache):.1f}x, "
            f"work ratio {self.flops_no_cache / self.flops_cache:.1f}x",
        ])


def compare(model, prompt_ids, max_new_tokens: int, progress=None) -> Comparison:
    """Decode greedily twice (recompute vs cache) and check the tokens agree."""
    slow, t_slow = greedy_decode(model, prompt_ids, max_new_tokens, use_cache=False, stop_at_eos=False,
                                 progress=progress)
    fast, t_fast = greedy_decode(model, prompt_ids, max_new_tokens, use_cache=True, stop_at_eos=False,
                                 progress=progress)
    if slow != fast:
        raise AssertionError("cached and uncached greedy decoding disagree: the cache is wrong")
    p, cfg = len(prompt_ids), model.config
    flops_no_cache = sum(forward_flops(cfg, p + t, p + t) for t in range(len(slow)))
    flops_cache = forward_flops(cfg, p, p) + sum(forward_flops(cfg, 1, p + t) for t in range(1, len(fast)))
    return Comparison(p, fast, t_slow, t_fast, flops_no_cache, flops_cache)


def plot_step_times(comparison: Comparison):
    """Time of each decoding step against the sequence length at that step (a matplotlib figure)."""
    import matplotlib.pyplot as plt

    positions = [comparison.prompt_len + t for t in range(len(comparison.tokens))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    # The first step of the cached decode is the prompt's prefill: skip it, it is not a decode step.
    ax.plot(positions[1:], [1000 * s for s in comparison.seconds_no_cache[1:]], label="recompute everything")
    ax.plot(positions[1:], [1000 * s for s in comparison.seconds_cache[1:]], label="with KV cache")
    ax.set_xlabel("sequence length at this step (tokens)")
    ax.set_ylabel("time for one new token (ms)")
    ax.set_title("SmolLM2-135M greedy decoding on CPU")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig
