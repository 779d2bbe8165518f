"""What every launcher of `kvlearn.kernels` checks before it hands tensors to a kernel.

A kernel sees bare pointers and the strides it is given: it adds offsets to them, and nothing
stops it from reading or writing past a tensor that is not laid out as it assumes. So each launcher
refuses, with a message, what would make it compute garbage silently.
"""

from __future__ import annotations

import torch


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
