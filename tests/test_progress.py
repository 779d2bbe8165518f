"""Progress bars: live in a terminal and in Jupyter, one line per bar in a log (make demo > log, CI)."""

import io
import re
from pathlib import Path

import pytest

from kvlearn import progress
from kvlearn.progress import LogBar, library_bars, progress_bar

PACKAGE = Path(__file__).resolve().parents[1] / "kvlearn"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_bar(file, **options) -> str:
    with progress_bar(total=500, desc="kvlearn radix", unit="tok", file=file, mininterval=0, **options) as bar:
        for i in range(500):
            bar.update(1)
            if i % 100 == 0:
                bar.set_postfix_str(f"step {i}")   # redraws in a terminal
    return file.getvalue()


def test_in_a_log_a_bar_is_one_line_written_when_it_closes():
    out = run_bar(io.StringIO())
    assert out.count("\n") == 1 and out.endswith("\n") and "\r" not in out, repr(out)
    assert out.startswith("kvlearn radix: 100%") and "500/500" in out and "step 400" in out


def test_in_a_terminal_the_bar_redraws_in_place():
    out = run_bar(Terminal())
    assert out.count("\r") > 5 and "500/500" in out


def test_in_jupyter_the_bar_is_live(monkeypatch):
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    assert not isinstance(progress_bar(total=3, file=io.StringIO()), LogBar)
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    assert isinstance(progress_bar(total=3, file=io.StringIO()), LogBar)


def test_a_disabled_bar_writes_nothing_and_an_iterable_bar_ends_in_one_line():
    file = io.StringIO()
    with progress_bar(total=3, file=file, disable=True) as bar:
        bar.update(3)
    assert file.getvalue() == ""
    assert list(progress_bar(range(50), desc="HF generate", file=file)) == list(range(50))
    assert file.getvalue().count("\n") == 1 and "50/50" in file.getvalue()


def test_the_bars_transformers_draws_are_one_line_too():
    from transformers.modeling_gguf_pytorch_utils import tqdm as gguf_tqdm
    from transformers.utils import logging

    logs = io.StringIO()
    with library_bars():
        for _ in logging.tqdm(range(300), desc="Loading weights", file=logs, mininterval=0):
            pass
        import transformers.modeling_gguf_pytorch_utils as gguf

        assert gguf.tqdm is progress_bar
    assert logs.getvalue().count("\n") == 1 and logs.getvalue().startswith("Loading weights: 100%")
    assert gguf.tqdm is gguf_tqdm   # put back


def test_every_bar_of_the_package_comes_from_progress_bar():
    imports = re.compile(r"^\s*(from tqdm\b|import tqdm\b)", re.M)
    found = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if p.name != "progress.py" and imports.search(p.read_text(encoding="utf-8"))]
    assert not found, f"{found} draw tqdm bars of their own: use kvlearn.progress.progress_bar (one line in a log)"


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_a_pipe_is_not_live(stream, monkeypatch):
    monkeypatch.setattr(f"sys.{stream}", io.StringIO())
    assert not progress.live(getattr(__import__("sys"), stream))
