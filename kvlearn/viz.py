"""Pictures of the cache structures: graphviz for notebooks, text for terminals and tests.

Every drawing is deterministic (nodes named by ids, no addresses or times), so the same state
always gives the same picture and the same text.
"""

from __future__ import annotations

import graphviz

# --- block tables (chapters 1-2) -----------------------------------------------------------


# --- radix tree (chapter 3) ----------------------------------------------------------------
