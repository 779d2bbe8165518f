"""Chapter 5 exercises: one chunk of a chunked prefill (positions, slots, mask). Exercise 1, the
attention part, is judged by `kvlearn.parts.check("attention", ...)`."""

import torch

from kvlearn.attention import AttentionMetadata
from kvlearn.exercises import attempt, report


def _metadata(query_lens, kv_indices):
    return AttentionMetadata.build(query_lens, [torch.tensor(ix) for ix in kv_indices], device="cpu")


# (slots of a whole prompt, start and end of one chunk of it): chunked prefill, one chunk per step.
CHUNK_CASES = [([7, 8, 9, 3, 4, 5, 6], 0, 4), ([7, 8, 9, 3, 4, 5, 6], 4, 7), ([40, 2, 41, 5, 9], 2, 5),
               ([1, 3, 5, 7, 9, 11, 13, 15], 3, 4), ([6], 0, 1)]


def check_chunk(chunk_step) -> bool:
    """Exercise 2: a prompt whose tokens' K/V go to `slots` is prefilled in chunks, one per step.
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
