"""`python -m kvlearn`: usage, unknown commands, usage errors shared by commands (each command has its own tests)."""

import pytest

from kvlearn.__main__ import COMMANDS, main


def test_usage_lists_every_command_and_refuses_unknown_ones(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in COMMANDS)
    assert main(["--help"]) == 0
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


def test_a_device_kvlearn_cannot_use_is_a_usage_error(capsys):
    for command in ("bench", "demo"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--device", "tpu"])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and "--device" in err and "'tpu'" in err and "Traceback" not in err
