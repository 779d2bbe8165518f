"""Compile every kernel of `kvlearn.kernels` for an H200 (CUDA sm_90) on a machine without a GPU:
Triton's compiler and the ptxas it ships need no device. Run as `python -m tests.kernel_compile` in
a process without TRITON_INTERPRET (interpreted kernels are never compiled); prints one line per
kernel. The interpreter checks what the kernels compute; this checks that a GPU build accepts them."""

import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlearn.kernels import decode, extend, store

H200 = GPUTarget("cuda", 90, 32)
INT64_POINTERS = {"table", "kv_lens", "cu_q", "slot_mapping"}


def kind(name: str, constexpr: bool) -> str:
    """Triton's type for one argument, as the launchers pass them."""
    if constexpr:
        return "constexpr"
    if name in INT64_POINTERS:
        return "*i64"
    if name.startswith("stride") or name == "num_tokens":
        return "i32"
    return "fp32" if name == "scale" else "*fp32"


# The specializations SmolLM2's steps launch: GQA groups of 3, head_dim 64, one split or several.
CASES = [
    (store.store_kernel, dict(HEAD_DIM=64, ROW=192, ROW_P2=256, BLOCK_T=store.BLOCK_T)),
    (decode.decode_kernel, dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=1, NUM_SPLITS=1, BLOCK_H=16, BLOCK_N=decode.BLOCK_N)),
    (decode.decode_kernel, dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=16, NUM_SPLITS=3, BLOCK_H=16, BLOCK_N=decode.BLOCK_N)),
    (decode.decode_reduce_kernel, dict(HEAD_DIM=64, NUM_SPLITS=1, SPLITS_P2=1)),
    (decode.decode_reduce_kernel, dict(HEAD_DIM=64, NUM_SPLITS=3, SPLITS_P2=4)),
    (extend.extend_kernel, dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=1, BLOCK_M=extend.BLOCK_M, BLOCK_N=extend.BLOCK_N)),
]


def main() -> None:
    warnings.simplefilter("ignore")   # Triton 3.9 warns about an unset fp-fusion default
    for kernel, constexprs in CASES:
        signature = {p.name: kind(p.name, p.is_constexpr) for p in kernel.params}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=H200)
        print(kernel.__name__, "cubin" in compiled.asm, compiled.metadata.shared)


if __name__ == "__main__":
    main()
