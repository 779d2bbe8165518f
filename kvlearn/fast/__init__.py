"""The engine's fast path (chapter 6): chapter 5's packed step, computed faster on CPU.

- `packed`: `FastLlama`, the model's weights copied once into fewer, faster products, and the
  Llama layer loop over the KV pool;
- `attention`: `FastStep` and `fast_paged_attention`, chapter 5's paged attention with sequences
  grouped by length and a shared prefix read once (cascade).

The same tokens as the plain path (tests/test_fast.py). The engine hands it to the runner
(`ModelRunner(model, pool, model_forward=FastLlama(model).forward)` is what `Engine(..., fast=True)`
builds); chapters 1-5 never import it.
"""

from kvlearn.fast.packed import PACK_ROWS_HINT, FastLlama, PackedLinear, mkldnn_usable

__all__ = ["PACK_ROWS_HINT", "FastLlama", "PackedLinear", "mkldnn_usable"]
