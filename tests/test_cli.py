"""`python -m kvlearn`: usage and unknown commands (each command has its own tests)."""

from kvlearn.__main__ import COMMANDS, main


def test_usage_lists_every_command_and_refuses_unknown_ones(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in COMMANDS)
    assert main(["--help"]) == 0
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
