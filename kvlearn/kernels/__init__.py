"""Chapter 5 done the GPU's way: the KV write and paged attention as Triton kernels.

Three kernels, in the anchors' words: `store_kvcache` (`kvlearn.kernels.store`) writes a step's K
and V at `slot_mapping`; `paged_decode_attention` (`.decode`) attends one new token per sequence
over its pages; `extend_attention` (`.extend`) attends a prefill or chunk over the cached prefix and
causally among the new tokens. `kvlearn.kernels.backend.triton_paged_attention` puts them together
behind chapter 5's attention signature, so they serve the model through the same registered
attention function as `kvlearn.attention.paged_attention`.

Which one serves is the engine's `attention_backend` option (as SGLang's `--attention-backend`):
"torch" (chapter 5's `paged_attention`), "triton" (the kernels), or "auto" (triton on CUDA when
triton imports, torch otherwise). Triton compiles for GPUs; on a CPU its kernels run only in its
interpreter (`TRITON_INTERPRET=1` in the environment before triton is first imported), which
executes each program in numpy: exact, and slow, for tests and small examples.

Every launcher refuses what its kernel cannot run (wrong shapes, dtypes, slots or lengths) with a
message that names the argument, before the kernel could crash or compute garbage: the rules are
in `kvlearn.kernels.common`. Range checks read the tensors' values, a device sync on CUDA, so
there they run only after `kvlearn.kernels.common.check_ranges(True)` (gpu-check turns them on).

This module imports no triton itself: `import kvlearn.kernels` works where triton is missing.
`DECODE_KERNEL` names the worked stage-1 decode kernel (the registry's "decode_kernel" part) without
importing it: `LazyKernel` imports its module when first used.
"""

from __future__ import annotations

import os
from functools import partial
from importlib import import_module

import torch

from kvlearn.attention import paged_attention
from kvlearn.errors import PartError, check_choice

ATTENTION_BACKENDS = ("torch", "triton", "auto")


def interpret_here() -> None:
    """Ask for Triton's interpreter where there is no GPU (it must come before triton's first import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_import_error() -> str | None:
    """None when `import triton` works here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def resolve_attention_backend(name: str, device) -> str:
    """"torch" or "triton" for `attention_backend=name` on `device`; "auto" is triton on CUDA when
    triton imports, torch otherwise. ValueError (what to do) when "triton" cannot run there: triton
    missing, or a CPU whose kernels are not interpreted (`kvlearn.kernels.common.check_launch`)."""
    check_choice("attention_backend", name, ATTENTION_BACKENDS)
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if on_cuda and triton_import_error() is None else "torch"
    if name == "triton":
        why = triton_import_error()
        if why is not None:
            raise ValueError(f"attention_backend='triton' needs the triton package, which does not import here "
                             f"({why}). Triton ships wheels for Linux only: `pip install triton` there, or use "
                             "attention_backend='torch'.")
        from kvlearn.kernels.common import check_launch

        check_launch(device)
    return name


def attention_function(backend: str, pool):
    """The attention function (chapter 5's signature) of a resolved backend, "torch" or "triton", over
    `pool`: for "torch", chapter 5's, or the one the pool's format brings (`format.attention_for(pool)`:
    chapter 10's int4, which may refuse the pool)."""
    if backend == "torch":
        own = getattr(pool.format, "attention_for", None)
        return paged_attention if own is None else own(pool)
    from kvlearn.kernels.backend import triton_paged_attention

    return triton_paged_attention


def stage1_attention(kernel):
    """The Triton attention with `kernel` (a learner's part) as the decode's stage 1; ValueError where
    Triton cannot run here, TypeError for what is not a kernel with the worked kernel's parameters.
    In the interpreter, an access outside `kvlearn.kernels.decode_rules` raises `PartError` before it is made."""
    resolve_attention_backend("triton", "cuda" if torch.cuda.is_available() else "cpu")
    from kvlearn.kernels.backend import triton_paged_attention
    from kvlearn.kernels.common import check_kernel
    from kvlearn.kernels.watch import AddressError

    attend = partial(triton_paged_attention, stage1=check_kernel("parts['decode_kernel']", kernel,
                                                                 like=DECODE_KERNEL.kernel))

    def attention(query, key, value, layer, kv_pool, md, scale=None):
        try:
            return attend(query, key, value, layer, kv_pool, md, scale)
        except AddressError as error:
            raise PartError("decode_kernel", kernel, f"attention(layer {layer}, {query.shape[0]} tokens)",
                            "nothing: it was stopped before an access", f"{error}, which its rules forbid "
                            "(kvlearn.kernels.decode_rules)") from None

    attention.__qualname__ = kernel.__name__
    return attention


class LazyKernel:
    """A kernel of this package, imported (with triton) when first used: `.kernel` is it; indexing
    (`lazy[grid]`) and its other attributes are the kernel's. Launchers take it as the kernel itself."""

    def __init__(self, module: str, name: str):
        self.__module__, self.__qualname__, self.__name__ = module, name, name

    @property
    def kernel(self):
        return getattr(import_module(self.__module__), self.__name__)

    def __getitem__(self, grid):
        return self.kernel[grid]

    def __call__(self, *args, **kwargs):
        return self.kernel(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):   # asked without importing: it has none
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        return f"<{self.__module__}.{self.__name__}, imported when first used>"


DECODE_KERNEL = LazyKernel("kvlearn.kernels.decode", "decode_kernel")
