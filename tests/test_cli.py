"""`python -m kvlearn`: usage, unknown commands, usage errors shared by commands (each command has its own tests)."""

import ast
import gzip
from pathlib import Path

import pytest

from kvlearn.__main__ import COMMANDS, main
from kvlearn.routing.trace_request import TraceRequest


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


# --- route and replay: every error is one line with a message ------------------------------------------

def _raises_without_a_message(path):
    """`raise X` / `raise X()` / `raise X("")` in a module: errors that would print an empty message."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc
            if isinstance(exc, ast.Name) and exc.id[:1].isupper() and exc.id != "e":
                yield f"{path.name}:{node.lineno}"
            elif isinstance(exc, ast.Call) and (not exc.args or (isinstance(exc.args[0], ast.Constant)
                                                                  and not exc.args[0].value)):
                yield f"{path.name}:{node.lineno}"


def test_no_routing_module_raises_an_error_without_a_message():
    import kvlearn.routing
    routing = Path(kvlearn.routing.__file__).parent
    assert [hit for path in sorted(routing.glob("*.py")) for hit in _raises_without_a_message(path)] == []


@pytest.fixture
def traces(tmp_path):
    plain = tmp_path / "t.jsonl"
    plain.write_text("".join(f'{{"id": "r{i}", "arrival": {i / 10}, "prompt_ids": [1, 2, {3 + i}], '
                             f'"max_new_tokens": 2}}\n' for i in range(4)))
    mooncake = tmp_path / "mc.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n')
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(plain.read_bytes())[:30])
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "\n")
    return {"plain": str(plain), "mooncake": str(mooncake), "cut": str(cut), "deep": str(deep), "dir": str(tmp_path)}


ROUTE_ERRORS = [   # (arguments, what the error says); {name} is a file of the `traces` fixture
    (["--trace", "{mooncake}", "--block-size", str(10**15)], "block_size must be at most"),
    (["--trace", "{cut}"], "cut.jsonl.gz:1: cannot read further"),
    (["--trace", "{deep}"], "deep.jsonl:1: JSON nested too deeply"),
    (["--trace", "{dir}"], "No trace file"),
    (["--trace", "{plain}", "--save-trace", "{dir}/x.jsonl"], "--save-trace writes a generated trace"),
    (["--trace", "{plain}", "--slots-per-replica", str(10**15)], "the fleet would preallocate about"),
    (["--trace", "{plain}", "--policy", "all", "--balance-rel-threshold", "nan"], "balance_rel_threshold must be"),
    (["--trace", "{plain}", "--policy", "exact", "--balance-abs-threshold", "inf"], "balance_abs_threshold must be"),
    (["--trace", "{plain}", "--policy", "cache_aware", "--cache-threshold", "nan"], "cache_threshold must be in"),
    (["--generate", "10", "--rate", "nan"], "rate must be a number in"),
    (["--generate", "10", "--rate", "inf"], "rate must be a number in"),
    (["--generate", "10", "--burstiness", "nan"], "burstiness must be a number in"),
    (["--generate", "10", "--burstiness", "1e-200"], "burstiness must be a number in"),
    (["--generate", "10", "--burstiness", "inf"], "burstiness must be a number in"),
    (["--generate", "10", "--hot-tenant", "nan"], "hot_tenant_share must be in"),
    (["--generate", "10", "--tenants", str(10**12)], "tenants would take about"),
    (["--generate", "10", "--save-trace", "{dir}"], "is a folder: give a file path"),
    (["--generate", "10", "--save-trace", "{dir}/no/such/folder.jsonl"], "No folder"),
    (["--generate", "0"], "num_requests must be >= 1"),
    (["--generate", "10", "--speedup", "inf"], "--speedup must be a number > 0"),
]


@pytest.mark.parametrize("args,message", ROUTE_ERRORS, ids=[" ".join(a) for a, _ in ROUTE_ERRORS])
def test_every_route_error_is_one_line_that_says_why(traces, capsys, args, message):
    assert main(["route", *(a.format(**traces) for a in args), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith("route: error: ") and captured.err[len("route: error: "):].strip()
    assert message in captured.err, captured.err


def test_route_refuses_queued_requests_beyond_memory_with_the_estimate(traces, capsys, monkeypatch):
    from kvlearn.routing import budget
    trace = [TraceRequest(f"r{i}", 0.0, ((1,) * 2048,), 8) for i in range(1000)]   # 2,048-token prompts
    queued = budget.queued_bytes(trace)
    assert 2056 * 8 * 1000 < queued <= 2056 * 8 * 1000 + 1000 * budget.REQUEST_OVERHEAD_BYTES   # ~17 KB a request
    tables, _ = budget.fleet_bytes(4, 16384, 1, 64, 2056)
    monkeypatch.setattr(budget, "available_bytes", lambda: (tables + queued - 1, None))
    with pytest.raises(MemoryError, match=r"its 1,000 requests take up to 1[67].\d MB more if they all wait at "
                                          r"once \(2,056,000 prompt and output tokens\): [\d.]+ MB in all; but"):
        budget.check_fleet_memory(4, 16384, 1, 64, trace)
    monkeypatch.setattr(budget, "available_bytes", lambda: (tables + queued, None))
    budget.check_fleet_memory(4, 16384, 1, 64, trace)
    # the command, on a trace of 2,000 prompts of 2,048 tokens arriving at once, with 20 MB left
    path = Path(traces["dir"]) / "burst.jsonl"
    path.write_text("".join(f'{{"timestamp": 0, "input_length": 2048, "output_length": 8, "hash_ids": [{i}, "a{i}", '
                            f'"b{i}", "c{i}"]}}\n' for i in range(2000)))
    monkeypatch.setattr(budget, "available_bytes", lambda: (20 * 2**20, None))
    assert main(["route", "--trace", str(path), "--page-size", "1", "--json"]) == 2   # pages of one token, as above
    err = capsys.readouterr().err
    assert err.startswith("route: error: the fleet would preallocate about") and "; but 20.0 MB are available" in err
    assert ("its 2,000 requests take up to 33.3 MB more if they all wait at once (4,112,000 prompt and output tokens): "
            "38.5 MB in all" in err)


@pytest.mark.parametrize("command", ["route", "replay"])
def test_an_error_without_a_message_still_prints_one(traces, capsys, monkeypatch, command):
    from kvlearn.routing import replay
    from kvlearn.routing import traces as trace_reader

    def out_of_memory(*args, **kwargs):
        raise MemoryError()   # what Python raises when an allocation fails: no message
    monkeypatch.setattr(trace_reader if command == "route" else replay, "read_mooncake", out_of_memory)
    assert main([command, "--trace", traces["mooncake"]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{command}: error: out of memory") and "shorter trace" in err
