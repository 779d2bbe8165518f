"""A normal (non-editable) install of the project carries every subpackage of kvlearn."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_every_subpackage(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(tmp_path)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("kvlearn-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    subpackages = sorted(str(p.parent.relative_to(ROOT)) for p in (ROOT / "kvlearn").rglob("__init__.py"))
    assert "kvlearn/exercises" in subpackages and "kvlearn/serving" in subpackages
    for package in subpackages:
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    files = {str(p.relative_to(ROOT)) for pattern in ("*.py", "*.json") for p in (ROOT / "kvlearn").rglob(pattern)}
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "kvlearn" / "routing" / "data").rglob("*") if p.is_file()}
    assert "kvlearn/routing/time_model.json" in files
    assert {"kvlearn/routing/data/mooncake/conversation_trace.jsonl.gz",
            "kvlearn/routing/data/mooncake/LICENSE"} <= files
    assert files <= names, f"files missing from the wheel: {sorted(files - names)}"
