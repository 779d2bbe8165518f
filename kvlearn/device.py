"""Which device tensors go to: cuda when present, else cpu. Every chapter runs on either."""

from __future__ import annotations

import torch


def resolve_device(device) -> torch.device:
    """Turn None (cuda when present, else cpu) / str / torch.device into a usable torch.device, or
    say why not."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda', 'cuda:0' or None (auto).") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Device {device!r} asked for, but CUDA is not available here: use 'cpu' or None.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"Device type {dev.type!r} is not supported by kvlearn: use 'cpu' or 'cuda'.")
    return dev
