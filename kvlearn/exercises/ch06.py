"""Chapter 6 exercises: what radix computes with repeated prompts (is the floor reached?), what each cache
computes, and which assumption of Theorem 3.1 a batching engine breaks when lpm loses to fcfs.
(The chapter's build exercise, the scheduler's step, is checked by kvlearn.parts.check("scheduler", ...).)"""

from kvlearn.exercises import attempt, given, likely_mistake, report

# Exercise 2's prompts (token ids), all submitted at once, one new token each, blocks of 4.
EXERCISE_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9],
                    [1, 2, 3, 4, 5, 6, 7, 8, 10, 11],
                    [1, 2, 3, 4, 5, 6, 20])
EXERCISE_BLOCK_SIZE = 4


def check_computed_prefill(radix: int, blocks: int) -> bool:
    """Exercise 2: prompt tokens the engine computes for EXERCISE_PROMPTS with each cache."""
    from kvlearn.serving.simulate import simulate

    want = {cache: simulate(EXERCISE_PROMPTS, cache, max_new_tokens=1,
                            page_size=EXERCISE_BLOCK_SIZE if cache == "blocks" else 1)["computed_prefill_tokens"]
            for cache in ("radix", "blocks")}
    if radix != want["radix"]:
        return report(False, "radix: the first prompt is computed in full; the others wait a step (they share "
                             "its uncomputed prefix), then compute only what the tree does not hold.")
    if blocks != want["blocks"]:
        return report(False, "blocks: only whole blocks of 4 are shared, and a prompt never takes its last "
                             "token from the cache: count the full blocks before the last token that match.")
    return report(True, "")


FLOOR_CASES = [[[1, 2, 3], [1, 2, 3]], [[1, 2, 3, 4], [1, 2]], [[1, 2], [1, 2, 3, 4]], [[1, 2, 3]] * 3,
               [[5, 6, 7], [1, 2, 3], [5, 6, 7], [5, 6]], [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 5], [1, 2, 3]],
               [[4, 4], [4, 4, 4], [4]]]


def check_radix_prefill(fn) -> bool:
    """Exercise 1: `fn(prompts) -> int`, the prompt tokens the radix engine computes when the prompts
    are submitted together (fcfs, a roomy pool): the floor, plus what the floor cannot see."""
    from kvlearn.serving.simulate import simulate
    from kvlearn.serving.workloads import unique_token_floor

    for prompts in FLOOR_CASES:
        want = simulate(prompts, "radix", max_new_tokens=1)["computed_prefill_tokens"]
        shown = given(prompts=prompts)
        got, error = attempt(fn, [list(p) for p in prompts], shown=shown)
        if error or got != want:
            return report(False, error or f"{shown}: radix computes {want}, you said {got}. " + (likely_mistake(got, [
                (sum(map(len, prompts)), "That is every prompt token: the tree computes a prefix it already holds "
                                         "only once."),
                (unique_token_floor(prompts), "That is the floor, which counts each prefix once; but which token "
                                              "does a prompt always compute, even when the tree already holds all "
                                              "of it?")]) or
                "The floor counts each prefix once; but which token does a prompt always compute, even when the tree "
                "already holds all of it?"))
    return report(True, "")


THEOREM_CHOICES = {
    "a": "lpm's admission order is a depth-first order of the requests' radix tree",
    "b": "the cache can hold the longest request, prompt and output",
    "c": "nothing but the radix tree takes the cache's slots",
}


def theorem_workload():
    """Exercise 3's workload: the notebook's 18 few-shot requests (`few`)."""
    from kvlearn.model import load_tokenizer
    from kvlearn.serving.workloads import make_workload

    return make_workload("few_shot", load_tokenizer(), num_requests=18)


def check_theorem(longest: int, computed_1: dict, preemptions_16: dict, broken: str) -> bool:
    """Exercise 3: on theorem_workload() with a 320-slot radix pool: the most KV slots one request
    needs with 16 new tokens, the prompt tokens fcfs and lpm compute when each request generates 1
    token, the preemptions each suffers with 16, and the letter of the Theorem 3.1 assumption
    (THEOREM_CHOICES) that the 16-token run breaks: the one these numbers leave standing."""
    from kvlearn.serving.simulate import simulate

    workload = theorem_workload()
    if longest != max(len(p) + 16 - 1 for p in workload.prompt_lists()):
        return report(False, "longest: a request holds KV for its prompt and every output token but the last; "
                             "take the largest over few.prompt_lists(), with 16 new tokens.")
    if not (isinstance(computed_1, dict) and isinstance(preemptions_16, dict)):
        return report(False, "give two dicts {'fcfs': .., 'lpm': ..}: tokens computed with 1 output token, "
                             "preemptions with 16.")
    want = {n: {s: simulate(workload, "radix", max_new_tokens=n, num_slots=320, schedule=s)
                for s in ("fcfs", "lpm")} for n in (1, 16)}
    if computed_1 != {s: want[1][s]["computed_prefill_tokens"] for s in want[1]}:
        return report(False, "measure computed_prefill_tokens with simulate(few, 'radix', max_new_tokens=1, "
                             "num_slots=320, schedule=s) for s in ('fcfs', 'lpm'); "
                             "give a dict {'fcfs': .., 'lpm': ..}.")
    if preemptions_16 != {s: want[16][s]["preemptions"] for s in want[16]}:
        return report(False, "measure stats['preemptions'] the same way with max_new_tokens=16.")
    return report(broken == "c", likely_mistake(broken, [
        ("a", "with 1 output token lpm computes no more than fcfs: its depth-first order still pays off. What do "
              "16 output tokens add?"),
        ("b", f"the longest request needs {longest} slots, under the pool's 320: that assumption holds.")]) or
        "each number tests one choice: does the longest request fit in 320 slots? With "
                                 "1 output token, does lpm's order still lose? What takes slots in the 16-token "
                                 "run that the theorem does not count?")
