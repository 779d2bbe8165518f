"""A learner's decode kernel, however wrong its addresses, never ends the process that checks or serves
it: in Triton's interpreter every access is checked before it is made (kvlearn.kernels.decode_rules).
Each wrong kernel runs in a child process, so a segfault would fail the test, not end pytest."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvlearn.kernels
from kvlearn.parts.suite_decode_kernel import HINTS

pytestmark = pytest.mark.skipif(kvlearn.kernels.triton_import_error() is not None,
                                reason="Triton has no wheels for this platform (Linux only)")

ROOT = Path(__file__).resolve().parents[1]
WRONG = {   # a learner's plausible mistake (old -> new in the worked kernel) -> the rule its verdict names
    "table indexed by position": ("pos // PAGE_SIZE, mask=ok", "pos, mask=ok", "table index"),   # right for pages of 1
    "row left out": ("table + b * stride_tb + pos", "table + pos", "table row"),
    "table load without its mask": ("pos // PAGE_SIZE, mask=ok, other=0)", "pos // PAGE_SIZE)", "table mask"),
    "slot past the pool": ("page * PAGE_SIZE + pos % PAGE_SIZE", "page * PAGE_SIZE + pos", "slot"),   # not at 50
    "slot far outside the pool": ("slot = page * PAGE_SIZE", "slot = page * 100000 * PAGE_SIZE", "outside"),
    "query row far away": ("query + b * stride_qt", "query + b * 100000 * stride_qt", "outside"),
    "a store into the cache": ("tl.store(part_lse + b", "tl.store(k_cache + b", "store"),
}
CHILD = """
import json, os, sys, torch
from pathlib import Path
from kvlearn.attention import AttentionMetadata
from kvlearn.errors import PartError
from kvlearn.parts import check
from kvlearn.parts.guard import GUARDS
from kvlearn.pool import KVPool
from kvlearn.viz.kernel_reads import kernel_reads
from tests.kernel_variants import kernel_copy

old, new, folder = sys.argv[1:]
kernel = kernel_copy(Path(folder), old, new)
report = check("decode_kernel", kernel)
pool = KVPool(1, 1, 16, 64, page_size=1, device="cpu")
md = AttentionMetadata.build([1, 1], [torch.arange(20), torch.arange(20, 50)], device="cpu")
query, key = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
try:
    GUARDS["decode_kernel"](kernel)(query, key, key, 0, pool, md)
    served = "served"
except PartError as error:
    served = str(error)
gap = torch.randn(2 * 8 * 16 + 1000, 1, 16)   # pages of 16, as chapter 5's picture; K and V apart in memory
caches = gap[:8 * 16], gap[-8 * 16:]
reads = kernel_reads(kernel, query, *caches, torch.tensor([[7, 2, 5, 0], [7, 2, 3, 0]]), torch.tensor([50, 40]),
                     0.25, 16, 2)
print(json.dumps({"passed": report.passed, "message": report.message, "served": served, "stopped": reads.stopped}))
"""


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_address_is_a_verdict_in_check_serving_and_the_picture(mistake, tmp_path):
    old, new, rule = WRONG[mistake]
    run = subprocess.run([sys.executable, "-c", CHILD, old, new, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, f"{mistake}: the child ended with {run.returncode}\n{run.stderr[-2000:]}"
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert not said["passed"] and "program (b=" in said["message"], said["message"]
    assert f"Hint: {HINTS[rule]}" in said["message"], said["message"]
    if rule == "table index":   # the engine's table holds slots (pages of 1): an entry per position is right
        assert said["served"] == "served"
    else:
        assert "broke its contract" in said["served"] and "decode_rules" in said["served"], said["served"]
    if mistake != "slot past the pool":   # the picture's contexts (50, 40) in pages of 16 stay inside its pool
        assert said["stopped"] and said["stopped"].startswith("program (b="), said
