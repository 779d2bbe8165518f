"""Chapter 10 exercises: a pool's capacity in tokens for a quantized format. (The chapter's build
exercise, your own int8 quantizer, is judged by `kvlearn.parts.check("quantizer", ...)`.)"""

import torch

from kvlearn.exercises import likely_mistake, report
from kvlearn.memory import get_config, kv_bytes_per_token
from kvlearn.quant import SCALE_BYTES

# Exercise 1: Llama-3-8B (32 layers, 8 KV heads of 128) with a 16 GiB pool on a GPU.
MODEL, BUDGET_BYTES = "Llama-3-8B", 16 * 1024 ** 3


def check_int8_capacity(answer: int) -> bool:
    """Exercise 1: how many tokens fit in BUDGET_BYTES of pool with kv_cache_dtype "int8" (one code
    byte per number, and a float32 scale per token, KV head and K or V)."""
    c = get_config(MODEL)
    codes = 2 * c.num_layers * c.num_kv_heads * c.head_dim                # one byte a number
    scales = 2 * c.num_layers * c.num_kv_heads * SCALE_BYTES
    right = BUDGET_BYTES // (codes + scales)
    return report(answer == right and not isinstance(answer, bool), likely_mistake(answer, [
        (BUDGET_BYTES // codes, "that forgets the scales: every stored vector (a token's K or V in one KV "
                                "head of one layer) keeps its float32 scale beside its codes."),
        (BUDGET_BYTES // kv_bytes_per_token(c, torch.bfloat16), "that is the bfloat16 pool: an int8 code is one "
                                                                "byte a number, not two."),
        (BUDGET_BYTES // (codes + scales // c.num_kv_heads), "that keeps one scale per layer for all KV heads: "
                                                             "the pool scales each KV head's "
                                                             "vector by its own absmax."),
        (BUDGET_BYTES // ((codes + scales) // 2), "that counts K alone: V is stored, and scaled, too."),
        (16 * 10 ** 9 // (codes + scales), "that reads 16 GiB as 16 GB: a GiB is 1024 ** 3 bytes, not 10 ** 9.")]) or
        f"bytes per token = 2 (K and V) x layers x KV heads x (head_dim code bytes + {SCALE_BYTES} scale bytes); "
        "the pool holds the budget divided by that, rounded down.")
