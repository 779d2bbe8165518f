"""Shared fixtures: the real model is loaded once per test session (per worker under xdist); hypothesis profiles."""

import os

import pytest
import torch

# Triton's kernels (kvlearn.kernels) run on a CPU only in its interpreter, which must be asked for
# before triton is first imported; with CUDA they compile for the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

# 150 examples per property in `make test`; `make thorough` (HYPOTHESIS_PROFILE=thorough) runs every
# hypothesis test again with 1,000, `make quick` with 25. (A test that sets max_examples keeps it.)
for profile, examples in {"default": 150, "quick": 25, "thorough": 1000}.items():
    settings.register_profile(profile, max_examples=examples, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def model_and_tokenizer():
    from kvlearn.model import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The course's static site (kvlearn.workshop.site), built once per session from this clone into a
    temporary folder, strictly (a Sphinx warning fails it); skips, saying what to install, when Sphinx
    or MyST-NB is missing."""
    from pathlib import Path

    from kvlearn.workshop.site import build

    work = tmp_path_factory.mktemp("site")
    try:
        return build(Path(__file__).resolve().parents[1], work / "site", work / "build", strict=True).parent
    except ImportError as missing:
        pytest.skip(f"site tests skipped: {missing}")
