"""Chapter 5 exercises: one chunk of a chunked prefill (positions, slots, mask), the packed mask, prefix reuse."""

import torch

from kvlearn.attention import AttentionMetadata
from kvlearn.exercises import attempt, report

# (new tokens per sequence, context slots per sequence): prefill, decode, prefill after a cached prefix.
CASES = [
    ([3], [[7, 8, 9]]),
    ([1, 1], [[4, 2, 0], [5]]),
    ([3, 1, 2], [[10, 11, 12], [0, 1, 2, 3, 4], [20, 21, 22, 23]]),
    ([2, 4], [[9, 3, 6, 1, 5, 8], [2, 4, 7, 30]]),
]


def _metadata(query_lens, kv_indices):
    return AttentionMetadata.build(query_lens, [torch.tensor(ix) for ix in kv_indices], device="cpu")


# (slots of a whole prompt, start and end of one chunk of it): chunked prefill, one chunk per step.
CHUNK_CASES = [([7, 8, 9, 3, 4, 5, 6], 0, 4), ([7, 8, 9, 3, 4, 5, 6], 4, 7), ([40, 2, 41, 5, 9], 2, 5),
               ([1, 3, 5, 7, 9, 11, 13, 15], 3, 4), ([6], 0, 1)]


def check_chunk(chunk_step) -> bool:
    """Exercise 1: a prompt whose tokens' K/V go to `slots` is prefilled in chunks, one per step.
    `chunk_step(slots, start, end)` returns, for the chunk of prompt tokens start..end-1, its
    positions, its slot_mapping and its mask (a bool [end - start, end]: may chunk token i see the
    key at position j?)."""
    for slots, start, end in CHUNK_CASES:
        md = _metadata([end - start], [slots[:end]])
        got, error = attempt(chunk_step, list(slots), start, end)
        parts, _ = attempt(lambda: (list(got[0]), list(got[1]), torch.as_tensor(got[2], dtype=torch.bool)))
        if error or parts is None:
            return report(False, error or f"return (positions, slot_mapping, mask), got {got!r}.")
        positions, slot_mapping, mask = parts
        if positions != md.positions.tolist() or slot_mapping != md.slot_mapping.tolist():
            return report(False, f"slots={slots}, chunk {start}..{end - 1}: positions {md.positions.tolist()} and "
                          f"slot_mapping {md.slot_mapping.tolist()}, you gave {positions} and {slot_mapping}. The "
                          "chunk's tokens keep their place in the prompt.")
        if mask.shape != (end - start, end) or not torch.equal(mask, md.mask[0, 0, :end - start, :end].cpu()):
            return report(False, f"slots={slots}, chunk {start}..{end - 1}: the mask is [chunk tokens, context], "
                          "and the context is the earlier chunks' tokens plus this chunk's (causal inside it).")
    return report(True, "")


def check_mask(build_mask) -> bool:
    """Exercise 2: `build_mask(query_lens, kv_lens)` returns a bool tensor [B, Qmax, Lmax]: may the
    i-th new token of sequence b attend to the key at position j? (Rows past query_lens[b] are
    padding and are not checked.)"""
    for query_lens, kv_indices in CASES:
        md = _metadata(query_lens, kv_indices)
        kv_lens = [len(ix) for ix in kv_indices]
        got, error = attempt(build_mask, list(query_lens), kv_lens)
        if error is None and not isinstance(got, torch.Tensor):
            error = f"return a torch.Tensor, got {type(got).__name__}"
        if error is None and got.shape != md.mask[:, 0].shape:
            error = f"expected shape {tuple(md.mask[:, 0].shape)}, got {tuple(got.shape)}"
        if error:
            return report(False, f"query_lens={query_lens}, kv_lens={kv_lens}: {error}.")
        for b, q in enumerate(query_lens):
            if not torch.equal(got[b, :q].bool(), md.mask[b, 0, :q]):
                return report(False, f"query_lens={query_lens}, kv_lens={kv_lens}, sequence {b}: expected "
                              f"{md.mask[b, 0, :q].int().tolist()}, got {got[b, :q].int().tolist()}. A new token "
                              "sees its own position and everything before it, never the padding.")
    return report(True, "")


def check_tokens_to_compute(tokens_to_compute) -> bool:
    """Exercise 3: request A's prompt K/V is in the pool. `tokens_to_compute(cached, prompt)` returns
    how many of request B's prompt tokens its prefill must still run through the model."""
    cases = [([1, 2, 3, 4], [1, 2, 3, 9, 9]), ([1, 2, 3], [4, 5]), ([1, 2, 3], [1, 2, 3]),
             ([1, 2, 3, 4, 5], [1, 2]), ([7], [7, 7, 7])]
    for cached, prompt in cases:
        common = next((i for i, (x, y) in enumerate(zip(cached, prompt)) if x != y), min(len(cached), len(prompt)))
        expected = len(prompt) - min(common, len(prompt) - 1)  # the last token always runs: we need its logits
        got, error = attempt(tokens_to_compute, list(cached), list(prompt))
        if error or got != expected:
            return report(False, error or f"cached={cached}, prompt={prompt}: expected {expected}, got {got}. "
                          "Reuse the common prefix, but the model must still run B's last token.")
    return report(True, "")
