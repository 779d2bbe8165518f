"""Bad input to the launchers of `kvlearn.kernels` (issue 45's table, what a learner experimenting in
a notebook meets, and a few more): each case is refused with a message that names the argument and says what to do,
never a segfault, a NaN or a silent result. The cases run in one subprocess with the range checks on
(`check_ranges(True)`, as gpu-check does on CUDA), so that a crash fails the test instead of killing
pytest. Two cases of the table are no longer errors: slot -1 is padding, and head_dim 80 works."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton has no wheels for this platform (Linux only): the triton backend is "
                                     "refused here, and its kernel tests skip")

import torch  # noqa: E402

from kvlearn.attention import AttentionMetadata, attend  # noqa: E402
from kvlearn.device import resolve_device  # noqa: E402
from kvlearn.kernels.common import check_ranges  # noqa: E402
from kvlearn.kernels.decode import paged_decode_attention  # noqa: E402
from kvlearn.kernels.extend import extend_attention  # noqa: E402
from kvlearn.kernels.store import store_kvcache  # noqa: E402
from kvlearn.pool import KVPool  # noqa: E402

DEVICE = resolve_device(None)
CASES = {}   # name -> (case, the exception's type name or None, the argument its message names)


def case(error: str | None, argument: str | None = None):
    def register(fn):
        CASES[fn.__name__] = (fn, error, argument)
        return fn
    return register


def tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def pool(head_dim: int = 16, kv_heads: int = 2, slots: int = 32) -> KVPool:
    p = KVPool(1, kv_heads, head_dim, slots, device=DEVICE)
    p.kv.normal_()
    return p


def decode(query_heads: int = 6, kv_lens=(5, 3), table=((1, 2, 3, 4, 5), (6, 7, 8, 0, 0)), kv_heads: int = 2):
    p = pool(kv_heads=kv_heads)
    query = torch.randn(len(table), query_heads, 16, device=DEVICE)
    paged_decode_attention(query, p.k[0], p.v[0], tensor(table), tensor(kv_lens), 0.25)


@case("ValueError", "slot_mapping")
def store_a_slot_equal_to_the_pools_size():
    p, key = pool(), torch.randn(3, 2, 16, device=DEVICE)
    store_kvcache(key, key, p.k[0], p.v[0], tensor([0, 5, 32]))


@case(None)
def store_slot_minus_one_is_padding_written_nowhere():
    p, key = pool(), torch.randn(2, 2, 16, device=DEVICE)
    before = p.kv.clone()
    store_kvcache(key, key, p.k[0], p.v[0], tensor([-1, 7]))
    assert torch.equal(p.kv[:, :, torch.arange(32) != 7], before[:, :, torch.arange(32) != 7])
    assert torch.equal(p.k[0][7], key[1])


@case("ValueError", "slot_mapping")
def store_slot_minus_two():
    p, key = pool(), torch.randn(2, 2, 16, device=DEVICE)
    store_kvcache(key, key, p.k[0], p.v[0], tensor([-2, 7]))


@case("ValueError", "slot_mapping")
def store_slot_mapping_shorter_than_key():
    p, key = pool(), torch.randn(40, 2, 16, device=DEVICE)
    store_kvcache(key, key, p.k[0], p.v[0], tensor([0, 1, 2]))


@case("ValueError", "table")
def decode_a_table_entry_outside_the_pool():
    decode(table=((1, 2, 3, 4, 5), (6, 7, 10**6, 0, 0)))


@case("ValueError", "kv_lens")
def decode_kv_lens_of_another_batch_size():
    decode(kv_lens=(5, 3, 4))


@case("ValueError", "kv_lens")
def decode_kv_len_0():
    decode(kv_lens=(5, 0))


@case("ValueError", "kv_lens")
def decode_kv_len_longer_than_the_table_row():
    decode(kv_lens=(5, 6000))


@case("ValueError", "query")
def eight_query_heads_over_three_kv_heads():
    decode(query_heads=8, kv_heads=3)


@case(None)
def head_dim_80_equals_chapter_5():
    p = pool(head_dim=80)
    slots = [tensor([3, 9, 4]), tensor([12, 1])]
    md = AttentionMetadata.build([1, 1], slots)
    query = torch.randn(2, 6, 80, device=DEVICE)
    out = paged_decode_attention(query, p.k[0], p.v[0], md.kv_indices, md.kv_lens, 0.1)
    torch.testing.assert_close(out, attend(query, p.k[0], p.v[0], md, 0.1), rtol=1e-5, atol=1e-5)


@case("TypeError", "slot_mapping")
def store_a_float_slot_mapping():
    p, key = pool(), torch.randn(2, 2, 16, device=DEVICE)
    store_kvcache(key, key, p.k[0], p.v[0], tensor([1.0, 2.0], dtype=torch.float32))


@case("ValueError", "kv_lens")
def extend_more_new_tokens_than_kv_len():
    p = pool()
    query = torch.randn(7, 4, 16, device=DEVICE)
    extend_attention(query, p.k[0], p.v[0], tensor([[0, 1, 2, 3, 4, 5, 6]]), tensor([5]), tensor([0, 7]), 0.25)


@case("ValueError", "cu_q")
def extend_cu_q_short_of_the_query_rows():
    p = pool()
    query = torch.randn(7, 4, 16, device=DEVICE)
    extend_attention(query, p.k[0], p.v[0], tensor([[0, 1, 2, 3, 4, 5, 6]]), tensor([7]), tensor([0, 5]), 0.25)


@case("ValueError", "max_q_len")
def extend_max_q_len_below_a_sequences_new_tokens():
    p = pool()
    query = torch.randn(7, 4, 16, device=DEVICE)
    extend_attention(query, p.k[0], p.v[0], tensor([[0, 1, 2, 3, 4, 5, 6]]), tensor([7]), tensor([0, 7]), 0.25,
                     max_q_len=3)


@case("ValueError", "num_splits")
def decode_no_splits():
    p = pool()
    paged_decode_attention(torch.randn(1, 2, 16, device=DEVICE), p.k[0], p.v[0], tensor([[0]]), tensor([1]), 0.25,
                           num_splits=0)


@case("ValueError", "query")
def decode_a_query_without_its_sequence_dimension():
    p = pool()
    paged_decode_attention(torch.randn(2, 16, device=DEVICE), p.k[0], p.v[0], tensor([[0]]), tensor([1]), 0.25)


@case("ValueError", "v_cache")
def v_cache_laid_out_unlike_k_cache():
    p, key = pool(), torch.randn(2, 2, 16, device=DEVICE)
    v_cache = torch.randn(2, 32, 16, device=DEVICE).transpose(0, 1)      # [32, 2, 16], heads apart
    store_kvcache(key, key, p.k[0], v_cache, tensor([1, 2]))


def run_cases() -> None:
    """In the subprocess: every case, one JSON line each: its name, and the type and message of
    what it raised (error None when nothing)."""
    check_ranges(True)
    for name, (fn, _, _) in CASES.items():
        try:
            fn()
            print(json.dumps({"case": name, "error": None}), flush=True)
        except Exception as exc:   # noqa: BLE001 (the test compares the type with the one expected)
            print(json.dumps({"case": name, "error": type(exc).__name__, "message": str(exc)}), flush=True)


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_every_bad_input_is_refused_naming_the_argument_and_none_crashes():
    done = subprocess.run([sys.executable, "-c", "from tests.test_kernels_refusals import run_cases; run_cases()"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, f"exit {done.returncode} after:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    seen = {line["case"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert seen.keys() == CASES.keys()
    for name, (_, error, argument) in CASES.items():
        assert seen[name]["error"] == error, (name, seen[name])
        if error is not None:   # names the argument before it says what to do
            assert argument in seen[name]["message"].split(": ")[0], (name, seen[name]["message"])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA, without the switch, ranges are not checked")
def test_range_checks_run_on_a_cpu_whatever_the_switch():
    check_ranges(False)
    p, key = pool(), torch.randn(1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] is 32, outside k_cache's 32 slots"):
        store_kvcache(key, key, p.k[0], p.v[0], tensor([32]))
    with pytest.raises(TypeError, match="on must be True or False"):
        check_ranges("yes")
