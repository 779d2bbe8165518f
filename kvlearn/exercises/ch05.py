"""Chapter 5 exercises: one chunk of a chunked prefill (positions, slots, mask). Exercise 1, the
attention part, is judged by `kvlearn.parts.check("attention", ...)`."""

import torch

from kvlearn.attention import AttentionMetadata
from kvlearn.exercises import attempt, given, likely_mistake, report


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
        shown = given(slots=slots, start=start, end=end)
        got, error = attempt(chunk_step, list(slots), start, end, shown=shown)
        parts, _ = attempt(lambda got=got: (list(got[0]), list(got[1]), torch.as_tensor(got[2], dtype=torch.bool)),
                           shown=shown)
        if error or parts is None:
            return report(False, error or f"{shown}: return (positions, slot_mapping, mask), got {got!r}.")
        positions, slot_mapping, mask = parts
        if positions != md.positions.tolist():
            return report(False, f"{shown}: positions {md.positions.tolist()}, you gave {positions}. " + (
                likely_mistake(positions, [(list(range(end - start)), "A chunk's tokens keep their place in the "
                                                                     "prompt: the first is at position start.")]) or
                "Token i of the chunk is prompt token start + i."))
        if slot_mapping != md.slot_mapping.tolist():
            return report(False, f"{shown}: slot_mapping {md.slot_mapping.tolist()}, you gave {slot_mapping}. " + (
                likely_mistake(slot_mapping, [(list(slots[:end]), "That is the whole context's slots: slot_mapping "
                                                                 "lists where this chunk's new tokens go.")]) or
                "The chunk's new tokens go to slots[start:end]."))
        if mask.shape != (end - start, end):
            return report(False, f"{shown}: the mask is [chunk tokens, context] = [{end - start}, {end}], yours is "
                          f"{list(mask.shape)}: the context is the earlier chunks' tokens plus this chunk's.")
        if not torch.equal(mask, md.mask[0, 0, :end - start, :end].cpu()):
            within = torch.zeros(end - start, end, dtype=torch.bool)
            within[:, start:] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
            return report(False, f"{shown}: the mask should be {md.mask[0, 0, :end - start, :end].int().tolist()}. " + (
                likely_mistake(mask.tolist(), [(within.tolist(), "A chunk token sees every earlier chunk's tokens "
                                                                 "too: their K and V are in the pool.")]) or
                "Chunk token i sits at position start + i and sees every position up to its own."))
    return report(True, "")
