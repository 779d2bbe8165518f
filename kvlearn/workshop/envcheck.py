"""`python -m kvlearn check`: is this laptop ready for the course? One line per requirement.

Each check returns a `Check`: OK, FAIL (with the command that fixes it) or NOTE (fine, but worth
knowing, e.g. the model is not converted yet). The exit status is 1 when anything FAILs, so an
instructor can run it in a loop over a room of machines. Checks import nothing heavy unless that
is what they check (torch), and never touch the network.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"  # kvlearn/workshop/ -> the repository
SETUP_FIX = "run `make setup` in the kvlearn folder (or: pip install -r requirements.txt)"
MIN_MEMORY_GIB = 2.0   # a notebook kernel peaks at 1.1 GB (chapters 5 and 6, measured); Jupyter needs some too
MIN_DISK_GIB = 1.0     # the converted model takes 0.5 GiB


@dataclass
class Check:
    status: str  # "OK", "FAIL" or "NOTE"
    name: str
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        line = f"{self.status:<5}{self.name:<19}{self.detail}"
        return line + (f"\n     fix: {self.fix}" if self.fix else "")


def ok_if(condition: bool, name: str, detail: str, fix: str) -> Check:
    return Check("OK", name, detail) if condition else Check("FAIL", name, detail, fix)


def python_version() -> Check:
    from packaging.specifiers import SpecifierSet

    wanted = SpecifierSet(importlib.metadata.metadata("kvlearn")["Requires-Python"])  # from pyproject.toml
    found = ".".join(map(str, sys.version_info[:3]))
    return ok_if(found in wanted, "python", f"{found} (needs {wanted}) at {sys.executable}",
                 f"install Python {wanted} (3.11 is tested), then: make clean setup PYTHON=python3.11")


def required() -> dict:
    """requirements.txt as {name: Requirement}: the one place versions are stated."""
    from packaging.requirements import Requirement

    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    return {req.name: req for req in map(Requirement, filter(None, lines))}


def applies(req) -> bool:
    """Whether a requirements.txt line is for this machine (its environment marker, if any, holds).
    sys.platform is read at each call (packaging caches the rest of its environment)."""
    return req.marker is None or req.marker.evaluate({"sys_platform": sys.platform})


def installed(name: str, why: str = "") -> Check:
    """One package from requirements.txt, at a version it allows."""
    req = required()[name]
    fix = f"pip install -U '{req}'  (or run `make setup`)"
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return Check("FAIL", name, f"not installed{why}", fix)
    return ok_if(req.specifier.contains(found, prereleases=True), name, f"{found} (needs {req.specifier})", fix)


def packages() -> Check:
    """Every line of requirements.txt, in one line."""
    wanted = [name for name, req in required().items() if applies(req)]
    failed = [f"{c.name} {c.detail}" for c in map(installed, wanted) if c.status == "FAIL"]
    if failed:
        return Check("FAIL", "packages", "; ".join(failed), SETUP_FIX)
    return Check("OK", "packages", f"all {len(wanted)} in requirements.txt for this machine at allowed versions")


def torch_works() -> Check:
    try:
        import torch

        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(x @ x.T, torch.tensor([[5.0, 14.0], [14.0, 50.0]]))
    except Exception as err:  # an import error or a broken build: say which
        return Check("FAIL", "torch", f"{type(err).__name__}: {err}", SETUP_FIX)
    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    return Check("OK", "torch", f"{torch.__version__}, computes on {device}, {torch.get_num_threads()} threads")


def model_wheel() -> Check:
    """The GGUF file is where the wheel says, and its header reads as a GGUF with tensors in it."""
    try:
        from kvlearn.model_store import INSTALL_HINT, model_path
    except ImportError as err:
        return Check("FAIL", "model wheel", f"cannot check: {err}", SETUP_FIX)
    try:
        path = model_path()
    except FileNotFoundError as err:
        return Check("FAIL", "model wheel", "the model file is not installed", str(err))
    with open(path, "rb") as f:
        header = f.read(24)  # magic, format version (u32), tensor count (u64), metadata count (u64)
    version, tensors = int.from_bytes(header[4:8], "little"), int.from_bytes(header[8:16], "little")
    if header[:4] != b"GGUF" or tensors == 0:
        return Check("FAIL", "model wheel", f"{path} is not a readable GGUF file", f"reinstall: {INSTALL_HINT}")
    return Check("OK", "model wheel", f"{path.name}: GGUF v{version}, {tensors} tensors, "
                 f"{path.stat().st_size / 2**20:.0f} MiB")


def converted_model() -> Check:
    try:
        from kvlearn.model_store import cache_dir, cache_problem
    except ImportError as err:
        return Check("FAIL", "converted model", f"cannot check: {err}", SETUP_FIX)
    folder = cache_dir()
    problem = cache_problem(folder)
    if problem is None:
        return Check("OK", "converted model", f"{folder} (matches its integrity record)")
    if folder.is_dir():
        return Check("NOTE", "converted model", f"{folder} is damaged ({problem}): the next load_model() "
                     "rebuilds it in ~15 s")
    return Check("NOTE", "converted model", f"not made yet: the first load_model() makes it in ~15 s "
                 f"(`make demo` does), into {folder}")


def graphviz_dot() -> Check:
    dot = shutil.which("dot")
    fix = ("sudo apt-get install graphviz  (Debian/Ubuntu; macOS: brew install graphviz; "
           "Windows: winget install graphviz), then open a new terminal")
    if not dot:
        return Check("FAIL", "graphviz dot", "`dot` not found on PATH (the pictures need it)", fix)
    run = subprocess.run([dot, "-V"], capture_output=True, text=True, timeout=20)
    version = (run.stderr or run.stdout).strip()
    return ok_if(run.returncode == 0, "graphviz dot", f"{dot}: {version}", fix)


def jupyter_kernel() -> Check:
    """The `python3` kernel the notebooks ask for runs a Python that can import kvlearn."""
    fix = "run `make notebooks` (the venv's Jupyter), or: python -m ipykernel install --user --name python3"
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

        spec = KernelSpecManager().get_kernel_spec("python3")
    except ImportError as err:
        return Check("FAIL", "jupyter kernel", f"Jupyter is not installed ({err})", SETUP_FIX)
    except NoSuchKernel:
        return Check("FAIL", "jupyter kernel", "no `python3` kernel", fix)
    # jupyter_client launches a spec whose argv[0] is a bare `python` with its own interpreter
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    python = sys.executable if spec.argv[0] in bare else spec.argv[0]
    if python != sys.executable:
        try:
            probe = subprocess.run([python, "-c", "import kvlearn, ipykernel"], capture_output=True, timeout=60)
            importable = probe.returncode == 0
        except OSError:
            importable = False
        if not importable:
            return Check("FAIL", "jupyter kernel", f"kernel `python3` ({spec.resource_dir}) runs {python}, "
                         "which cannot import kvlearn", fix)
    return Check("OK", "jupyter kernel", f"python3 -> {python}")


def memory(min_gib: float = MIN_MEMORY_GIB) -> Check:
    import psutil

    free = psutil.virtual_memory().available / 2**30
    return ok_if(free >= min_gib, "free memory", f"{free:.1f} GiB available (needs {min_gib:.0f})",
                 f"close other programs (browser tabs, IDEs) until {min_gib:.0f} GiB are free")


def disk(min_gib: float = MIN_DISK_GIB) -> Check:
    try:
        from kvlearn.model_store import cache_dir

        folder = cache_dir()
    except ImportError:
        folder = Path.home()
    while not folder.exists():  # the cache may not exist yet: measure where it will be made
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 2**30
    return ok_if(free >= min_gib, "free disk", f"{free:.1f} GiB free at {folder} (needs {min_gib:.0f})",
                 "free some disk space, or set KVLEARN_CACHE to a folder on a disk with room")


def transformers() -> Check:
    return installed("transformers")


def triton() -> Check:
    """Triton runs chapter 5's last section (its kernels, in Triton's interpreter on a CPU); it ships
    wheels for Linux only, and nothing else in the course needs it."""
    if not applies(required()["triton"]):
        return Check("NOTE", "triton", f"no Triton for {sys.platform} (its wheels are for Linux): chapter 5's "
                     "section on the GPU stops there with a message; nothing else needs it")
    return installed("triton", ": chapter 5's section on the GPU runs its kernels")


def ipywidgets() -> Check:
    return installed("ipywidgets", ": the step-through widgets need it")


CHECKS = (python_version, packages, torch_works, transformers, triton, model_wheel, converted_model, graphviz_dot,
          jupyter_kernel, ipywidgets, memory, disk)


def run_checks(checks=CHECKS) -> list[Check]:
    results = []
    for check in checks:
        try:
            results.append(check())
        except Exception as err:  # a check must report, never crash the others
            results.append(Check("FAIL", check.__name__, f"the check itself failed: {type(err).__name__}: {err}",
                                 SETUP_FIX))
    return results


def main(argv=None) -> int:
    """Print one line per requirement; exit status 1 if any FAILs."""
    if argv:
        print("usage: python -m kvlearn check   (takes no options)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = run_checks()
    for result in results:
        print(result)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"\n{len(failed)} problem(s): " + ", ".join(failed) if failed else "\nready for the course")
    return 1 if failed else 0
