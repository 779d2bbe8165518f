"""The viz package's shape: importing it (for figures_dir, or the text renderers) needs neither
graphviz nor matplotlib, and no viz module reaches into another one's private names."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import kvlearn.viz

VIZ = Path(kvlearn.viz.__file__).parent

WITHOUT_GRAPHVIZ = """
import sys
sys.modules["graphviz"] = None      # `import graphviz` now raises ImportError
sys.modules["matplotlib"] = None
import torch
from kvlearn import RadixCache
import kvlearn.viz, kvlearn.viz.fleet, kvlearn.viz.teaching, kvlearn.viz.tiers
from kvlearn.viz.plots import figures_dir
print(figures_dir())
cache = RadixCache()
cache.insert([1, 2, 3], torch.arange(3))
print(kvlearn.viz.radix_text(cache).splitlines()[-1])
try:
    kvlearn.viz.draw_radix(cache)
except ImportError:
    print("draw_radix needs graphviz")
"""


def test_figures_dir_and_text_renderers_work_without_graphviz(tmp_path):
    env = {**os.environ, "KVLEARN_FIGURES": str(tmp_path / "figs"),
           "PYTHONPATH": os.pathsep.join([str(VIZ.parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", WITHOUT_GRAPHVIZ], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [str(tmp_path / "figs"),
                                       "└─ #1 [1 2 3]  3 tok, slots 0-2, lock_ref=0, t=1",
                                       "draw_radix needs graphviz"]


def test_viz_modules_import_no_private_names():
    reaches = []
    for path in sorted(VIZ.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlearn"):
                reaches += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert reaches == []


def test_init_only_reexports():
    tree = ast.parse((VIZ / "__init__.py").read_text())
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Assign"}  # docstring, re-exports, __all__
    assert all(hasattr(kvlearn.viz, name) for name in kvlearn.viz.__all__)


def test_figures_go_under_the_folder_run_from_never_into_the_installed_clone(tmp_path, monkeypatch):
    from kvlearn.viz.plots import figures_dir

    monkeypatch.delenv("KVLEARN_FIGURES", raising=False)
    monkeypatch.chdir(tmp_path)
    clone_figures = VIZ.parents[1] / "figures"
    assert figures_dir() == tmp_path / "figures" != clone_figures   # no figures/ above: a new one here
    (tmp_path / "figures").mkdir()
    (tmp_path / "notebooks").mkdir()
    assert figures_dir(tmp_path / "notebooks") == tmp_path / "figures"   # the course's, from notebooks/
    monkeypatch.chdir(tmp_path / "notebooks")
    assert figures_dir() == tmp_path / "figures"
