"""Progress bars that suit where they are read.

In a terminal or in Jupyter a bar redraws itself in place. Anywhere else (`make demo > log`, CI, a
pipe) every redraw would stay in the log as a line of its own, so there a bar writes one line, its
final state, when it closes. Every bar kvlearn draws comes from `progress_bar`; `library_bars()`
makes the bars transformers draws (converting the model: "Converting and de-quantizing GGUF
tensors", "Loading weights", "Writing model shards") behave the same.
"""

from __future__ import annotations

import contextlib
import sys

from tqdm import std


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (where tqdm.auto draws a widget)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def live(file=None) -> bool:
    """Whether a bar written to `file` (default stderr, where tqdm writes) can redraw in place."""
    file = sys.stderr if file is None else file
    isatty = getattr(file, "isatty", None)
    return in_notebook() or bool(isatty and isatty())


class LogBar(std.tqdm):
    """A tqdm bar that writes nothing while it runs and one line, its final state, when it closes."""

    def __init__(self, *args, **kwargs):
        kwargs.update(mininterval=float("inf"), maxinterval=float("inf"), delay=float("inf"))
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        return True   # nothing while it runs (set_postfix and refresh draw through here)

    def close(self):
        if not getattr(self, "disable", True):
            self._ema_dt = lambda: None   # the overall rate, as tqdm's last line shows it
            self.fp.write(str(self) + "\n")
            self.fp.flush()
        super().close()


def progress_bar(iterable=None, **options):
    """A tqdm bar (tqdm's options): live in a terminal and in Jupyter, one line when it closes
    anywhere else."""
    if live(options.get("file")):
        from tqdm.auto import tqdm

        return tqdm(iterable, **options)
    return LogBar(iterable, **options)


@contextlib.contextmanager
def library_bars():
    """Within: the progress bars transformers draws come from `progress_bar` (through its tqdm hook,
    and for the GGUF converter, which imports tqdm itself, through that module's name)."""
    from transformers.utils import logging

    def hook(factory, args, kwargs):
        return factory(*args, **kwargs) if factory is logging.EmptyTqdm else progress_bar(*args, **kwargs)

    previous = logging.set_tqdm_hook(hook)
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf
    own = getattr(gguf, "tqdm", None)
    if own is not None:
        gguf.tqdm = progress_bar
    try:
        yield
    finally:
        logging.set_tqdm_hook(previous)
        if own is not None:
            gguf.tqdm = own
