"""Workloads: deterministic, templated like real chat traffic, and an exact unique-token floor."""

import itertools
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlearn.model import chat_ids
from kvlearn.serving.workloads import (
    WORKLOADS,
    make_workload,
    multi_turn_chat,
    shared_system_prompt,
    unique_token_floor,
)


def brute_force_floor(prompts) -> int:
    """The definition itself: the set of every non-empty prefix of every prompt."""
    return len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)})


@given(st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=10))
def test_property_floor_counts_distinct_prefixes(prompts):
    assert unique_token_floor(prompts) == brute_force_floor(prompts)


def test_floor_by_hand():
    assert unique_token_floor([]) == 0
    assert unique_token_floor([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 4   # 1, 12, 123, 124
    assert unique_token_floor([[5], [5, 6], [7]]) == 3


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_deterministic_templated_and_counted(tokenizer, name):
    w = make_workload(name, tokenizer)
    assert w == make_workload(name, tokenizer)                     # same seed, same prompts
    assert len(w.prompts) == len(w.labels) == w.num_requests > 1
    assert len(set(w.prompts)) == w.num_requests                    # no duplicate prompts
    start, answer = chat_ids(tokenizer, "x")[:3], chat_ids(tokenizer, "x")[-3:]
    for p in w.prompts:
        assert list(p[:3]) == start and list(p[-3:]) == answer      # <|im_start|>system ... assistant\n
    assert w.unique_token_floor == brute_force_floor(w.prompts) <= w.num_prompt_tokens
    assert name in repr(w) and f"{w.unique_token_floor:,}" in repr(w)


def test_sharing_differs_by_workload_as_designed(tokenizer):
    shared = shared_system_prompt(tokenizer)
    assert min(len(p) for p in shared.prompts) > 300 and shared.shareable_fraction > 0.85
    assert make_workload("no_sharing", tokenizer).shareable_fraction < 0.15
    short = make_workload("short_system", tokenizer)  # issue 12's small workload: 12 x ~170 tokens, ~150 shared
    assert short.num_requests == 12 and all(160 <= len(p) <= 180 for p in short.prompts)
    assert 140 <= len(os.path.commonprefix([list(p) for p in short.prompts])) <= 160
    assert make_workload("shared_system", tokenizer, seed=1) != shared


def test_multi_turn_prompts_extend_the_previous_turn(tokenizer):
    w = multi_turn_chat(tokenizer, num_conversations=2, num_turns=3)
    for conv in range(2):
        turns = w.prompts[conv::2]
        for earlier, later in itertools.pairwise(turns):
            assert later[:len(earlier)] == earlier and len(later) > len(earlier)


def test_bad_sizes_and_names(tokenizer):
    with pytest.raises(ValueError, match="Unknown workload"):
        make_workload("chatbot", tokenizer)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("shared_system", tokenizer, num_requests=0)
    with pytest.raises(ValueError, match="at most"):
        make_workload("few_shot", tokenizer, num_requests=1000)
    with pytest.raises(ValueError, match="num_turns"):
        make_workload("multi_turn", tokenizer, num_turns=9)
