"""Hugging Face `generate` as the reference every cache strategy must reproduce token for token."""

from functools import cache

import torch


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Greedy continuation by plain `model.generate` with its default cache, stopping at EOS."""
    return list(_hf_greedy(model, tuple(prompt_ids), max_new_tokens))


@cache
def _hf_greedy(model, prompt_ids: tuple, max_new_tokens: int) -> tuple:
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return tuple(out[0, len(prompt_ids):].tolist())
