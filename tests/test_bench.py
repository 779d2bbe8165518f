"""Benchmarks: the dry-run scheduler, the comparison logic, the outputs, and the command line."""

import json

import pytest

from kvlearn.bench import cli as bench
from kvlearn.bench import demo
from kvlearn.bench.decode import describe_efficiency, step_efficiency, weight_bytes
from kvlearn.bench.peers import SystemResult, vllm_environment
from kvlearn.bench.report import check_bars, compare_tokens, table
from kvlearn.serving.simulate import simulate
from kvlearn.serving.workloads import make_workload, unique_token_floor


@pytest.fixture(scope="module")
def shared(tokenizer):
    return make_workload("shared_system", tokenizer)


def test_simulate_counts_what_each_cache_computes(shared):
    radix, blocks, none = (simulate(shared, cache, max_new_tokens=4) for cache in ("radix", "blocks", "none"))
    assert radix["computed_prefill_tokens"] == shared.unique_token_floor          # the bench's floor bar, exactly
    assert shared.unique_token_floor < blocks["computed_prefill_tokens"] < none["computed_prefill_tokens"]
    assert none["computed_prefill_tokens"] == shared.num_prompt_tokens and none["hit_rate"] == 0.0
    for stats in (radix, blocks, none):
        assert stats["cached_tokens"] + stats["computed_prefill_tokens"] == shared.num_prompt_tokens
        assert stats["output_tokens"] == 4 * shared.num_requests and stats["preemptions"] == 0
    assert radix["peak_slots"] < blocks["peak_slots"] < none["peak_slots"]
    # a plain list of prompts works too; in a pool of 330 slots the four requests (about 320 tokens
    # each, sharing the system prompt) all fit at once, but only by evicting finished ones' tails
    tight = simulate(shared.prompt_lists()[:4], "radix", max_new_tokens=4, num_slots=330)
    assert tight["peak_slots"] == 330 and tight["evicted_tokens"] > 0 and tight["preemptions"] == 0
    # what was evicted (finished requests' own tails) was never needed again: still the floor
    assert tight["computed_prefill_tokens"] == unique_token_floor(shared.prompt_lists()[:4])


def _result(system, outputs, wall, computed=None):
    return SystemResult(system, outputs, wall, computed)


def test_bars_table_and_mismatches_without_a_model(shared):
    floor = shared.unique_token_floor
    results = [_result("radix", [[1, 2]], 1.0, floor), _result("hf", [[1, 2]], 6.0, shared.num_prompt_tokens),
               _result("hf-cb", [[1, 3]], 1.5, None)]
    bars = {name: (measured, reached) for name, measured, _, reached in check_bars(results, shared)}
    assert bars["radix tok/s vs HF generate"] == (6.0, True)
    assert bars["radix tok/s vs HF continuous batching"] == (1.5, False)
    assert bars["radix computed prefill / unique-token floor"] == (1.0, True)
    text = table(results, shared)
    assert "kvlearn radix" in text and "HF continuous batching" in text and " - " in text
    mismatches, ties = compare_tokens(results, shared)          # reference: hf
    assert ties == [] and len(mismatches) == 1 and mismatches[0].startswith("hf-cb vs hf, prompt 0, token 1")


def test_vllm_and_decode_step_bars(shared, tokenizer):
    results = [_result("radix", [[1, 2]], 1.0, shared.unique_token_floor), _result("vllm", [[1, 2]], 0.9)]
    step = {"efficiency": 0.42}
    bars = {name: (measured, target, reached) for name, measured, target, reached in check_bars(results, shared, step)}
    assert bars["radix tok/s vs vLLM CPU"] == (0.9, 1.0, False)
    assert bars["decode-step weight read / plain read bandwidth"] == (0.42, 0.5, False)
    no_sharing = make_workload("no_sharing", tokenizer, num_requests=2)
    assert dict((n, t) for n, _, t, _ in check_bars(results, no_sharing))["radix tok/s vs vLLM CPU"] == 0.8


def test_vllm_computes_on_the_same_cores():
    env = vllm_environment(2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1 and "PATH" in env


def test_decode_step_efficiency_is_measured_against_a_plain_read(model, shared):
    e = step_efficiency(model, shared.prompt_lists()[:2], fast=True, rounds=1)
    assert e["weight_bytes"] == weight_bytes(model) > 500e6 and e["batch"] == 2 and e["fast"]
    # efficiency is rounded to 3 decimals: within half its last digit, however slow a loaded machine makes it
    assert e["efficiency"] == pytest.approx(e["weight_read_gb_s"] / e["plain_read_gb_s"], rel=0.02, abs=5e-4)
    assert "of a plain read" in describe_efficiency(e) and "matrix-product rate" in describe_efficiency(e)
    # Two tokens per step: 2 x 2 FLOPs per weight, at the measured product rate.
    flops = 4 * e["weight_bytes"] / 4
    assert e["flop_floor_ms"] == pytest.approx(flops / (e["matmul_gflop_s"] * 1e9) * 1e3, rel=0.02)
    assert e["floor_efficiency"] == pytest.approx(max(e["read_floor_ms"], e["flop_floor_ms"]) / e["step_ms"], rel=0.05)


@pytest.mark.slow
def test_a_float_tie_is_told_apart_from_a_real_mismatch(model, shared):
    """Prompt 8 of this workload reaches a near-exact tie after these 7 greedy tokens: ',' (28) and
    '.' (30) score the same up to ~1e-6, so either is a correct greedy choice."""
    prefix = [504, 24118, 3746, 314, 1770, 327, 7131]
    outputs = [[] for _ in range(shared.num_requests)]

    def results(other_token):
        ref, other = [list(o) for o in outputs], [list(o) for o in outputs]
        ref[8], other[8] = prefix + [28], prefix + [other_token]
        return [_result("hf", ref, 1.0), _result("radix", other, 1.0)]

    mismatches, ties = compare_tokens(results(30), shared, model)
    assert mismatches == [] and len(ties) == 1 and "prompt 8, token 7" in ties[0]
    mismatches, ties = compare_tokens(results(2), shared, model)
    assert ties == [] and len(mismatches) == 1


@pytest.mark.thorough   # `python -m kvlearn bench` whole; its parts: the tests above
def test_command_line_end_to_end(tmp_path, capsys):
    code = bench.main(["--requests", "2", "--max-new-tokens", "3", "--systems", "radix,none,hf,hf-cb",
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "same greedy tokens" in out
    record = json.loads((tmp_path / "bench_shared_system.json").read_text())
    assert [s["system"] for s in record["systems"]] == ["radix", "none", "hf", "hf-cb"]
    assert record["token_mismatches"] == [] and (tmp_path / "bench_shared_system.png").stat().st_size > 0
    radix = record["systems"][0]
    assert radix["computed_prefill_tokens"] == record["workload"]["unique_token_floor"]
    hf_cb = record["systems"][3]
    assert hf_cb["computed_prefill_tokens"] is not None  # its prefix hits were counted
    assert all(len(o) == 3 for s in record["systems"] for o in s["outputs"])


@pytest.mark.slow
def test_engine_demo_writes_its_figures(model, tokenizer, tmp_path, capsys):
    assert demo.engine(model, tokenizer, num_requests=2, max_new_tokens=3, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert "came from the cache" in out and "same greedy tokens with and without the cache: yes" in out
    assert (tmp_path / "demo_radix_tree.svg").read_text().startswith("<?xml")
    assert (tmp_path / "demo_engine.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--systems", "radix,vllm2"], ["--max-new-tokens", "0"], ["--workload", "chat"],
                                  ["--threads", "0"]])
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--max-new-tokens", "0"]])
def test_bad_demo_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2


@pytest.mark.slow
def test_chunked_prefill_bench_serves_the_same_tokens_three_ways(model, tokenizer):
    from kvlearn.bench.chunked import describe, measure

    result = measure(model, tokenizer, long_tokens=300, num_chats=3, max_new_tokens=3, arrive_at_step=1)
    assert result["same_tokens"] and [r["run"] for r in result["runs"]] == [
        "no chunks, budget 2048", "no chunks, budget 256", "chunked, budget 256"]
    steps = {r["run"]: r["steps"] for r in result["runs"]}
    # Without chunks and a small budget the document waits for the chats; in chunks it starts at once.
    assert steps["no chunks, budget 256"] > steps["chunked, budget 256"] >= steps["no chunks, budget 2048"]
    assert all(r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 for r in result["runs"])
    assert "same tokens in every run" in describe(result)
