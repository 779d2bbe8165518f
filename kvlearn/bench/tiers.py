"""Chapter 8's measurements: what tiers below the device pool save, and what a load costs.

    python -m kvlearn.bench.tiers [--json]

1. Multi-turn chat (each round of turns one `generate` call, as users take turns) with a device
   pool of ~20% of what the workload needs: computed prefill and wall time with no tiers, a host
   tier, host + disk, and host + a disk capped at half of what that run wrote (least recently
   used pages deleted); the tokens must be identical in all four.
2. Per token, the time to bring KV back from the host and from disk against recomputing it.
3. Restart: the same workload in a fresh process (`--restart DIR`) with the disk folder warm.
Timings depend on the machine and its load; the ratios printed together come from one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch

from kvlearn.model import load_model
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner
from kvlearn.serving.engine import Engine
from kvlearn.serving.workloads import make_workload
from kvlearn.tiers.disk import DiskStore, model_identity
from kvlearn.tiers.host import copy_kv, host_pool_for

CHAT = dict(num_conversations=3, num_turns=4)
MAX_NEW = 16
KEYS = ("computed_prefill_tokens", "cached_tokens", "offloaded_tokens", "loaded_from_host_tokens",
        "loaded_from_disk_tokens", "evicted_tokens", "preemptions")
DISK_KEYS = ("disk_pages_written", "disk_pages_evicted")  # with a disk tier only


def chat_workload(tokenizer):
    chat = make_workload("multi_turn", tokenizer, **CHAT)
    need = sum(len(p) + MAX_NEW for p in chat.prompts)
    device_slots = max(need // 5, max(len(p) for p in chat.prompts) + MAX_NEW)
    return chat, need, device_slots


def serve_chat(engine, chat) -> tuple[dict, list]:
    """Run the chat round by round; sum the stats of every round; return them and the tokens."""
    rounds, per_round = CHAT["num_turns"], CHAT["num_conversations"]
    keys = KEYS + (DISK_KEYS if getattr(engine.cache, "disk", None) is not None else ()) + ("wall_time_s",)
    total, tokens = dict.fromkeys(keys, 0), []
    for r in range(rounds):
        outputs = engine.generate(chat.prompt_lists()[r * per_round:(r + 1) * per_round], max_new_tokens=MAX_NEW)
        tokens += [o.token_ids for o in outputs]
        total = {k: total[k] + engine.stats[k] for k in total}
    total["wall_time_s"] = round(total["wall_time_s"], 3)
    if "disk_pages_written" in total:
        total["disk_bytes"] = engine.cache.disk.used_bytes()
    return total, tokens


def tier_runs(model, tokenizer, disk_dir, capped_dir) -> dict:
    chat, need, device_slots = chat_workload(tokenizer)
    with_disk = dict(host_slots=need // 4, disk_dir=disk_dir, write_policy="write_through")
    configs = {"no tiers": {}, "host": dict(host_slots=need), "host+disk": with_disk,
               "host+capped disk": dict(with_disk, disk_dir=capped_dir)}
    runs, reference = {}, None
    for name, options in configs.items():
        if name == "host+capped disk":  # half of what the uncapped disk held at the end
            options["disk_max_bytes"] = runs["host+disk"]["disk_bytes"] // 2
        stats, tokens = serve_chat(Engine(model, tokenizer, num_slots=device_slots, **options), chat)
        reference = reference or tokens
        stats["same_tokens"] = tokens == reference
        runs[name] = stats
    return {"workload": repr(chat), "prompt_tokens": chat.num_prompt_tokens, "need_slots": need,
            "device_slots": device_slots, "runs": runs}


def _best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def load_vs_recompute(model, tokenizer, disk_dir, n: int = 256) -> dict:
    """Seconds per token: copy host -> device, read disk pages -> device, recompute by prefill."""
    pool = KVPool.for_model(model.config, num_slots=2 * n, dtype=model.dtype, device=model.device)
    host = host_pool_for(pool, n)
    runner, prompt = ModelRunner(model, pool), list(range(100, 100 + n))
    slots, host_slots = pool.alloc(n), host.alloc(n)
    with torch.no_grad():
        recompute = _best_of(lambda: runner.forward([prompt], [slots]))
    copy_kv(pool, slots, host, host_slots)
    from_host = _best_of(lambda: copy_kv(host, host_slots, pool, slots))
    store = DiskStore(disk_dir, model_identity(model), pool.dtype, (pool.num_layers, pool.num_kv_heads, pool.head_dim),
                      page_tokens=16)
    hashes = store.entry_keys(prompt)
    for i, h in enumerate(hashes):
        store.put(h, prompt[16 * i:16 * (i + 1)], pool.kv.index_select(2, slots[16 * i:16 * (i + 1)]))

    def from_disk():
        for i, h in enumerate(hashes):
            pool.kv.index_copy_(2, slots[16 * i:16 * (i + 1)], store.get(h, prompt[16 * i:16 * (i + 1)]))

    disk = _best_of(from_disk)
    per_token = {"recompute": recompute / n, "host": from_host / n, "disk": disk / n}
    return {"tokens": n, "bytes_per_token": pool.bytes_per_token,
            "us_per_token": {k: round(v * 1e6, 2) for k, v in per_token.items()},
            "recompute_over": {k: round(recompute / t, 1) for k, t in (("host", from_host), ("disk", disk))}}


def restart_run(disk_dir) -> dict:
    """In this (fresh) process: the chat with only a warm disk folder below the device."""
    model, tokenizer = load_model()
    chat, _, device_slots = chat_workload(tokenizer)
    stats, _ = serve_chat(Engine(model, tokenizer, num_slots=device_slots, disk_dir=disk_dir), chat)
    return stats


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m kvlearn.bench.tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--restart", metavar="DIR", help=argparse.SUPPRESS)  # the child of measurement 3
    args = parser.parse_args(argv)
    if args.restart:
        print(json.dumps(restart_run(args.restart)))
        return {}
    model, tokenizer = load_model()
    with tempfile.TemporaryDirectory(prefix="kvlearn-tiers-") as disk_dir, \
            tempfile.TemporaryDirectory(prefix="kvlearn-capped-") as capped_dir, \
            tempfile.TemporaryDirectory(prefix="kvlearn-load-") as load_dir:
        result = tier_runs(model, tokenizer, disk_dir, capped_dir)
        result["load_vs_recompute"] = load_vs_recompute(model, tokenizer, load_dir)
        child = subprocess.run([sys.executable, "-m", "kvlearn.bench.tiers", "--restart", disk_dir],
                               capture_output=True, text=True, check=True)
        result["restart_fresh_process"] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1) if args.json else _report(result))
    return result


def _report(r: dict) -> str:
    lines = [f"{r['workload']}: {r['prompt_tokens']} prompt tokens; device pool {r['device_slots']} slots "
             f"of the {r['need_slots']} it needs without sharing"]
    lines.append(f"{'':<22}{'computed prefill':>17}{'wall s':>9}{'from host':>10}{'from disk':>10}"
                 f"{'disk pages':>11}{'evicted':>8}{'same tokens':>12}")
    runs = dict(r["runs"], **{"restart (disk only)": r["restart_fresh_process"]})
    for name, s in runs.items():
        lines.append(f"{name:<22}{s['computed_prefill_tokens']:>17}{s['wall_time_s']:>9}"
                     f"{s['loaded_from_host_tokens']:>10}{s['loaded_from_disk_tokens']:>10}"
                     f"{s.get('disk_pages_written', ''):>11}{s.get('disk_pages_evicted', ''):>8}"
                     f"{str(s.get('same_tokens', '')):>12}")
    lv = r["load_vs_recompute"]
    lines.append(f"per token ({lv['bytes_per_token']} bytes of KV): " + ", ".join(
        f"{k} {v} us" for k, v in lv["us_per_token"].items())
        + f"; recompute / load: host {lv['recompute_over']['host']}x, disk {lv['recompute_over']['disk']}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
