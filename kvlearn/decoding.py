"""Chapter 0: greedy decoding with and without a KV cache, timed and counted; and what bounds
one decode step.

Without a cache every new token re-runs the model over the whole sequence, so step t costs work
proportional to t (and attention to t squared); with a cache each step feeds one token and reads
the keys and values kept from earlier steps. Both must produce exactly the same tokens.

A decode step of `batch` sequences has three lower bounds on its time (the roofline):
- bytes: every weight is read once per step, and each sequence reads its cached K and V
  (`decode_step_bytes`), at best at the machine's plain read bandwidth (`plain_read_gb_s`);
- FLOPs: 2 per multiply-add, for every weight and every sequence, plus attention (`forward_flops`),
  at best at the machine's matrix-product rate (`matmul_gflop_s`);
- a fixed cost per step: Python and one operator launch per layer operation, whatever the sizes,
  seen alone in a twin of the model with the same layers and tiny widths (`tiny_twin`).
Measured step times at several batch sizes fit `time = fixed + per_seq * batch` (`fit_step_cost`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvlearn.errors import check_int, check_positive_int
from kvlearn.memory import kv_bytes_per_token
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


def weight_params(config) -> int:
    """Weights one token is multiplied by: the attention projections and MLP of every layer, and
    the LM head (norms and the embedding lookup are negligible)."""
    d, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * hd * 2 + d * kv_heads * hd * 2 + 3 * d * config.intermediate_size
    return config.num_hidden_layers * per_layer + d * config.vocab_size


def forward_flops(config, num_new: int, num_context: int) -> int:
    """Approximate FLOPs of one forward that computes `num_new` tokens at the end of a `num_context`-token
    sequence: 2 per multiply-add in the projections and MLP of each new token, plus attention scores and
    weighted sums over the positions each new token can see (causal)."""
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    seen = num_new * (num_context - num_new) + num_new * (num_new + 1) // 2  # query-key pairs
    attention = 2 * 2 * config.num_hidden_layers * heads * hd * seen
    return 2 * num_new * weight_params(config) + attention


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


# --- the roofline of one decode step -------------------------------------------------------------

def weight_bytes(model) -> int:
    """Bytes of the weights one forward multiplies by: every linear layer, the LM head included
    (a tied embedding is read through the LM head; the embedding rows and norms are negligible)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Linear))


class StepBytes(NamedTuple):
    weights: int  # read once per step, whatever the batch
    kv: int       # every sequence's K and V

    @property
    def total(self) -> int:
        return self.weights + self.kv


def decode_step_bytes(model, batch: int, context: int) -> StepBytes:
    """What a decode step of `batch` sequences reads when each new token attends to `context`
    positions (its own included): the weights once, whatever the batch, and context tokens' K and V
    per sequence, in the model's dtype."""
    check_positive_int("batch", batch)
    check_positive_int("context", context)
    return StepBytes(weight_bytes(model), batch * context * kv_bytes_per_token(model.config, model.dtype))


def _best_seconds(fn, rounds: int) -> float:
    """The fastest of `rounds` calls after one untimed call: other work only ever slows a call down."""
    check_positive_int("rounds", rounds)
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def plain_read_gb_s(nbytes: int = 256 * 2 ** 20, rounds: int = 5) -> float:
    """Bandwidth of a plain `sum` over `nbytes` of float32 (best of `rounds`; the memory, not a CPU
    cache, for sizes of the weights): no step that reads as many bytes can beat it."""
    check_positive_int("nbytes", nbytes)
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_seconds(lambda: block.sum().item(), rounds) / 1e9


def matmul_gflop_s(n: int = 1024, rounds: int = 5) -> float:
    """Rate of a square n x n float32 matrix product (2 n^3 FLOPs, best of `rounds`): what the
    machine's matrix units reach on a product large enough to keep them busy."""
    check_positive_int("n", n)
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    return 2 * n ** 3 / _best_seconds(lambda: (a @ a)[0, 0].item(), rounds) / 1e9


def tiny_twin(config):
    """A randomly initialised model with `config`'s layers, heads and operators but tiny widths: a
    forward pass runs the same Python and launches the same operators while reading and computing
    almost nothing, so its time is the fixed cost of a step."""
    from transformers import AutoModelForCausalLM

    small = dict(config.to_dict(), hidden_size=4 * config.num_attention_heads, head_dim=4, intermediate_size=8,
                 vocab_size=256)  # the same layers, query and KV heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(type(config).from_dict(small)).eval()


@torch.no_grad()
def time_decode_step(model, batch: int, context: int, rounds: int = 5) -> float:
    """Seconds of one decode step of `batch` sequences whose new token attends to `context`
    positions (a prefill of `context - 1` tokens first, through transformers' DynamicCache): the
    fastest of `rounds` steps, each one cropped off the cache again."""
    from transformers import DynamicCache

    check_positive_int("batch", batch)
    check_int("context", context, 2, " (a prefill, then the timed token)")
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.full((batch, context - 1), 5, device=model.device), cache=cache, use_cache=True)
    new = torch.full((batch, 1), 7, device=model.device)

    def step():
        model(input_ids=new, cache=cache, use_cache=True)
        cache.crop(-1)
    return _best_seconds(step, rounds)


@dataclass(frozen=True)
class StepCost:
    """time = fixed_s + per_seq_s * batch: the least-squares line through measured decode steps."""

    fixed_s: float
    per_seq_s: float

    def seconds(self, batch: int) -> float:
        return self.fixed_s + self.per_seq_s * batch

    def tokens_per_s(self, batch: int) -> float:
        """Decode throughput: one token per sequence per step."""
        return batch / self.seconds(batch)

    def __repr__(self) -> str:
        return f"StepCost({self.fixed_s * 1e3:.1f} ms per step + {self.per_seq_s * 1e3:.2f} ms per sequence)"


def fit_step_cost(seconds_by_batch: dict[int, float]) -> StepCost:
    """Fit `time = fixed + per_seq * batch` by least squares to {batch: seconds of one step}
    (at least two different batch sizes)."""
    if not isinstance(seconds_by_batch, dict) or len(seconds_by_batch) < 2:
        raise ValueError("give the step time of at least two different batch sizes, as {batch: seconds}.")
    xs, ys = list(seconds_by_batch), list(seconds_by_batch.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return StepCost(my - slope * mx, slope)
