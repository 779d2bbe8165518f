"""Chapter 7 at small scale with the real model: the same trace through real engines (one model
object shared by three Engines) and through the model-free simulation routes identically, hits
the caches identically, and every generated token equals Hugging Face `generate`."""

import pytest

from kvlearn import Engine
from kvlearn.routing.fleet import run_fleet
from kvlearn.routing.policies import make_policy
from kvlearn.routing.replicas import EngineReplica, SimReplica
from kvlearn.routing.timemodel import TimeModel
from kvlearn.routing.traces import multi_tenant_trace
from tests.hf_reference import hf_greedy

TM = TimeModel(overhead_s=0.01, prefill_s_per_token=2e-4, decode_s_per_seq=2e-3, attention_s_per_context_token=1e-6)


def small_trace():
    # 3 tenants, single turns: what is cached never depends on what the model answers
    return multi_tenant_trace(10, num_tenants=3, mean_turns=1, system_tokens=(30, 60), question_tokens=(3, 8),
                              output_tokens=(3, 5), rate=40, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cache_aware", "exact"])
def test_real_engines_route_and_hit_like_the_simulation(model, tokenizer, policy):
    trace = small_trace()
    engines = [Engine(model, tokenizer, cache="radix", num_slots=512) for _ in range(3)]
    real = run_fleet(trace, make_policy(policy, 3), [EngineReplica(e) for e in engines], TM, keep_outputs=True)
    # the simulation generates filler tokens: only a run where no request stopped early at EOS can match it
    assert all(len(real.outputs[r.id]) == r.max_new_tokens for r in trace)
    sim = run_fleet(trace, make_policy(policy, 3), [SimReplica("radix", 512) for _ in range(3)], TM)
    keys = ("requests", "cached_tokens", "computed_prefill_tokens")
    assert [[p[k] for k in keys] for p in real.per_replica] == [[p[k] for k in keys] for p in sim.per_replica]
    assert real.cached_tokens > 0 and len({p["requests"] for p in real.per_replica}) > 1
    assert (real.ttft_p99_s, real.makespan_s) == (sim.ttft_p99_s, sim.makespan_s)
    for r in trace:
        assert real.outputs[r.id] == hf_greedy(model, r.prompt_ids, r.max_new_tokens), r.id


@pytest.mark.slow
def test_calibrate_times_the_real_model(model, tmp_path):
    from kvlearn.routing.timemodel import calibrate

    lines = []
    tm = calibrate(model, rounds=1, progress=lines.append)
    assert len(lines) == 13 and all(line.strip().startswith("prefill") for line in lines)
    assert "threads" in tm.measured_on and tm.step_s(1024, 0, 1024) > 0
    assert TimeModel.load(tm.save(tmp_path / "tm.json")) == tm
