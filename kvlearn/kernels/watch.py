"""Every address an interpreted kernel touches, seen before the access is made.

A kernel adds offsets to bare pointers, and nothing stops a wrong offset: on a GPU it reads another
tensor's numbers or faults, and Triton's interpreter, whose loads and stores read and write memory at
the computed addresses directly (in C++), can end the whole Python process with a segfault. The
interpreter runs every memory access of a kernel through a few methods of one builder object:
`create_masked_load` and `create_masked_store` (an unmasked `tl.load` is a masked one with every lane
on, and tensor descriptors end there too), and two for atomics. `watch(see)` swaps them for the
duration of a `with` block: before each access, `see(kind, program, addresses)` gets "load" or
"store", the program's grid index and the addresses the mask lets through (int64 numpy). It may
raise, and then the access never happens. Triton-Viz records kernels the same way.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


class AddressError(ValueError):
    """A kernel in the interpreter was about to touch an address it must not; `rule` names the rule
    it broke (for a hint), and the message says which program, which address and the likely cause."""

    def __init__(self, message: str, rule: str):
        super().__init__(message)
        self.rule = rule


@contextmanager
def watch(see):
    """Within the block, call `see(kind, program, addresses)` before every interpreted load
    ("load") and store or atomic ("store"); what `see` raises stops the kernel before the access."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not isinstance(builder, interpreter.InterpreterBuilder):
        raise ValueError("watch needs kernels run in Triton's interpreter (TRITON_INTERPRET=1).")

    def seen(kind, ptrs, mask):
        on = np.broadcast_to(mask.data, ptrs.data.shape) if mask is not None else np.ones(ptrs.data.shape, bool)
        see(kind, tuple(builder.grid_idx), ptrs.data[on].astype(np.int64).ravel())

    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    before, outer = dict(vars(builder)), {name: getattr(builder, name) for name in names}   # a watch may nest

    def load(ptrs, mask, *rest):
        seen("load", ptrs, mask)
        return outer["create_masked_load"](ptrs, mask, *rest)

    def store(ptrs, value, mask, *rest):
        seen("store", ptrs, mask)
        return outer["create_masked_store"](ptrs, value, mask, *rest)

    def atomic_rmw(op, ptr, value, mask, *rest):
        seen("store", ptr, mask)
        return outer["create_atomic_rmw"](op, ptr, value, mask, *rest)

    def atomic_cas(ptr, *rest):
        seen("store", ptr, None)
        return outer["create_atomic_cas"](ptr, *rest)

    vars(builder).update(zip(names, (load, store, atomic_rmw, atomic_cas), strict=True))
    try:
        yield
    finally:
        for name in names:   # what was there before: an outer watch's, or the class's methods
            if name in before:
                vars(builder)[name] = before[name]
            else:
                vars(builder).pop(name, None)


class Spans:
    """The memory of a launch's tensors, by name (`names`): `where(addresses)` gives, per address, the
    index in `names` of the tensor that holds it (-1: none), `elements` its element index there."""

    def __init__(self, **tensors: torch.Tensor):
        self.tensors, self.names = tensors, list(tensors)
        extents = [1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
                   for t in tensors.values()]
        self.starts = np.array([t.data_ptr() for t in tensors.values()], dtype=np.int64)
        self.sizes = np.array([t.element_size() for t in tensors.values()], dtype=np.int64)
        self.ends = self.starts + np.array(extents, dtype=np.int64) * self.sizes

    def where(self, addresses: np.ndarray) -> np.ndarray:
        inside = (addresses[:, None] >= self.starts) & (addresses[:, None] < self.ends)
        return np.where(inside.any(1), inside.argmax(1), -1)

    def elements(self, addresses: np.ndarray, name: str) -> np.ndarray:
        i = self.names.index(name)
        return (addresses - self.starts[i]) // self.sizes[i]

    def nearest(self, address: int) -> tuple[str, str]:
        """(name, where) of the tensor nearest an address outside them all: ("k_cache", "row 530 of its
        512"), a row being an index of its first dimension."""
        i = int(np.argmin(np.minimum(abs(address - self.starts), abs(address - self.ends))))
        name, t = self.names[i], self.tensors[self.names[i]]
        element = int(self.elements(np.array([address]), name)[0])
        if t.dim() > 1:
            return name, f"row {element // t.stride(0)} of its {t.shape[0]}"
        return name, f"element {element} of its {t.numel()}"
