"""The `quantizer` part (chapter 10): the int8 quantize and dequantize of one step's K and V rows. A pool
of kv_cache_dtype "int8" builds it as `quantizer_cls(head_dim)` and stores each row's codes and scale in
the bytes of the format (`kvlearn.quant`); the package's own is `kvlearn.quant.Int8Format`."""

from typing import Protocol

import torch


class QuantizerPart(Protocol):
    """What the int8 pool asks of a quantizer. A row is the last dimension: one token's K (or V) in one KV head.

    Rules: symmetric absmax per row: `scale = absmax / 127` of the row, float32, shape [..., 1];
    `codes = round(x / scale)` (the nearest integer, ties to even, as torch.round) clamped to
    [-127, 127], int8, of x's shape; an all-zero row gives codes 0 and scale 0 (no NaN);
    `dequantize(codes, scale, dtype)` is codes * scale computed in float32, the codes' shape, in
    `dtype`. A row's codes and scale depend on that row alone, and `quantize` does not change x.
    """

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query: (codes, scale) of rows x [..., head_dim] (float32 or bfloat16)."""

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Query: the rows that codes [..., head_dim] and scale [..., 1] stand for, in `dtype`."""
