"""Chapter 6 exercises: the unique-token floor, what each cache computes, and lpm's order."""

from kvlearn.exercises import attempt, report

# Exercise 2's prompts (token ids), all submitted at once, one new token each, blocks of 4.
EXERCISE_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9],
                    [1, 2, 3, 4, 5, 6, 7, 8, 10, 11],
                    [1, 2, 3, 4, 5, 6, 20])
EXERCISE_BLOCK_SIZE = 4


def check_unique_token_floor(fn) -> bool:
    """Exercise 1: `fn(prompts) -> int`, the number of distinct token prefixes across prompts."""
    from kvlearn.serving.workloads import unique_token_floor

    cases = [[], [[1]], [[1, 2, 3], [1, 2, 4]], [[1, 2], [1, 2]], [[5], [5, 6], [7]],
             [[3, 1, 4, 1, 5], [3, 1, 4, 2], [2, 7, 1], [3, 1]], [list(range(50)), list(range(25)) + [99]]]
    for prompts in cases:
        got, error = attempt(fn, [list(p) for p in prompts])
        if error:
            return report(False, f"{error} on {prompts}.")
        if got != unique_token_floor(prompts):
            return report(False, f"for {prompts} the floor is {unique_token_floor(prompts)}, you returned {got}. "
                                 "Count every prefix p[:i] (i >= 1) once, however many prompts start with it.")
    return report(True, "")


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


def check_lpm_order(fn) -> bool:
    """Exercise 3: `fn(waiting, cached) -> list`, the waiting request ids in the order lpm tries
    them: longest cached prefix first, first come first served among equals."""
    cases = [(["a", "b", "c"], {"a": 0, "b": 40, "c": 8}),
             (["a", "b", "c", "d"], {"a": 16, "b": 0, "c": 16, "d": 32}),
             (["r3", "r1", "r2"], {"r3": 8, "r1": 8, "r2": 0}), (["x"], {"x": 0}), ([], {})]
    for waiting, cached in cases:
        want = sorted(waiting, key=lambda r: -cached[r])  # sorted() is stable
        got, error = attempt(fn, list(waiting), dict(cached))
        if error or not isinstance(got, (list, tuple)):
            return report(False, error or f"return a list of request ids, got {got!r}.")
        if list(got) != want:
            return report(False, f"for waiting={waiting}, cached={cached} lpm tries {want}, you gave {got}. "
                                 "Ties keep their arrival order.")
    return report(True, "")
