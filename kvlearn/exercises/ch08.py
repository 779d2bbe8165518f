"""Chapter 8 exercises: what a host tier keeps under each write policy, and what a crash leaves
on disk. Both serve the same five prompts, A to E, through a small TieredRadixCache."""

import tempfile

import torch

from kvlearn.exercises import report

POLICIES = ("write_back", "write_through")

# Five prompts of 4 tokens that share nothing, served one after the other; each stays in the
# cache after it is served (as a finished request's KV does in chapter 6).
PROMPTS = {name: [10 * i + t for t in range(1, 5)] for i, name in enumerate("ABCDE", start=1)}
DEVICE_SLOTS = HOST_SLOTS = 8   # two prompts each
PAGE_TOKENS = 4                 # a disk page is one whole prompt


def serve(write_policy: str, disk_dir=None):
    """Serve PROMPTS in order on a device pool of DEVICE_SLOTS with a host pool of HOST_SLOTS (and a
    disk store in `disk_dir`, if given): each prompt takes fresh slots, evicting what it must, and
    is inserted into the tree. Returns the tree."""
    from kvlearn.pool import KVPool
    from kvlearn.tiers.disk import DiskStore
    from kvlearn.tiers.host import host_pool_for
    from kvlearn.tiers.tree import TieredRadixCache

    device = KVPool(1, 1, 1, DEVICE_SLOTS)
    disk = DiskStore(disk_dir, "ch08", torch.float32, (1, 1, 1), page_tokens=PAGE_TOKENS) if disk_dir else None
    tree = TieredRadixCache(device, host_pool_for(device, HOST_SLOTS), disk, write_policy=write_policy)
    for key in PROMPTS.values():
        if device.num_free < len(key):
            tree.evict(len(key) - device.num_free)
        slots = device.alloc(len(key))
        device.kv[0, :, slots] = torch.tensor(key, dtype=torch.float32).view(1, -1, 1, 1)  # a token's "KV": its id
        tree.insert(key, slots)
    return tree


def kept_in_memory(write_policy: str) -> set[str]:
    """The prompts whose whole KV is still in the tree (on the device or on the host) after `serve`."""
    tree = serve(write_policy)
    return {name for name, key in PROMPTS.items() if tree.match_len(key) == len(key)}


def on_disk_after_crash(write_policy: str) -> set[str]:
    """The prompts a new process finds on disk after `serve` with a disk, ended by a crash (no
    flush, no clean exit): whatever was written to the folder by then."""
    from kvlearn.pool import KVPool
    from kvlearn.tiers.disk import DiskStore
    from kvlearn.tiers.tree import TieredRadixCache

    with tempfile.TemporaryDirectory() as folder:
        serve(write_policy, folder)  # ... and the process dies here
        fresh = TieredRadixCache(KVPool(1, 1, 1, DEVICE_SLOTS),
                                 disk=DiskStore(folder, "ch08", torch.float32, (1, 1, 1), page_tokens=PAGE_TOKENS))
        return {name for name, key in PROMPTS.items() if fresh.reachable_len(key) == len(key)}


def _check_per_policy(answer, truth, hints: dict) -> bool:
    """Compare {policy: prompt names} with `truth(policy)` for each policy, in the order of `hints`
    (policy -> the hint for a wrong answer there)."""
    try:
        got = {p: {str(n).upper() for n in answer[p]} for p in POLICIES} if set(answer) == set(POLICIES) else None
    except TypeError:  # not a dict of iterables: a stub (`...`, None) or a number
        got = None
    if got is None:
        return report(False, "answer with a dict {'write_back': {...}, 'write_through': {...}} of prompt names "
                             "such as 'A'.")
    for policy, hint in hints.items():
        if got[policy] != truth(policy):
            return report(False, f"{policy}: {hint}")
    return report(True, "")


def check_host_keeps(answer) -> bool:
    """Exercise 1: `answer` = {"write_back": prompts, "write_through": prompts}: the prompts of
    PROMPTS whose KV is still cached (device or host) after `serve(policy)`, no disk."""
    return _check_per_policy(answer, kept_in_memory, {
        "write_back": "follow the device's evictions (least recently used first): where does each evicted "
                      "prompt go, and what must the host drop once it is full?",
        "write_through": "every prompt is copied to the host when it is inserted, so what do the host's slots "
                         "hold while that prompt is still on the device?"})


def check_crash_survivors(answer) -> bool:
    """Exercise 2: `answer` = {"write_back": prompts, "write_through": prompts}: the prompts a new
    process finds on disk after `serve(policy, disk_dir)` ends in a crash."""
    return _check_per_policy(answer, on_disk_after_crash, {
        "write_through": "when is a prompt's page written to disk, and can a crash come between its insert "
                         "and that write?",
        "write_back": "it writes a page down only when its node leaves memory altogether: which prompts left "
                      "the host before the crash?"})
