"""Strict settings for every test (Equinox-style), the `gpu` marker's skip, and the arenas'
must-be-zero fault counters checked after every test (GPU and host arenas alike)."""

import jax
import numpy as np
import pytest
from arena_checks import assert_no_arena_faults

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def has_cuda_gpu() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs per test, reproducible from the test id."""
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def arena_fault_counters_stay_zero():
    yield
    assert_no_arena_faults()
