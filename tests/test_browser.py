"""The step-through widgets as a learner meets them: JupyterLab in a real browser.

nbval checks what the kernel computes; only a browser shows whether the slider, the caption and the
picture work together. For chapters 3 and 6 this test copies the chapter to a temporary folder, cut
after its last cell that builds or reads a widget (the later cells cost time and show no widget)
and with its stored outputs cleared, starts JupyterLab there (own port, token, settings and
figures folder), opens the copy in headless Chromium, runs it with the menu's Run > Run All Cells,
then moves every slider one step (right, or left at its end) and back with the keyboard. Each move
must change the caption and the picture to the slider's step ("step N: ..."), and the way back must
give the first caption and picture again.

Needs Debian's `chromium` package and the `playwright` pip package (requirements-test.txt); `make
test` installs both where it can (apt only as root). Playwright never downloads a browser here: it
drives the system's chromium (`executable_path`). Without either, the test skips and says what to
install. Marked slow: 44-58 s on a busy two-core machine, half of it chapter 6's cells. A failing run
names a screenshot of the page (and leaves the server's log next to it) in pytest's temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.thorough]   # a real browser: tests/README.md

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = ["03_radix_tree", "06_serving_engine"]
WIDGET_CELL = re.compile(r"widget|interact")  # a code cell that builds, shows or reads a widget
RUN_ALL_TIMEOUT = 480  # s; chapter 6's part took 22-30 s in the browser on a busy two-core machine
MOVE_TIMEOUT = 30  # s for the kernel to redraw after a slider move

# What JupyterLab shows must not depend on the user's settings, nor fetch news from the internet;
# windowing off keeps every cell in the page, so the prompts can be read.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}


def copy_chapter(name: str, dest: Path) -> None:
    """The chapter up to its last widget cell, stored outputs and widget state removed (so every
    prompt number and widget on the page comes from this run)."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    last = max((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and WIDGET_CELL.search(c.source)),
               default=None)
    assert last is not None, f"{name}: no code cell builds a widget any more; update {Path(__file__).name}"
    nb.cells = nb.cells[:last + 1]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, dest / f"{name}.ipynb")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token, in its own folder."""

    def __init__(self, root: Path):
        self.root, self.token, self.port = root, secrets.token_hex(16), free_port()
        self.log_path = root / "jupyterlab.log"
        for rel, values in LAB_SETTINGS.items():
            path = root / "lab-settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, KVLEARN_FIGURES=str(root / "figures"),  # not the clone's figures/
                   JUPYTER_CONFIG_DIR=str(root / "jupyter-config"), JUPYTER_RUNTIME_DIR=str(root / "runtime"))
        # One torch thread in the kernels: next to the browser, or on a busy machine, more threads
        # made chapter 6 several times slower (166 s against 32 s on a loaded two-core machine).
        env.setdefault("OMP_NUM_THREADS", "1")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={self.port}", "--port-retries=0", f"--ServerApp.token={self.token}",
             f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={root / 'lab-settings'}",
             f"--LabApp.workspaces_dir={root / 'lab-workspaces'}"],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"jupyter lab exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"jupyter lab did not answer in {timeout:.0f} s:\n{self.log_tail()}")

    def shutdown_kernels(self) -> None:
        for session in self.api("sessions"):
            self.api(f"sessions/{session['id']}", method="DELETE")

    def stop(self) -> None:
        """SIGTERM: the server shuts its kernels down and exits; whatever is left gets SIGKILL."""
        try:
            self.shutdown_kernels()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("browser test skipped: Debian's `chromium` is not installed "
                    "(`make thorough` installs it when run as root; else: sudo apt-get install chromium)")
    return path


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser test skipped: the `playwright` package is not installed "
                    "(`make thorough` installs it; else: .venv/bin/pip install -r requirements-test.txt)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    (root / "notebooks").mkdir()
    (root / "figures").mkdir()
    for name in CHAPTERS:
        copy_chapter(name, root / "notebooks")
    server = Lab(root)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# --- reading the page --------------------------------------------------------------------------

STATUS_JS = r"""() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(e => e.textContent.trim());
  const bar = document.querySelector('#jp-main-statusbar');
  return {cells: prompts.length, done: prompts.filter(t => /^\[\d+\]:$/.test(t)).length,
          running: prompts.filter(t => t === '[*]:').length, status: bar ? bar.textContent : ''};
}"""

ERRORS_JS = r"""() => [...document.querySelectorAll('.jp-OutputArea-output')]
  .map(e => e.textContent).filter(t => /Traceback|Error\b/.test(t)).map(t => t.slice(-1500))"""

# One slider widget's state, read the way a person sees it: the slider's value, the caption (the
# widget's text without the slider and the picture) and the picture (inline SVG or <img> source).
WIDGET_JS = r"""area => {
  const handle = area.querySelector('.widget-slider [role=slider]');
  const pictures = [...area.querySelectorAll('svg, img')].map(e => e.tagName === 'IMG' ? e.src : e.outerHTML);
  const copy = area.cloneNode(true);
  copy.querySelectorAll('.widget-slider, svg, img, .jp-OutputPrompt').forEach(e => e.remove());
  const value = name => handle ? Math.round(Number(handle.getAttribute(name))) : null;
  return {step: value('aria-valuenow'), last: value('aria-valuemax'),
          caption: copy.textContent.replace(/\s+/g, ' ').trim(), picture: pictures.join('\n'),
          labels: [...area.querySelectorAll('svg text')].map(t => t.textContent).join(' | ')};
}"""


def run_all(page, name: str) -> None:
    """Open the notebook, wait for its kernel, Run > Run All Cells, wait until every cell ran."""
    page.goto(page.lab.url(f"lab/workspaces/{name}/tree/notebooks/{name}.ipynb"))
    page.wait_for_function(  # the status bar says "Python 3 (ipykernel) | Idle"
        "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.textContent || '')", timeout=120_000)
    page.locator("#jp-menu-panel .lm-MenuBar-item", has_text="Run").first.click()
    page.locator('#jp-mainmenu-run .lm-Menu-item:has(.lm-Menu-itemLabel:text-is("Run All Cells"))').click()
    start, stalled = time.monotonic(), 0
    while True:
        s = page.evaluate(STATUS_JS)
        if s["cells"] and s["done"] == s["cells"]:
            return
        # An error stops Run All: the rest lose their [*] and stay unnumbered, the kernel goes idle.
        stalled = stalled + 1 if s["running"] == 0 and "Idle" in s["status"] else 0
        if stalled >= 6:
            errors = "\n---\n".join(page.evaluate(ERRORS_JS)) or "(no error output on the page)"
            pytest.fail(f"{name}: Run All stopped after {s['done']} of {s['cells']} code cells "
                        f"(screenshot: {page.shot}):\n{errors}")
        if time.monotonic() - start > RUN_ALL_TIMEOUT:
            pytest.fail(f"{name}: Run All did not finish in {RUN_ALL_TIMEOUT} s "
                        f"({s['done']} of {s['cells']} code cells ran; screenshot: {page.shot})")
        time.sleep(0.5)


def read(area) -> dict:
    state = area.evaluate(WIDGET_JS)
    state["hash"] = hashlib.sha256(state["picture"].encode()).hexdigest()[:12]
    return state


def wait_for(area, want, timeout: float = MOVE_TIMEOUT) -> dict:
    """The widget's state once `want(state)` holds and it reads the same twice in a row."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        state = read(area)
        if want(state) and state == last:
            return state
        last = state
        time.sleep(0.25)
    return state


def steps_named(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\bstep (\d+):", text)}


def shows_step(state: dict, step: int) -> bool:
    """The caption names this step (first) and the picture shows one; a picture that labels a
    step (chapter 3's do) labels this one."""
    named = re.findall(r"\bstep (\d+):", state["caption"])
    return (bool(named) and int(named[0]) == step and bool(state["picture"])
            and steps_named(state["labels"]) <= {step})


def describe(state: dict) -> str:
    return f"slider {state['step']}, caption {state['caption'][:160]!r}, picture {state['hash']}"


def screenshot(lab: Lab, test_name: str) -> Path:
    return lab.root / (re.sub(r"\W+", "_", test_name) + ".png")


@pytest.fixture
def page(browser, lab, request):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.lab, page.shot = lab, screenshot(lab, request.node.name)
    try:
        yield page
    finally:
        try:  # what the page showed last, to look at when the test failed
            page.screenshot(path=str(page.shot))
        except Exception:  # noqa: BLE001  the page may be gone; the screenshot is only a help
            pass
        page.close()
        try:
            lab.shutdown_kernels()
        except OSError:
            pass


@pytest.mark.parametrize("name", CHAPTERS)
def test_sliders_move_caption_and_picture(page, name):
    t0 = time.monotonic()
    run_all(page, name)
    ran = time.monotonic() - t0

    widget_cells = page.locator(".jp-Notebook .jp-CodeCell:has(.widget-slider)")
    if widget_cells.count() == 0:
        shown = [t[:200] for t in page.locator(".jp-OutputArea-output").all_text_contents()
                 if re.search(r"VBox\(|interactive\(|IntSlider\(", t)]
        pytest.fail(f"{name}: no slider on the page after Run All (screenshot: {page.shot}); "
                    f"widget placeholders shown instead: {shown}")

    for k in range(widget_cells.count()):
        area = widget_cells.nth(k).locator(".jp-Cell-outputArea")
        where = f"{name}, widget {k + 1} (screenshot: {page.shot})"
        stray = re.findall(r"<function [^>]*>|<[\w.]+ (?:object )?at 0x[0-9a-f]+>", area.text_content())
        assert not stray, f"{where}: the cell shows a stray Python repr next to the widget: {stray}"

        first = wait_for(area, lambda s: s["step"] is not None and shows_step(s, s["step"]))
        assert shows_step(first, first["step"]), \
            f"{where}: caption and picture do not show the slider's step: {describe(first)}"

        # One step on (one back when the slider starts at its end), then back, with the keyboard.
        handle = area.locator(".widget-slider [role=slider]")
        step, there, back_key = (1, "ArrowRight", "ArrowLeft") if first["step"] < first["last"] else \
            (-1, "ArrowLeft", "ArrowRight")
        handle.press(there)
        moved = wait_for(area, lambda s, first=first, step=step: s["step"] == first["step"] + step
                         and shows_step(s, s["step"]) and s["hash"] != first["hash"])
        assert moved["step"] == first["step"] + step, \
            f"{where}: {there} did not move the slider: {describe(moved)}"
        assert moved["caption"] != first["caption"], f"{where}: the caption did not change: {describe(moved)}"
        assert moved["hash"] != first["hash"], f"{where}: the picture did not change: {describe(moved)}"
        assert shows_step(moved, moved["step"]), \
            f"{where}: after the move, caption and picture are not step {moved['step']}: {describe(moved)}"

        handle.press(back_key)
        back = wait_for(area, lambda s, first=first: s["step"] == first["step"] and s["hash"] == first["hash"])
        same = [k for k in ("step", "caption", "hash") if back[k] == first[k]]
        assert len(same) == 3, (f"{where}: back at step {first['step']} the widget shows {describe(back)}, "
                                f"first it showed {describe(first)}")
        print(f"{name}, widget {k + 1}: step {first['step']} -> {moved['step']} -> {back['step']}: "
              f"{first['caption'][:60]!r} -> {moved['caption'][:60]!r}")
    print(f"{name}: Run All took {ran:.1f} s, the sliders {time.monotonic() - t0 - ran:.1f} s")
