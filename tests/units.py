"""The units of work that `make test` shares out between its two pytest-xdist workers (conftest.py):
each runs whole, in order, in one worker."""

import os

# Chapter 9 serves the parts that chapters 1-6 save (notebooks/my_parts/, and each student copy's
# my_parts/), so those seven chapters run in one unit, in order; the other four in a second unit,
# beside it in the other worker. A chapter and its student copy always run together
# (notebooks/conftest.py).
CAPSTONE_CHAIN = ("01", "02", "03", "04", "05", "06", "09")


def notebook_unit(name: str) -> str:
    """The unit of the chapter notebook `name` (its file name)."""
    return "notebooks: chapters 1-6 and 9" if name[:2] in CAPSTONE_CHAIN else "notebooks: the other chapters"


def work_unit(nodeid: str) -> str:
    """The unit a test runs in: its file; its notebook's unit; "site" for both site files (they share
    the site that tests/conftest.py builds once per worker)."""
    path = nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        return notebook_unit(os.path.basename(path))
    return "site" if os.path.basename(path).startswith("test_site") else path
