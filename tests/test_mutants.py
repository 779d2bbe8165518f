"""The referees measured by mutation testing (`python -m kvlearn mutants`, `make mutants`).

tests/data/mutants/<part>.json lists the mutants of a part's worked solution that survive its check
because they behave the same. Each one is made again from its text (no mutation tool needed), must
still pass `check`, and must answer on the suite's programs what the worked solution answers.
Mutants the suites once missed must now fail, with the hint of the rule they break.
"""

import json
from collections import Counter

import pytest

from kvlearn.parts import check
from kvlearn.parts.conformance import SUITES
from kvlearn.parts.suite_radix_cache import HINTS as RADIX_HINTS
from kvlearn.workshop import mutants
from kvlearn.workshop.mutant_review import first_difference, observe
from kvlearn.workshop.mutants import (
    EQUIVALENTS,
    apply_listed,
    load_equivalents,
    load_part,
    parts_folder,
    worked_solutions,
)

LISTED = sorted(path.stem for path in EQUIVALENTS.glob("*.json"))
PROGRAMS = 100   # of each suite, to compare a listed mutant's answers with the worked solution's


@pytest.fixture(scope="module")
def solutions():
    solved = worked_solutions()
    with parts_folder(solved):
        yield solved


def test_every_listing_names_a_part_and_says_why_each_mutant_behaves_the_same(solutions):
    assert LISTED, f"no listing in {EQUIVALENTS}"
    for part in LISTED:
        data = json.loads((EQUIVALENTS / f"{part}.json").read_text(encoding="utf-8"))
        assert data["part"] == part and part in solutions
        keys = [(e["operator"], e["before"], e["after"], e.get("nth", 0)) for e in data["equivalent"]]
        assert len(set(keys)) == len(keys), f"{part}: a mutant is listed twice"
        assert all(e["why"].strip() and e["before"] != e["after"] for e in data["equivalent"]), part


@pytest.mark.thorough   # `make mutants` judges them all; tests/README.md
@pytest.mark.parametrize("part", LISTED)
def test_listed_equivalents_still_pass_and_answer_as_the_worked_solution(part, solutions):
    programs = min(PROGRAMS, getattr(SUITES[part].module, "PROGRAMS", 3 * PROGRAMS) // 3)   # the kernel: 8, interpreted
    expected = observe(part, load_part(part, solutions[part]), programs)
    assert all(ending is None for _, _, ending in expected)
    for entry in load_equivalents(part):
        what = f"{part}: {entry['operator']}: {entry['before']!r} -> {entry['after']!r}"
        mutant = load_part(part, apply_listed(solutions[part], entry))   # ValueError: the line is gone
        report = check(part, mutant, programs=programs if hasattr(SUITES[part].module, "PROGRAMS") else None)
        assert report.passed, f"{what} is listed as equivalent but fails check:\n{report.message}"
        difference = first_difference(observe(part, mutant, programs), expected)
        assert difference is None, f"{what} answers differently from the worked solution at {difference}"


def test_a_listed_mutant_whose_line_is_gone_is_reported():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    entry = {"operator": "core/ReplaceBinaryOperator_Add_Sub", "before": "return x + 1", "after": "return x - 1"}
    assert apply_listed(source, entry) == source.replace("x + 1", "x - 1")
    with pytest.raises(ValueError, match="worked solution changed"):
        apply_listed(source.replace("x + 1", "x + 2"), entry)
    with pytest.raises(ValueError, match="occurrence 1"):
        apply_listed(source, entry | {"nth": 1})
    outside = "def f(x):\n    return x + 1\n"   # only solution lines are mutated
    with pytest.raises(ValueError):
        apply_listed(outside, entry)


def test_a_worked_solution_lives_in_one_place(tmp_path):
    (tmp_path / "future.py").write_text("x = 1\n")   # a part whose chapter has no %%part cell yet
    assert worked_solutions(waiting=tmp_path)["future"] == "x = 1\n"
    (tmp_path / "allocator.py").write_text("x = 1\n")   # chapter 4 has its cell
    with pytest.raises(ValueError, match=r"allocator is a %%part cell of .* now: delete this file"):
        worked_solutions(waiting=tmp_path)


def test_the_observation_compares_floats_within_a_tolerance():
    import torch

    assert first_difference([torch.ones(2), ("torch.int64", [1])], [torch.ones(2) + 1e-9, ("torch.int64", [1])]) is None
    assert "[1]" in first_difference([torch.ones(2), ("torch.int64", [1])], [torch.ones(2), ("torch.int64", [2])])
    assert first_difference([torch.ones(2)], [torch.ones(3)]) is not None


# --- survivors the radix suite once missed: they fail now, naming the broken rule ------------------

RADIX_MATCH = "while k < len(edge) and edge[k:k + p] == key[matched + k:matched + k + p]:"
KILLED = [   # (the mutated line, the hint that must name the broken rule)
    (RADIX_MATCH.replace("matched + k + p]", "matched - k + p]"), "shape"),   # issue 29: the match splits too soon
    (RADIX_MATCH.replace("k < len(edge)", "k == len(edge)"), "shape"),
]


@pytest.mark.parametrize("after, hint", KILLED)
def test_a_match_that_splits_where_the_key_goes_on_fails_with_the_shape_rule(after, hint, solutions):
    entry = {"operator": "(by hand)", "before": RADIX_MATCH, "after": after}
    report = check("radix_cache", load_part("radix_cache", apply_listed(solutions["radix_cache"], entry)))
    assert not report.passed
    assert report.message.splitlines()[-1] == f"Hint: {RADIX_HINTS[hint]}"
    assert "where no insert ended and no match stopped" in report.message


def test_is_between_lengths_fails_on_a_key_of_more_than_256_tokens(solutions):
    entry = {"operator": "core/ReplaceComparisonOperator_Lt_IsNot", "before": "if present < len(key):",
             "after": "if present is not len(key):"}
    report = check("radix_cache", load_part("radix_cache", apply_listed(solutions["radix_cache"], entry)))
    assert not report.passed and "cache.insert(" in report.message


GUARD = "if block_id is None or self.blocks[block_id].token_ids != tokens:  # a miss, or a collision"
FREE_CHECK = "if self.free_flag[pages].any() or pages.unique().numel() != pages.numel():"
SURVIVED_BEFORE = [   # (part, line, mutated line, the hint that must name the broken rule, or None: a refused call)
    ("block_manager", GUARD, GUARD.replace("!=", "is"), "collision"),   # needs a hash collision
    ("block_manager", GUARD, GUARD.replace("!=", "<"), "collision"),
    ("block_manager", "new += 1", "new += 2", "count"),                   # hash_blocks' answer
    ("block_manager", "return new", "return 0", "count"),
    ("allocator", FREE_CHECK, FREE_CHECK.replace("!=", "is not"), None),  # wrong only for > 256 pages at once
]


@pytest.mark.parametrize("part, before, after, rule", SURVIVED_BEFORE)
def test_mutants_the_suites_once_missed_fail_naming_the_rule(part, before, after, rule, solutions):

    entry = {"operator": "(by hand)", "before": before, "after": after}
    report = check(part, load_part(part, apply_listed(solutions[part], entry)))
    assert not report.passed
    hint = report.message.splitlines()[-1]
    if rule is None:
        assert "It raised ValueError" in report.message and "allocator.free(" in report.message
    else:
        assert mutants.rule_of(part, hint) == rule and hint.startswith(f"Hint: {SUITES[part].module.HINTS[rule]}")


def test_the_hint_tally_names_each_killed_mutants_rule():
    from kvlearn.parts.suite_allocator import HINTS

    assert mutants.rule_of("allocator", f"Hint: {HINTS['order']}") == "order"
    assert mutants.rule_of("allocator", f"Hint: {HINTS['order']} (a note after it)") == "order"
    assert mutants.rule_of("allocator", "Hint: something no suite says") == "(other hint)"
    assert mutants.rule_of("allocator", None) == "(no hint)"
    results = [mutants.PartResult("allocator", 5, 4, 1, [], [], 1.0, False, Counter(order=3, repeat=1)),
               mutants.PartResult("block_table", 2, 2, 0, [], [], 1.0, False, Counter(order=2))]
    assert mutants.hint_tally(results, 1).splitlines()[1:] == [
        "  allocator (4 killed): order 3", "  block_table (2 killed): order 2", "  all parts: allocator: order 3"]


def test_evicting_part_of_a_leaf_breaks_the_whole_leaf_rule():
    from kvlearn.parts.references import RadixReference

    ref = RadixReference(page_size=1)
    ref.insert((0, 1, 2), [10, 11, 12])
    assert ref.evicted([12]) == ("it evicted tokens [2] of the node that holds tokens [0, 1, 2] (after []): "
                                 "a leaf leaves the tree whole")
    assert ref.evicted([10, 11, 12]) is None and ref.total_size == 0


# --- the tool itself ---------------------------------------------------------------------------------

def test_the_judge_kills_a_failing_part_and_spares_the_worked_solution(solutions):
    broken = solutions["radix_cache"].replace("self.clock += 1", "self.clock -= 1")
    verdicts = mutants.judge("radix_cache", [solutions["radix_cache"], broken, "raise SystemExit(3)"], jobs=2)
    assert [v.killed for v in verdicts] == [False, True, True]
    assert "SystemExit" in verdicts[2].how


def test_a_mutant_that_hangs_is_killed_at_its_time_limit(solutions):
    endless = solutions["allocator"].replace("        ### BEGIN SOLUTION\n", "        ### BEGIN SOLUTION\n"
                                             "        import time\n        time.sleep(60)\n", 1)
    verdict = mutants.judge("allocator", [endless], timeout_s=1.0)[0]
    assert verdict.killed and verdict.how == "no verdict within 1 s"


@pytest.mark.slow
def test_the_command_judges_a_sample_and_says_what_survived(solutions, capsys):
    pytest.importorskip("cosmic_ray", reason="the mutation tool: pip install -r requirements-mutants.txt")
    made = mutants.make_mutants("radix_cache", solutions["radix_cache"])
    listed = {(e["operator"], e["before"], e["after"], e.get("nth", 0)) for e in load_equivalents("radix_cache")}
    assert listed <= {m.key for m in made}, "a listed equivalent is no longer made: update the listing"
    assert all(m.line in mutants.solution_lines(solutions["radix_cache"]) for m in made)
    assert mutants.main(["--part", "radix_cache", "--sample", "3"]) == 0
    out = capsys.readouterr().out
    assert "radix_cache (sample)" in out and "100.0 %" in out
