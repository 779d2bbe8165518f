"""Radix tree pictures, text and step recording (kvlearn.viz, chapter 3 section)."""

import pytest
import torch

from kvlearn import RadixCache, viz
from kvlearn.viz.palette import STATES


class CharTokenizer:
    """Stands in for a real tokenizer: token t decodes to chr(t)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def small_tree():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], torch.arange(5))           # #1
    cache.insert([1, 2, 3, 9, 9], torch.tensor([0, 1, 2, 7, 9]))  # splits #1 at 3: #2 above, #3 new
    cache.lock(cache.match_prefix([1, 2, 3, 9]).last_node)   # splits #3 at 1: #4 above
    return cache


def test_text_shows_every_node_with_its_state():
    assert viz.radix_text(small_tree()) == "\n".join([
        "RadixCache(page_size=1, nodes=5, total=7, evictable=3, protected=4)",
        "root  lock_ref=1",
        "└─ #2 [1 2 3]  3 tok, slots 0-2, lock_ref=1, t=3  <locked>",
        "   ├─ #1 [4 5]  2 tok, slots 3-4, lock_ref=0, t=1",
        "   └─ #4 [9]  1 tok, slots 7, lock_ref=1, t=3  <locked>",
        "      └─ #3 [9]  1 tok, slots 9, lock_ref=0, t=2",
    ])


def test_text_decodes_and_elides_long_edges():
    cache = RadixCache()
    text = "hello world, this is a long edge"  # 32 characters: more than the 28 shown
    cache.insert([ord(c) for c in text], torch.tensor([0, 1, 2, 4] + list(range(6, 34))))
    line = viz.radix_text(cache, CharTokenizer()).splitlines()[2]
    assert line == "└─ #1 'hello world, this …long edge'  32 tok, slots 0-2,4,6-33, lock_ref=0, t=1"
    many_runs = RadixCache()
    many_runs.insert([1, 2, 3, 4, 5], torch.tensor([0, 2, 4, 6, 8]))
    assert "slots 0,2,4,…," in viz.radix_text(many_runs)


def test_picture_is_deterministic_and_renders():
    g1, g2 = viz.draw_radix(small_tree()), viz.draw_radix(small_tree())
    assert g1.source == g2.source
    assert 'n2 -> n4' in g1.source and "[1 2 3]" in g1.source
    assert g1.source.count(STATES["locked"]) == 4  # root, #2 and #4 are locked, plus the legend
    assert "<svg" in g1.pipe(format="svg", encoding="utf-8")


def test_backslashes_in_decoded_text_do_not_become_graphviz_escapes():
    cache = RadixCache()
    cache.insert([ord("a"), ord("\\"), ord("n")], torch.arange(3))
    assert r"'a\\\\n'" in viz.draw_radix(cache, CharTokenizer()).source


def test_trace_marks_split_new_and_evicted_nodes():
    freed = []
    cache = RadixCache(evict_callback=lambda v: freed.append(v.tolist()))
    trace = viz.RadixTrace(cache)
    trace.insert([1, 2, 3, 4], torch.arange(4))
    trace.insert([1, 2, 8], torch.tensor([0, 1, 5]))
    result = trace.match([1, 2, 3])
    trace.lock(result.last_node)
    trace.evict(5)
    trace.unlock(result.last_node)
    assert len(trace) == 7
    assert [s.description for s in trace.steps] == [
        "step 0: start",
        "step 1: insert [1 2 3 4] -> 0 tokens were already cached",
        "step 2: insert [1 2 8] -> 2 tokens were already cached",
        "step 3: match [1 2 3] -> 3 tokens, slots 0-2, ends at #4",
        "step 4: lock #4 -> protected 3, evictable 2",
        "step 5: evict(5) -> freed 2 tokens: #1, then #3",
        "step 6: unlock #4 -> protected 0, evictable 3",
    ]
    assert trace.steps[1].marks == {1: "new"}
    assert trace.steps[2].marks == {2: "split", 3: "new"}
    assert trace.steps[3].marks == {4: "split"} and trace.steps[3].path == {0, 2, 4}
    assert trace.steps[5].marks == {1: "evicted", 3: "evicted"}
    assert freed == [[3], [5]]  # the trace listens to the callback but still passes it on
    assert cache.evict_callback is not None and cache.evict_callback.__name__ == "<lambda>"
    text = trace.text(5)
    assert text.startswith("step 5: evict(5)") and "#3 [8]" in text and "<evicted>" in text
    assert "#1 [4]" not in viz.radix_text(cache)  # the ghost lives only in the recorded step
    assert "style=\"rounded,filled,dashed\"" in trace.draw(5).source


def test_a_step_keeps_showing_the_tree_as_it_was():
    cache = RadixCache()
    trace = viz.RadixTrace(cache)
    trace.insert([1, 2], torch.arange(2))
    shown = trace.text(1)
    cache.insert([1, 3], torch.arange(2))  # later changes, even outside the trace
    assert trace.text(1) == shown


def test_widget_builds_headless_and_follows_the_slider():
    cache = RadixCache()
    trace = viz.RadixTrace(cache)
    trace.insert([1, 2, 3], torch.arange(3))
    trace.match([1, 2])
    box = viz.radix_widget(trace, step=1)
    slider, caption, picture = box.children
    assert (slider.min, slider.max, slider.value) == (0, 2, 1)
    assert caption.value == trace.steps[1].description and "<svg" in picture.value
    slider.value = 2
    assert caption.value.startswith("step 2: match [1 2]")
    with pytest.raises(ValueError, match="step must be"):
        viz.radix_widget(trace, step=3)


def test_trace_names_evicted_nodes_even_when_slot_ids_repeat():
    trace = viz.RadixTrace(RadixCache())
    trace.insert([1, 2, 3], torch.tensor([0, 1, 2]))   # node #1
    trace.insert([7, 8], torch.tensor([0, 1]))         # node #2, the same first slot id
    trace.evict(2)
    assert [g.id for g in trace.steps[-1].ghosts] == [1]
    assert trace.steps[-1].description.endswith("#1")
