"""Decode throughput: sequences packed into one forward vs one forward per sequence; and how
close one packed decode step comes to the memory floor.

    python -m kvlearn.bench.decode [--batch 16] [--steps 16] [--repeats 3] [--fast]

Both sides use the same runner, pool and paged attention; only the packing differs. Each round
times a few decode steps of the packed batch, then the same number of tokens one sequence at a
time, so both see the same machine load; the best round of each is reported (timings on a shared
CPU are noisy, the best is the least disturbed).

A decode step must read every weight once, so one floor is weight bytes / memory bandwidth. It
must also multiply every weight by every sequence's token: 2 x batch x parameters FLOPs, so the
other floor is that over the machine's matrix-product rate. On a few CPU cores the second can be the
higher one already at a batch of 16. `step_efficiency` times a packed decode step, a plain read
(`sum`) of as many bytes as the weights, and a large square matrix product (through the fast path's
`PackedLinear`, the fastest product this machine offers: oneDNN beats MKL about 2x on AMD CPUs),
in alternating rounds.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlearn.decoding import weight_bytes

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three prime numbers.", "What is 12 times 7?", "Name a famous painter.",
    "How do bees make honey?", "Give me a tip for learning to cook.", "Why is the sky blue?",
    "What does a compiler do?", "Suggest a name for a cat.", "How many legs does a spider have?",
    "What is photosynthesis?", "Tell me a fun fact about octopuses.", "What is the boiling point of water?",
    "Describe a rainbow in one sentence.",
]


class DecodeBatch:
    """`batch` prompts prefilled into the pool, ready to decode; `close()` frees their slots."""

    def __init__(self, runner, prompts):
        self.runner, self.pool, self.slots = runner, runner.pool, []
        try:
            for p in prompts:
                self.slots.append(self.pool.alloc(len(p)))
            self.last = runner.forward([list(p) for p in prompts], self.slots).argmax(-1).tolist()
        except BaseException:
            self.close()
            raise

    def step(self, members: list[int]) -> None:
        """One decode step of the given sequences, packed into one forward."""
        for i in members:
            self.slots[i] = torch.cat([self.slots[i], self.pool.alloc(1)])
        logits = self.runner.forward([[self.last[i]] for i in members], [self.slots[i] for i in members])
        for i, token in zip(members, logits.argmax(-1).tolist(), strict=True):
            self.last[i] = token

    def close(self) -> None:
        for s in self.slots:
            self.pool.free(s)


def decode_tokens_per_s(runner, prompts, steps: int, packed: bool) -> float:
    """Tokens/s over `steps` decode steps of all prompts, packed in one forward per step or one
    forward per sequence."""
    batch = DecodeBatch(runner, prompts)
    try:
        members = list(range(len(prompts)))
        start = time.perf_counter()
        for _ in range(steps):
            if packed:
                batch.step(members)
            else:
                for i in members:
                    batch.step([i])
        return steps * len(prompts) / (time.perf_counter() - start)
    finally:
        batch.close()


def compare(runner, prompts, steps: int = 16, repeats: int = 3) -> dict:
    """Best tokens/s of packed and one-at-a-time decode, measured in alternating rounds."""
    packed, single = [], []
    for _ in range(repeats):
        packed.append(decode_tokens_per_s(runner, prompts, steps, packed=True))
        single.append(decode_tokens_per_s(runner, prompts, steps, packed=False))
    return {"packed": max(packed), "one_at_a_time": max(single), "speedup": max(packed) / max(single)}


def throughput_by_batch(runner, prompts, batch_sizes, steps: int = 4, repeats: int = 2) -> dict[int, float]:
    """Best packed decode tokens/s over `repeats` rounds for each batch size (the first `b` prompts)."""
    best = dict.fromkeys(batch_sizes, 0.0)
    for _ in range(repeats):
        for b in batch_sizes:
            best[b] = max(best[b], decode_tokens_per_s(runner, prompts[:b], steps, packed=True))
    return best


def step_efficiency(model, prompts, fast: bool = False, rounds: int = 6) -> dict:
    """Best time of one packed decode step of `prompts` (prefilled first) through a fresh runner,
    of a plain `sum` over as many bytes as the weights, and of a 1024 x 1024 matrix product, in
    alternating rounds. `efficiency` is the share of that plain read bandwidth the step reaches on
    its weights; `read_floor_ms` and `flop_floor_ms` are the step's two lower bounds (weights at the
    plain read's bandwidth; 2 x batch x weights FLOPs at the product's rate), and `floor_efficiency`
    the larger of them over the step time."""
    from kvlearn.fast import FastLlama, PackedLinear
    from kvlearn.pool import KVPool
    from kvlearn.runner import ModelRunner

    nbytes = weight_bytes(model)
    num_slots = sum(len(p) + rounds + 1 for p in prompts)
    runner = ModelRunner(model, KVPool.for_model(model.config, num_slots=num_slots, device=model.device),
                         model_forward=FastLlama(model).forward if fast else None)
    block = torch.ones(nbytes // 4, dtype=torch.float32, device=model.device)  # touched before timing
    square = torch.randn(1024, 1024, dtype=model.dtype, device=model.device)
    times_square = PackedLinear(square)
    batch = DecodeBatch(runner, prompts)
    members = list(range(len(prompts)))
    step = read = product = float("inf")
    try:
        batch.step(members)  # warm-up
        for _ in range(rounds):
            start = time.perf_counter()
            batch.step(members)
            step = min(step, time.perf_counter() - start)
            start = time.perf_counter()
            block.sum().item()
            read = min(read, time.perf_counter() - start)
            start = time.perf_counter()
            times_square(square)[0, 0].item()
            product = min(product, time.perf_counter() - start)
        context = sum(len(s) for s in batch.slots) / len(prompts)
    finally:
        batch.close()
    flop_rate = 2 * 1024 ** 3 / product
    flop_floor = 2 * len(prompts) * nbytes / block.element_size() / flop_rate
    return {"batch": len(prompts), "mean_context_tokens": round(context, 1), "fast": fast, "weight_bytes": nbytes,
            "step_ms": round(step * 1e3, 2), "weight_read_gb_s": round(nbytes / step / 1e9, 2),
            "plain_read_gb_s": round(nbytes / read / 1e9, 2), "efficiency": round(read / step, 3),
            "matmul_gflop_s": round(flop_rate / 1e9, 1), "read_floor_ms": round(read * 1e3, 2),
            "flop_floor_ms": round(flop_floor * 1e3, 2), "floor_efficiency": round(max(read, flop_floor) / step, 3)}


def describe_efficiency(e: dict) -> str:
    """One line for `step_efficiency`'s result."""
    path = "fast path" if e["fast"] else "plain path"
    return (f"decode step, {path} ({e['batch']} sequences, {e['mean_context_tokens']:.0f} context tokens on average): "
            f"{e['step_ms']:.1f} ms; {e['weight_bytes'] / 1e6:.0f} MB of weights read at "
            f"{e['weight_read_gb_s']:.1f} GB/s = {e['efficiency']:.0%} of a plain read in the same run "
            f"({e['plain_read_gb_s']:.1f} GB/s). Floors: reading the weights {e['read_floor_ms']:.1f} ms; "
            f"multiplying them by {e['batch']} tokens at this machine's matrix-product rate "
            f"({e['matmul_gflop_s']:.0f} GFLOP/s) {e['flop_floor_ms']:.1f} ms; the step is at "
            f"{e['floor_efficiency']:.0%} of the higher floor")


def plot_throughput(by_batch: dict[int, float]):
    """Decode tokens/s against batch size (matplotlib figure). Both axes are linear, so a
    straight line is throughput growing in proportion to the batch; the dashed line is that
    proportional growth from the smallest batch, for comparison."""
    import matplotlib.pyplot as plt

    sizes = sorted(by_batch)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(sizes, [by_batch[b] for b in sizes], marker="o", label="measured")
    ax.plot(sizes, [by_batch[sizes[0]] * b / sizes[0] for b in sizes], linestyle="--", color="grey",
            label="in proportion to the batch")
    ax.set_xlim(0, sizes[-1] * 1.05)
    ax.set_ylim(0, None)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.legend(fontsize=8)
    ax.set_xlabel("sequences decoded in one packed forward")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("paged decode throughput against batch size")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="sequences decoded together (<= 16)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best is kept")
    parser.add_argument("--fast", action="store_true", help="the runner's packed fast path (kvlearn.fast)")
    args = parser.parse_args(argv)
    if not 1 <= args.batch <= len(QUESTIONS) or args.steps < 1 or args.repeats < 1:
        parser.error(f"need 1 <= --batch <= {len(QUESTIONS)}, --steps >= 1, --repeats >= 1")

    from kvlearn.fast import FastLlama
    from kvlearn.model import chat_ids, load_model
    from kvlearn.pool import KVPool
    from kvlearn.runner import ModelRunner

    model, tokenizer = load_model()
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS[:args.batch]]
    pool = KVPool.for_model(model.config, num_slots=4096, device=model.device)
    runner = ModelRunner(model, pool, model_forward=FastLlama(model).forward if args.fast else None)
    decode_tokens_per_s(runner, prompts, 2, packed=True)  # warm-up
    result = compare(runner, prompts, args.steps, args.repeats)
    print(f"device={model.device.type} threads={torch.get_num_threads()} batch={args.batch} "
          f"steps={args.steps} repeats={args.repeats} fast={args.fast}")
    print(f"{'mode':<24}{'decode tokens/s':>16}")
    print(f"{'packed, one forward':<24}{result['packed']:>16.1f}")
    print(f"{'one sequence at a time':<24}{result['one_at_a_time']:>16.1f}")
    print(f"speedup: {result['speedup']:.2f}x")
    result["efficiency"] = step_efficiency(model, prompts, fast=args.fast)
    print(describe_efficiency(result["efficiency"]))
    assert pool.num_free == pool.num_slots
    return result


if __name__ == "__main__":
    main()
