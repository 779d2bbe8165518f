"""Pictures of the cache structures: graphviz for notebooks, text for terminals and tests.

Every drawing is deterministic (nodes named by ids, no addresses or times), so the same state
always gives the same picture and the same text. One module per structure:

    blocks    block tables and physical blocks (chapters 1-2)
    radix     the radix tree, and a recorded trace to step through (chapter 3)
    pool      the KV pool and the slots a packed step reads and writes (chapters 4-5)
    fleet     every replica's tree side by side (chapter 7)
    capacity  hit rate against cache capacity on real traffic, beside the Mooncake paper (chapter 7)
    tiers     a tiered radix tree, coloured by where each node's KV lives (chapter 8)
    quant     K and V magnitudes by channel, quality against bytes per token (chapter 10)
    kernel_reads  which slots each program of an interpreted decode kernel loaded (chapter 5; Triton)
    teaching  small matplotlib pictures of chapters 0, 2, 3, 5 and 6
    plots     where figures are written (`figures_dir`, `save_figure`)
    text      the text helpers they share (tokens, slot runs, legends, indented trees)
    palette   one colour per state (free, new, cached, locked, split, device, host, disk, ...),
              the same in every picture

graphviz and matplotlib are imported only inside the functions that draw: importing this package
(for `figures_dir`, or the text renderers) needs neither.
"""

from kvlearn.viz.blocks import blocks_text, draw_blocks
from kvlearn.viz.pool import draw_pool, draw_slot_reads, pool_text
from kvlearn.viz.radix import RadixStep, RadixTrace, draw_radix, radix_text, radix_widget

__all__ = ["RadixStep", "RadixTrace", "blocks_text", "draw_blocks", "draw_pool", "draw_radix", "draw_slot_reads",
           "pool_text", "radix_text", "radix_widget"]
