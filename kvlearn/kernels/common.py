"""What every launcher of `kvlearn.kernels` checks before it hands tensors to a kernel.

A kernel sees bare pointers and the strides it is given: it adds offsets to them, and nothing
stops it from reading or writing past a tensor that is not laid out as it assumes. So each launcher
refuses, with a message, what would make it compute garbage silently.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction

# Whether this process's kernels run in Triton's interpreter: `triton.jit` decides when it wraps a
# kernel, by TRITON_INTERPRET at that moment (the kernels of kvlearn.kernels are wrapped when their
# modules are first imported, right after this one). The helpers of triton.language that they call
# (tl.max, tl.sum, tl.cdiv) were wrapped when triton itself was first imported, and must agree.
INTERPRETED = bool(knobs.runtime.interpret)
LANGUAGE_INTERPRETED = isinstance(tl.max, InterpretedFunction)


def check_launch(device) -> None:
    """ValueError, saying what to do, when the kernels cannot run on `device` in this process: on a
    CPU they must be interpreted, and interpreted kernels need triton.language's helpers interpreted."""
    if INTERPRETED and not LANGUAGE_INTERPRETED:
        raise ValueError("TRITON_INTERPRET=1 was set after triton was first imported (loading a model imports it), "
                         "so triton's own helpers were built for a GPU and the interpreter cannot run the kernels: set "
                         "it before anything imports triton, in the environment before Python starts or first thing "
                         "in the notebook (then restart its kernel).")
    if torch.device(device).type != "cuda" and not INTERPRETED:
        raise ValueError("Triton's kernels were built for a GPU in this process (TRITON_INTERPRET was not set when "
                         "kvlearn.kernels was first imported), so they cannot run on the CPU: set TRITON_INTERPRET=1 "
                         "before Python starts (in a notebook: restart the kernel), or use attention_backend='torch'.")


def check_rows(**tensors: torch.Tensor) -> None:
    """ValueError unless each tensor's last dimension is contiguous (stride 1): the kernels step
    through head_dim one number at a time and take the other strides as arguments."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                             f"{tuple(t.stride())}: pass {name}.contiguous().")


def check_same_device(**tensors: torch.Tensor) -> None:
    """ValueError unless all tensors are on one device (a kernel runs where its data is)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"The tensors are on different devices ({devices}): put them on one device.")
