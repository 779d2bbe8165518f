"""How `make test` shares the suite between two pytest-xdist workers (pyproject.toml: `-n 2 --dist
loadfile --no-loadscope-reorder`): a test file runs in one worker, in order, and so do all the
notebooks, one after another (chapter 9 serves the parts that chapters 1-6 save in
notebooks/my_parts/, and notebooks/conftest.py runs the student copies in one folder, chapter after
chapter), and so do the two site test files (they share the site that tests/conftest.py builds once
per worker). Each worker computes with one torch thread (OMP_NUM_THREADS, unless set), and so do
the notebooks' kernels it starts: next to a busy core, more threads made a chapter several times
slower (tests/test_browser.py), and chapters 0, 5 and 6 give their recorded outputs with one."""

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # also for the notebooks' kernels, started from here
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def work_unit(nodeid: str) -> str:
    """The scope a test runs in: its file, "notebooks" for every notebook, "site" for both site files."""
    path = nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        return "notebooks"
    return "site" if os.path.basename(path).startswith("test_site") else path


def uses_hypothesis(item) -> bool:
    """Whether the item's test module draws examples with hypothesis (1,000 per property)."""
    module = getattr(item, "module", None)
    return module is not None and any(getattr(value, "__module__", "").startswith("hypothesis")
                                      for value in vars(module).values())


def pytest_collection_modifyitems(items):
    """In a worker, the longest units first, so that none is left to run alone at the end: the
    notebooks, then the files that hold a slow test, then those that use hypothesis, then the rest
    (each group in collection order)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        unit = {id(item): work_unit(item.nodeid) for item in items}
        slow = {unit[id(item)] for item in items if item.get_closest_marker("slow")}
        drawn = {unit[id(item)] for item in items if uses_hypothesis(item)}
        items.sort(key=lambda item: (unit[id(item)] != "notebooks", unit[id(item)] not in slow,
                                     unit[id(item)] not in drawn))


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CourseScheduling(LoadFileScheduling):
        """xdist's loadfile with the units of `work_unit`, in collection order (--no-loadscope-reorder)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return CourseScheduling(config, log)
