"""`python -m kvlearn gpu-check --dry`: the GPU check's every step on the CPU (the kernels in Triton's
interpreter, SmolLM2's shapes cut to two layers, seeded random weights), so the script a GPU machine
runs is known to work before one is lent."""

import json
import os
import subprocess
import sys

import pytest

import kvlearn.kernels

pytestmark = pytest.mark.skipif(kvlearn.kernels.triton_import_error() is not None,
                                reason="Triton has no wheels for this platform (Linux only): no triton backend here")


def gpu_check(tmp_path, *args, interpret="1"):
    env = {**os.environ, "TRITON_INTERPRET": interpret, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvlearn", "gpu-check", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)


@pytest.mark.thorough   # the script of `make gpu-check`; the tokens: test_kernels_engine.py, test_fast.py
def test_gpu_check_dry_passes_and_writes_its_report(tmp_path):
    done = gpu_check(tmp_path, "--dry", "--out", "report.json")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["dry"] and report["weights"].startswith("random")
    systems = report["systems"]
    assert set(systems) == {"hf", "hf-cb", "torch", "triton", "fast"}
    assert systems["triton"]["backend"] == "triton" and systems["torch"]["backend"] == "torch"
    assert all(systems[s]["equal_to_hf"] for s in ("torch", "triton", "fast"))
    assert systems["triton"]["cached_tokens"] == report["cpu_cached_tokens"] > 0   # the shared system prompt
    assert "PASSED" in done.stdout and "kvlearn radix, triton kernels" in done.stdout


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_gpu_check_says_what_to_do_without_cuda_or_the_interpreter(tmp_path):
    import torch

    if not torch.cuda.is_available():
        done = gpu_check(tmp_path)
        assert done.returncode != 0 and "needs CUDA" in done.stderr and "--dry" in done.stderr
    done = gpu_check(tmp_path, "--dry", interpret="0")
    assert done.returncode != 0 and "TRITON_INTERPRET=1" in done.stderr
