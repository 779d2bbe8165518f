"""Speed claims in the notebooks: printed with their figures, never asserted.

A timing moves with whatever else the machine runs (a workshop laptop, `make test` with two
workers), so a cell that asserted one would fail for a reason the learner cannot fix. A cell prints
its figures; `disturbed_unless(holds, claim)` then says, when the figures do not show the claim,
that this run was disturbed, with the load average, on stderr (which the notebooks' tests do not
compare), so the cell's compared output stays the same on a busy machine. Tokens and counts stay
asserted: they never depend on the machine.
"""

from __future__ import annotations

import os
import sys


def disturbed_unless(holds: bool, claim: str) -> bool:
    """Say on stderr, when `holds` is false, that this run's timings do not show `claim` and why
    that is likely; return `holds`."""
    if not holds:
        try:
            load = f"the load average is {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
        except (AttributeError, OSError):   # no load average (Windows)
            load = "other programs were running"
        print(f"This run does not show that {claim}: its timings were disturbed ({load}). Timings move with "
              "everything else the machine does; run the cell again when it is quiet.", file=sys.stderr)
    return holds
