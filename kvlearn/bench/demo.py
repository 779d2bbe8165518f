"""The main job: the real model decoding with and without a KV cache, then the serving engine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvlearn.device import resolve_device
from kvlearn.serving.workloads import LIBRARY_QUESTIONS

PROMPT = "Explain in a few sentences why the sky is blue."


def device_arg(text: str) -> str:
    """argparse `type` of --device (demo and bench): a device kvlearn cannot use is a usage error."""
    try:
        resolve_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def chapter0(model, tokenizer, max_new_tokens: int) -> None:
    from kvlearn.decoding import compare, plot_step_times
    from kvlearn.memory import kv_table
    from kvlearn.model import chat_ids
    from kvlearn.progress import progress_bar
    from kvlearn.viz.plots import save_figure

    prompt_ids = chat_ids(tokenizer, PROMPT)
    with progress_bar(total=2 * max_new_tokens, desc="decoding twice", unit="tok") as bar:
        result = compare(model, prompt_ids, max_new_tokens, progress=bar.update)
    print(f"\n== Chapter 0: why a KV cache ==\nprompt: {PROMPT}")
    print(f"answer: {tokenizer.decode(result.tokens, skip_special_tokens=True).strip()}\n")
    print(result.report())
    print(f"figure: {save_figure(plot_step_times(result), 'ch0_decode_time')}")
    print("\nKV cache size per token (bf16) and what fits in 1 GiB:\n" + kv_table())


def engine(model, tokenizer, num_requests: int = 8, max_new_tokens: int = 32, show: int = 3,
           out_dir: Path | None = None) -> bool:
    """Serve the shared-system-prompt workload with the radix cache and with no cache; print a few
    answers and both runs' stats; write the radix tree (demo_radix_tree.svg) and the comparison
    plot (demo_engine.png) to `out_dir` (default: the nearest figures/). Returns whether both runs
    gave the same tokens."""
    from kvlearn.bench.peers import run_kvlearn
    from kvlearn.bench.report import plot, save_plot, table
    from kvlearn.serving.workloads import make_workload
    from kvlearn.viz import draw_radix
    from kvlearn.viz.plots import figures_dir

    workload = make_workload("shared_system", tokenizer, num_requests=num_requests)
    print(f"\n== Chapter 6: the serving engine ==\n{workload!r}")
    results, engines = [], {}
    for cache in ("radix", "none"):
        result, engines[cache] = run_kvlearn(model, tokenizer, workload, cache, max_new_tokens, progress=True)
        results.append(result)
    for label, out in list(zip(workload.labels, results[0].outputs, strict=True))[:show]:
        print(f"\nQ: {label}\nA: {tokenizer.decode(out, skip_special_tokens=True).strip()}")
    print("\n" + table(results, workload))
    radix = engines["radix"].stats
    print(f"radix: {radix['cached_tokens']:,} of {radix['prompt_tokens']:,} prompt tokens came from the cache "
          f"(hit rate {radix['hit_rate']:.0%}), {radix['steps']} steps, peak {radix['peak_slots']:,} KV slots")
    out_dir = figures_dir() if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    svg = out_dir / "demo_radix_tree.svg"
    svg.write_bytes(draw_radix(engines["radix"].cache, tokenizer).pipe(format="svg"))
    png = save_plot(plot(results, workload), out_dir, "demo_engine")
    print(f"figures: {svg}, {png}")
    same = results[0].outputs == results[1].outputs
    print("same greedy tokens with and without the cache: " + ("yes" if same else "NO"))
    return same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn demo", description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--requests", type=int, default=8,
                        help=f"requests served by the engine (1-{len(LIBRARY_QUESTIONS)})")
    parser.add_argument("--device", default=None, type=device_arg, help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if not 1 <= args.requests <= len(LIBRARY_QUESTIONS):
        parser.error(f"--requests must be between 1 and {len(LIBRARY_QUESTIONS)}")

    import matplotlib

    matplotlib.use("Agg")
    from kvlearn.model import load_model

    start = time.perf_counter()
    model, tokenizer = load_model(device=args.device)
    print(f"model loaded in {time.perf_counter() - start:.1f} s on {model.device}")
    chapter0(model, tokenizer, args.max_new_tokens)
    same = engine(model, tokenizer, args.requests, args.max_new_tokens)
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")
    return 0 if same else 1

