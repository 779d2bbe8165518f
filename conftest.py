"""How `make test` shares the suite between two pytest-xdist workers (pyproject.toml: `-n 2 --dist
loadfile --no-loadscope-reorder`): in units (tests/units.py) that each run whole, in order, in one
worker: a test file; the chapters that the capstone depends on; the other chapters; the two site
files. Each worker computes with one torch thread (OMP_NUM_THREADS, unless set), and so do the
notebooks' kernels it starts: next to a busy core, more threads made a chapter several times slower
(tests/test_browser.py), and chapters 0, 5 and 6 give their recorded outputs with one."""

import os

import pytest

from tests.units import work_unit

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # also for the notebooks' kernels, started from here
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def uses_hypothesis(item) -> bool:
    """Whether the item's test module draws examples with hypothesis (tests/conftest.py's profiles)."""
    module = getattr(item, "module", None)
    return module is not None and any(getattr(value, "__module__", "").startswith("hypothesis")
                                      for value in vars(module).values())


MODEL_FIXTURES = {"model", "tokenizer", "model_and_tokenizer"}


@pytest.hookimpl(tryfirst=True)   # before `-m` selects: the markers below take part in it
def pytest_collection_modifyitems(items):
    """Marks each test that loads the real model `model` (`make quick` leaves those out; hypothesis
    marks its own tests `hypothesis`, state machines included). Then, in a worker, the longest units
    first, so that none is left to run alone at the end: the two units of notebooks, then the files
    that hold a slow test, then those that use hypothesis, then the rest (each group in collection
    order)."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        unit = {id(item): work_unit(item.nodeid) for item in items}
        slow = {unit[id(item)] for item in items if item.get_closest_marker("slow")}
        drawn = {unit[id(item)] for item in items if uses_hypothesis(item)}
        items.sort(key=lambda item: (not unit[id(item)].startswith("notebooks"), unit[id(item)] not in slow,
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
