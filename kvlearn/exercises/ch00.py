"""Chapter 0 exercises: KV bytes per token, and reasoning with the roofline of a decode step."""

import math

import torch

from kvlearn.decoding import StepCost
from kvlearn.exercises import likely_mistake, report
from kvlearn.memory import KVConfig, kv_bytes_per_token

MISTRAL_7B = KVConfig("Mistral-7B", "GQA", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)

# Exercise 2's GPU: an H100 SXM's data sheet, dense bf16 matrix products and HBM3 bandwidth.
GPU_TFLOP_S, GPU_TB_S = 989, 3.35


def _number(answer) -> float | None:
    """The answer as a float, or None for a stub (None, `...`) or anything that is not a number."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return None
    return float(answer)


def check_bytes_per_token(answer: int) -> bool:
    """Exercise 1: KV bytes per token of Mistral-7B (32 layers, 8 KV heads of 128) in bf16."""
    c = MISTRAL_7B
    right = kv_bytes_per_token(c, torch.bfloat16)   # 2 (K and V) x layers x KV heads x head_dim x 2 bytes
    return report(answer == right and not isinstance(answer, bool), likely_mistake(answer, [
        (right // c.num_kv_heads * c.num_heads, "that counts the 32 query heads: K and V are kept per KV head, 8 "
                                                "of them (grouped-query attention)."),
        (right // 2, "that is K or V alone: the cache keeps both."),
        (right * 2, "that counts 4 bytes per value: a bf16 value is 2 bytes."),
        (right // c.num_layers, "that is one layer: every layer keeps its own K and V.")]) or
        "count K and V, every layer, every KV head, head_dim values of 2 bytes each.")


def check_gpu_batch(answer) -> bool:
    """Exercise 2: the smallest batch at which a decode step of a bf16 model on the GPU above
    takes at least as long to multiply its weights (2 FLOPs per weight per sequence, at
    GPU_TFLOP_S) as to read them (2 bytes per weight, at GPU_TB_S); KV and attention ignored."""
    crossover = GPU_TFLOP_S / GPU_TB_S  # FLOPs per byte read at batch b: 2b / 2 = b
    value = _number(answer)
    if value is None:
        return report(False, "give a number: the batch size b at which the two times are equal.")
    if abs(value - 2 * crossover) <= 0.02 * crossover:
        return report(False, "that counts 4 bytes per weight: a bf16 weight is 2 bytes.")
    if abs(value - crossover / 2) <= 0.02 * crossover:
        return report(False, "each weight is a multiply-add per sequence: 2 FLOPs, not 1.")
    return report(abs(value - crossover) <= 0.02 * crossover,
                  "write both times for a batch of b with P weights: one reads 2P bytes, the other does "
                  "2P FLOPs per sequence. Set them equal: what happens to P?")


def reference_step() -> StepCost:
    """Exercise 3's fit of a decode step: chapter 7's committed time model (the course's reference
    CPU, the date in its `measured_on`): its fixed cost per step and its cost per decode sequence."""
    from kvlearn.routing.timemodel import default_time_model

    model = default_time_model()
    return StepCost(model.overhead_s, model.decode_s_per_seq)


def check_half_throughput(limit_tok_s, batch) -> bool:
    """Exercise 3: under `reference_step()`, the decode tokens/s that bigger batches approach
    (`limit_tok_s`), and the smallest whole batch whose tokens/s reach half of it (`batch`)."""
    cost = reference_step()
    want_limit = 1 / cost.per_seq_s
    want_batch = math.ceil(cost.fixed_s / cost.per_seq_s)
    limit = _number(limit_tok_s)
    if limit is None or abs(limit - want_limit) > 0.02 * want_limit:
        return report(False, "a step of b sequences makes b tokens in fixed + per_seq * b seconds: what does "
                             "b / (that time) tend to as b grows? (answer in tokens per second)")
    if batch == want_batch - 1:
        return report(False, "close: at that batch the throughput is still just below half; the smallest "
                             "whole batch that reaches it is one more.")
    return report(batch == want_batch and not isinstance(batch, bool),
                  "write the throughput at batch b, set it equal to half the limit and solve for b; then "
                  "round to the whole batch that reaches it.")
