"""Compile every kernel of `kvlearn.kernels` for an H200 (CUDA sm_90) on a machine without a GPU:
Triton's compiler and the ptxas it ships need no device. Run as `python -m tests.kernel_compile` in
a process without TRITON_INTERPRET (interpreted kernels are never compiled); prints one line per
compiled kernel: its name and variant, whether machine code was made, its shared memory in bytes,
and whether its PTX multiplies on the tensor cores (mma). The interpreter checks what the kernels
compute; this checks that a GPU build accepts them, with the launchers' warps and stages."""

import warnings

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlearn.kernels import decode, extend, store
from kvlearn.kernels.common import dot_dtype, tile

H200 = GPUTarget("cuda", 90, 32)
INDEX_POINTERS = {"table", "kv_lens", "cu_q", "slot_mapping"}
FLOAT32_POINTERS = {"part_out", "part_lse"}
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32"}
GROUP, KV_HEADS = 3, 3   # SmolLM2: 9 query heads over 3 KV heads
# (head_dim, cache dtype, index dtype, the decode kernel's page sizes, whether store and stage 2 too):
# SmolLM2's; head_dim 80 (tiles padded to 128) with an int32 table; 96 with a bfloat16 cache
# (products on the tensor cores); 8 (padded to 16, tl.dot's smallest). A compile takes a second or
# two: the attention kernels for every variant, the others where their tiles change.
VARIANTS = [(64, torch.float32, torch.int64, (1, 16), True), (80, torch.float32, torch.int32, (1,), True),
            (96, torch.bfloat16, torch.int64, (1,), False), (8, torch.float32, torch.int64, (1,), False)]


def kind(name: str, constexpr: bool, floats: torch.dtype, index: torch.dtype, int8: bool) -> str:
    """Triton's type for one argument, as the launchers pass them (`int8`: an int8 pool's codes and
    scales; else k_scale and v_scale are the unused k_cache)."""
    if constexpr:
        return "constexpr"
    if name in INDEX_POINTERS:
        return "*" + TRITON_TYPES[index]
    if name.startswith("stride") or name in ("num_tokens", "num_splits"):
        return "i32"
    if name == "scale":
        return "fp32"
    if int8 and name in ("k_cache", "v_cache", "k_codes", "v_codes"):
        return "*i8"
    return "*fp32" if name in FLOAT32_POINTERS or int8 and name.endswith("_scale") else "*" + TRITON_TYPES[floats]


def cases():
    """(kernel, variant, cache dtype, index dtype, constexprs, launch options), as the launchers
    specialize them for SmolLM2's steps and for each variant."""
    for head_dim, floats, index, pages, all_kernels in VARIANTS:
        variant = f"hd{head_dim},{TRITON_TYPES[floats]},{TRITON_TYPES[index]}"
        row = KV_HEADS * head_dim
        attention = dict(GROUP=GROUP, HEAD_DIM=head_dim, DOT_DTYPE=dot_dtype(floats), BLOCK_D=tile(head_dim),
                         BLOCK_N=decode.BLOCK_N)
        if all_kernels:
            yield (store.store_kernel, variant, floats, index, dict(HEAD_DIM=head_dim, ROW=row,
                   ROW_P2=triton.next_power_of_2(row), BLOCK_T=store.BLOCK_T), store.LAUNCH)
            yield (decode.decode_reduce_kernel, variant, floats, index, dict(HEAD_DIM=head_dim,
                   BLOCK_D=tile(head_dim), BLOCK_S=decode.MAX_SPLITS), decode.STAGE2_LAUNCH)
        for page_size in pages:
            yield (decode.decode_kernel, f"{variant},page{page_size}", floats, index,
                   dict(attention, PAGE_SIZE=page_size, BLOCK_H=tile(GROUP)), decode.STAGE1_LAUNCH)
        yield (extend.extend_kernel, variant, floats, index, dict(attention, PAGE_SIZE=1, QUANTIZED=False,
               BLOCK_M=extend.BLOCK_M), extend.LAUNCH)
    # SmolLM2 on an int8 pool (chapter 10): quantized in the store, dequantized in extend's tile load.
    variant, head_dim = "hd64,fp32,i64,int8", 64
    yield (store.store_int8_kernel, variant, torch.float32, torch.int64,
           dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_T=store.BLOCK_T), store.LAUNCH)
    yield (extend.extend_kernel, variant, torch.float32, torch.int64,
           dict(GROUP=GROUP, HEAD_DIM=head_dim, DOT_DTYPE=dot_dtype(torch.float32), BLOCK_D=tile(head_dim),
                BLOCK_N=extend.BLOCK_N, PAGE_SIZE=1, QUANTIZED=True, BLOCK_M=extend.BLOCK_M), extend.LAUNCH)


def main() -> None:
    warnings.simplefilter("ignore")   # Triton 3.9 warns about an unset fp-fusion default
    for kernel, variant, floats, index, constexprs, options in cases():
        signature = {p.name: kind(p.name, p.is_constexpr, floats, index, variant.endswith("int8"))
                     for p in kernel.params}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=H200, options=options)
        print(f"{kernel.__name__}[{variant}]", "cubin" in compiled.asm, compiled.metadata.shared,
              "mma" in compiled.asm["ptx"])


if __name__ == "__main__":
    main()
