"""Copies of the worked stage-1 decode kernel, as a learner writes them: `kernel_copy(folder, old, new)`
saves `decode_kernel`'s source with `old` replaced by `new` as a module of its own and returns its
kernel (Triton reads a kernel's source from its file, so each copy needs one)."""

import importlib.util
import inspect
import itertools
from pathlib import Path

_count = itertools.count()


def kernel_source() -> str:
    """The module text of the worked `decode_kernel` alone, with the imports it needs."""
    from kvlearn.kernels import decode

    text = inspect.getsource(decode)
    start = text.index('@triton.jit(do_not_specialize=["num_splits", "stride_tb"])')
    end = text.index("@triton.jit", start + 1)
    return "import triton\nimport triton.language as tl\n\n\n" + text[start:end]


def kernel_copy(folder: Path, old: str = "", new: str = ""):
    """The worked kernel with `old` replaced by `new` (they must occur), from a module in `folder`."""
    text = kernel_source()
    assert old in text, old
    name = f"kernel_copy_{next(_count)}"
    path = Path(folder) / f"{name}.py"
    path.write_text(text.replace(old, new, 1) if old else text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_kernel
