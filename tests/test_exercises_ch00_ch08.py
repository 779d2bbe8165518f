"""The chapter 0 and chapter 8 checkers accept the solutions, answer stubs with "Not yet" (never
raising), and give a hint for a wrong answer."""

import pytest

from kvlearn.exercises import NOT_YET, OK, ch00, ch08

STUBS = (None, ...)


def verdict(capsys, check, *args) -> str:
    """The checker's printed line (and it returned True exactly when it said OK)."""
    ok = check(*args)
    out = capsys.readouterr().out.strip()
    assert ok == out.startswith(OK) and (ok or out.startswith(NOT_YET))
    return out


def test_ch00_bytes_per_token(capsys):
    assert verdict(capsys, ch00.check_bytes_per_token, 2 * 32 * 8 * 128 * 2) == OK
    assert "KV head" in verdict(capsys, ch00.check_bytes_per_token, 2 * 32 * 32 * 128 * 2)  # query heads


def test_ch00_gpu_batch(capsys):
    crossover = 989 / 3.35  # FLOPs per byte read at batch b is b, for 2-byte weights
    for right in (crossover, 295, 296):
        assert verdict(capsys, ch00.check_gpu_batch, right) == OK
    assert "2 bytes" in verdict(capsys, ch00.check_gpu_batch, 2 * crossover)   # float32 weights
    assert "2 FLOPs" in verdict(capsys, ch00.check_gpu_batch, crossover / 2)   # one FLOP per weight
    assert "P" in verdict(capsys, ch00.check_gpu_batch, 16)
    for stub in STUBS + ("295", True, float("nan")):
        assert "give a number" in verdict(capsys, ch00.check_gpu_batch, stub)


def test_ch00_half_throughput(capsys):
    cost = ch00.reference_step()
    assert cost.fixed_s > 10 * cost.per_seq_s > 0  # the reference CPU: a large fixed cost per step
    half = -(-cost.fixed_s // cost.per_seq_s)
    assert cost.tokens_per_s(half) >= 0.5 / cost.per_seq_s > cost.tokens_per_s(half - 1)
    assert verdict(capsys, ch00.check_half_throughput, 1 / cost.per_seq_s, int(half)) == OK
    assert "one more" in verdict(capsys, ch00.check_half_throughput, 1 / cost.per_seq_s, int(half) - 1)
    assert "round" in verdict(capsys, ch00.check_half_throughput, 1 / cost.per_seq_s, int(half) + 5)
    assert "tend to" in verdict(capsys, ch00.check_half_throughput, 1 / cost.seconds(1), int(half))  # batch 1's rate
    for stub in STUBS:
        assert "tend to" in verdict(capsys, ch00.check_half_throughput, stub, stub)


def test_ch08_scenario_by_hand():
    # write-back: A, B fill the device; C and D demote A and B; E demotes C into a full host, which
    # drops its least recently used entry, A. Write-through: the host also holds copies of the
    # device's prompts, so it keeps nothing the device does not.
    assert ch08.kept_in_memory("write_back") == {"B", "C", "D", "E"}
    assert ch08.kept_in_memory("write_through") == {"D", "E"}
    assert ch08.on_disk_after_crash("write_back") == {"A"}
    assert ch08.on_disk_after_crash("write_through") == set("ABCDE")


def test_ch08_serve_moves_kv_without_changing_it():
    tree = ch08.serve("write_back")
    tree.check_invariants()
    for node in tree.nodes()[1:]:  # B and C on the host, D and E on the device
        pool = tree.pool if node.on_device else tree.host
        assert pool.kv[0, 0, node.value].flatten().tolist() == [float(t) for t in node.key]  # toy KV: token ids
    assert sorted(tree.tiers(n) for n in tree.nodes()[1:]) == [("device",)] * 2 + [("host",)] * 2


def test_ch08_host_keeps(capsys):
    right = {"write_back": {"B", "C", "D", "E"}, "write_through": ["d", "e"]}
    assert verdict(capsys, ch08.check_host_keeps, right) == OK
    assert "host drop" in verdict(capsys, ch08.check_host_keeps, {**right, "write_back": {"C", "D", "E"}})
    assert "copied to the host" in verdict(capsys, ch08.check_host_keeps, {**right, "write_through": set("BCDE")})
    for stub in STUBS + ({"write_back": ...}, {"write_back": 3, "write_through": 4}):
        assert "dict" in verdict(capsys, ch08.check_host_keeps, stub)


def test_ch08_crash_survivors(capsys):
    right = {"write_back": ["A"], "write_through": "ABCDE"}
    assert verdict(capsys, ch08.check_crash_survivors, right) == OK
    assert "leaves memory altogether" in verdict(capsys, ch08.check_crash_survivors, {**right, "write_back": set("AB")})
    assert "write_through" in verdict(capsys, ch08.check_crash_survivors, {**right, "write_through": set("DE")})
    for stub in STUBS:
        assert "dict" in verdict(capsys, ch08.check_crash_survivors, stub)


@pytest.mark.parametrize("check", [ch08.check_host_keeps, ch08.check_crash_survivors])
def test_ch08_stubs_of_the_student_copy(check, capsys):
    # a student copy holds `kept = ...  # your answer here`
    assert not check(...)
    assert capsys.readouterr().out.startswith(NOT_YET)
