"""Chapter 8 exercises: choose a write policy by measuring it, and predict which nodes demote."""

from kvlearn.exercises import report

# Exercise 1's workload: two conversations of three turns (token ids), served round by round in a
# device pool that holds them all: nothing is ever evicted.
EXERCISE_ROUNDS = ([[1] * 20 + [2] * 10, [3] * 20 + [4] * 10],
                   [[1] * 20 + [2] * 10 + [5] * 8, [3] * 20 + [4] * 10 + [6] * 8],
                   [[1] * 20 + [2] * 10 + [5] * 8 + [7] * 8, [3] * 20 + [4] * 10 + [6] * 8 + [8] * 8])
EXERCISE_SLOTS, EXERCISE_HOST_SLOTS = 512, 512


def measure(write_policy: str) -> dict:
    """The stats of EXERCISE_ROUNDS under one write policy (with kvlearn.tiers.simulate)."""
    from kvlearn.tiers.simulate import simulate_tiers

    return simulate_tiers(EXERCISE_ROUNDS, EXERCISE_SLOTS, EXERCISE_HOST_SLOTS, write_policy, max_new_tokens=4)


def check_write_policy(choice, offloaded: dict) -> bool:
    """Exercise 1: `offloaded` = {policy: offloaded_tokens measured with `measure`}, `choice` the
    policy you would run for this workload."""
    want = {p: measure(p)["offloaded_tokens"] for p in ("write_back", "write_through")}
    if not isinstance(offloaded, dict) or offloaded != want:
        return report(False, "measure both policies with ch08.measure(policy)['offloaded_tokens'] and pass "
                             "them as {'write_back': ..., 'write_through': ...}.")
    if choice != "write_back":
        return report(False, "the pool never evicts here: which policy copies KV that is never needed below?")
    return report(True, "")


def exercise_tree():
    """Exercise 2's tree: a device pool of 16 slots with a host tier, three prompts inserted."""
    from kvlearn.pool import KVPool
    from kvlearn.tiers.host import host_pool_for
    from kvlearn.tiers.tree import TieredRadixCache

    pool = KVPool(1, 1, 1, 16)
    tree = TieredRadixCache(pool, host_pool_for(pool, 16))
    for key in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9], [1, 2, 3, 4]):  # the last one touches #1 again
        slots = pool.alloc(len(key))
        pool.free(slots[:tree.insert(key, slots)])  # our copies of tokens the tree already had
    return tree


def check_demotions(answer) -> bool:
    """Exercise 2: `answer` = the node ids that `exercise_tree().evict(5)` moves to the host, in order."""
    tree = exercise_tree()
    before = {n.id for n in tree.nodes() if "device" in tree.tiers(n)}
    order = []
    original = tree.evict_node

    def spy(node):
        order.append(node.id)
        return original(node)

    tree.evict_node = spy
    tree.evict(5)
    assert before >= set(order)
    if not isinstance(answer, (list, tuple)) or list(answer) != order:  # a stub (...) is "Not yet" too
        return report(False, "only nodes none of whose children is on the device are candidates, least "
                             "recently used first (t= in tiers_text); a parent joins once its children left.")
    return report(True, "")
