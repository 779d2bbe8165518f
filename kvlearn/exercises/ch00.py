"""Chapter 0 exercises: KV bytes, capacity, and the work a cache saves."""

from kvlearn.exercises import report
from kvlearn.memory import GiB, KVConfig, kv_bytes_per_token, tokens_that_fit

import torch

MISTRAL_7B = KVConfig("Mistral-7B", "GQA", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def check_bytes_per_token(answer: int) -> bool:
    """Exercise 1: KV bytes per token of Mistral-7B (32 layers, 8 KV heads of 128) in bf16."""
    return report(answer == kv_bytes_per_token(MISTRAL_7B, torch.bfloat16),
                  "count K and V, every layer, every KV head, head_dim values of 2 bytes each.")


def check_tokens_fit(answer: int) -> bool:
    """Exercise 2: whole tokens of SmolLM2-135M KV (float32) that fit in 2 GiB."""
    return report(answer == tokens_that_fit("SmolLM2-135M", 2 * GiB, torch.float32),
                  "divide the budget by the float32 bytes per token, and round down.")


def check_tokens_fed(prompt_len: int, new_tokens: int, no_cache: int, with_cache: int) -> bool:
    """Exercise 3: how many token positions the model processes in total to produce `new_tokens`
    tokens after a `prompt_len`-token prompt, without and with a KV cache."""
    expected_no_cache = sum(prompt_len + t for t in range(new_tokens))
    expected_cache = prompt_len + new_tokens - 1
    return report((no_cache, with_cache) == (expected_no_cache, expected_cache),
                  "without a cache step t feeds prompt_len + t tokens; with one, the first step feeds the "
                  "prompt and every later step feeds one token.")
