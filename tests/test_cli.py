"""`python -m kvlearn`: usage, unknown commands, and the environment check."""

import importlib.metadata

import kvlearn.model as km
from kvlearn.__main__ import main


def test_usage_and_unknown_command(capsys):
    assert main([]) == 2 and "demo" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


def test_check_reports_ok_here(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "OK   model wheel" in out and "OK   graphviz dot" in out


def test_check_fails_without_the_wheel(monkeypatch, capsys):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(km.importlib.metadata, "distribution", missing)
    assert main(["check"]) == 1
    assert "FAIL model wheel" in capsys.readouterr().out
