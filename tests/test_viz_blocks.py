"""Block-table pictures: the text renderer says exactly what the manager holds; graphviz renders."""

import shutil

import pytest

from kvlearn import BlockManager, Sequence
from kvlearn.blocks import short_hash
from kvlearn.viz import blocks_text, draw_blocks
from kvlearn.viz.palette import STATES


@pytest.fixture
def state():
    """Two sequences sharing two blocks, and a finished one whose block stays cached."""
    m = BlockManager(6, 2)
    done = Sequence([7, 7, 7], block_size=2)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    for s in (done, a):
        m.allocate(s)
        m.hash_blocks(s)
    m.deallocate(done)                                   # block 0 keeps [7 7]; partial block 1 is a free page
    b = Sequence([1, 2, 3, 4, 9], block_size=2)
    m.allocate(b)
    return m, a, b


def test_text_lists_tables_blocks_and_free_order(state):
    m, a, b = state
    h = [short_hash(m.blocks[i].hash) for i in range(6)]
    assert blocks_text(m, [a, b]).splitlines() == [
        "6 blocks of 2 tokens: 1 free, 1 cached, 2 in use, 2 shared",
        f"seq {a.seq_id}: 5 tokens, 0 cached, block_table [2, 3, 4]",
        "  logical  0 -> block  2  [1 2]",
        "  logical  1 -> block  3  [3 4]",
        "  logical  2 -> block  4  [5]",
        f"seq {b.seq_id}: 5 tokens, 4 cached, block_table [2, 3, 1]",   # the free page 1 first
        "  logical  0 -> block  2  [1 2]",
        "  logical  1 -> block  3  [3 4]",
        "  logical  2 -> block  1  [9]",
        "block  ref  state   hash    tokens",
        f"    0    0  cached  {h[0]:<6}  7 7",
        "    1    1  in use  -       ",
        f"    2    2  shared  {h[2]:<6}  1 2",
        f"    3    2  shared  {h[3]:<6}  3 4",
        "    4    1  in use  -       ",
        "free list (handed out first -> last): [5, 0]",
    ]
    assert "-" not in (h[0], h[2], h[3]) and h[1] == "-"


def test_graph_has_one_edge_per_table_entry_and_colours_by_state(state):
    m, a, b = state
    src = draw_blocks(m, [a, b]).source
    for s in (a, b):
        for i, block_id in enumerate(s.block_table):
            assert f"seq{s.seq_id}:l{i}:e -> pool:p{block_id}:w" in src
    assert src.count(" -> ") == 6
    assert f'PORT="p2" BGCOLOR="{STATES["shared"]}"' in src     # shared
    assert f'PORT="p0" BGCOLOR="{STATES["cached"]}"' in src     # freed, still cached
    assert f'PORT="p5" BGCOLOR="{STATES["free"]}"' in src       # free
    assert draw_blocks(m, [a, b]).source == src           # same state, same picture


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_graph_renders_to_svg(state):
    m, a, b = state
    svg = draw_blocks(m, [a, b]).pipe(format="svg").decode()
    assert svg.lstrip().startswith("<?xml") and "physical blocks" in svg


def test_an_unpublished_duplicate_goes_back_as_a_plain_free_page():
    m = BlockManager(4, 2)
    e, f = Sequence([1, 2, 3], block_size=2), Sequence([1, 2, 3], block_size=2)
    for s in (e, f):
        m.allocate(s)                                    # same step: F cannot hit E
    for s in (e, f):
        m.hash_blocks(s)
        m.deallocate(s)
    lines = blocks_text(m, []).splitlines()
    h = short_hash(m.blocks[0].hash)
    assert lines[0] == "4 blocks of 2 tokens: 3 free, 1 cached, 0 in use, 0 shared"
    assert f"    0    0  cached  {h:<6}  1 2" in lines
    assert m.blocks[2].hash is None and not any(line.startswith("    2 ") for line in lines)  # F's copy forgot
    assert lines[-1] == "free list (handed out first -> last): [2, 3, 1, 0]"
    assert f'BGCOLOR="{STATES["free"]}"' in draw_blocks(m, []).source.split('PORT="p2"')[1][:30]


class LetterTokenizer:
    """Decodes token id i as the letter chr(97 + i), with a newline for id 25: enough to check text."""

    def decode(self, ids):
        return "".join("\n" if i == 25 else chr(97 + i) for i in ids)


def test_text_decodes_tokens_with_a_tokenizer(state):
    m, a, b = state
    lines = blocks_text(m, [a, b], LetterTokenizer()).splitlines()
    assert lines[2:5] == ["  logical  0 -> block  2  'bc'", "  logical  1 -> block  3  'de'",
                          "  logical  2 -> block  4  'f'"]
    assert f"    0    0  cached  {short_hash(m.blocks[0].hash):<6}  'hh'" in lines
    long, one_block = Sequence([25] + list(range(24)) * 5, block_size=200), BlockManager(1, 200)
    one_block.allocate(long)
    text = blocks_text(one_block, [long], LetterTokenizer(), width=20)
    assert "'\\nabcdefghijkl…stuvwx'" in text  # elided to 20 characters, the newline escaped


def test_columns_empty_in_every_row_are_left_out():
    m = BlockManager(4, 2, enable_prefix_caching=False)
    s = Sequence([1, 2, 3], block_size=2)
    m.allocate(s)
    lines = blocks_text(m, [s]).splitlines()
    assert lines[-4:] == ["block  ref  state", "    0    1  in use", "    1    1  in use",
                          "free list (handed out first -> last): [2, 3]"]


class ChatTokenizer:
    """Decodes every block to chat-template text: HTML's special characters and a newline."""

    def decode(self, ids):
        return f"<|im_start|>user & {len(ids)}\n"


def test_graph_shows_decoded_text_escaped_with_a_tokenizer(state):
    m, a, b = state
    src = draw_blocks(m, [a, b], ChatTokenizer(), width=40).source
    assert src.count("'&lt;|im_start|&gt;user &amp; 2\\n'") == 4 + 3   # 2-token logical blocks; published blocks
    assert "<|im_start|>" not in src and "[1 2]" not in src            # no raw markup, no ids
    assert "'&lt;|im_start|&gt;user &amp; 1\\n'" in src                 # the partial last blocks
    assert "[1 2]" in draw_blocks(m, [a, b]).source                    # without a tokenizer: ids
