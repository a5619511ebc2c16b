"""Strict settings for every test (Equinox-style), the `gpu` marker's skip, and the arenas'
must-be-zero fault counters checked after every test (GPU and host arenas alike)."""

import os
import zlib

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


# Fresh random inputs each session, reproducible: TEST_SEED=N pytest ... replays a session (its
# value is in the report header). A test's seed mixes it with a stable hash of the test id
# (str hash() is salted per process, which made one CPU failure impossible to replay).
SESSION_SEED = int(os.environ.get("TEST_SEED") or np.random.SeedSequence().entropy % 2**31)
os.environ["TEST_SEED"] = str(SESSION_SEED)  # xdist's workers start later and inherit it


def pytest_report_header(config):
    return f"TEST_SEED={SESSION_SEED} (random inputs: set it to replay this session)"


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs per session and test, replayed by TEST_SEED (header)."""
    seed = [SESSION_SEED, zlib.crc32(request.node.nodeid.encode())]
    request.node.user_properties.append(("TEST_SEED", SESSION_SEED))
    return np.random.default_rng(seed)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and "rng" in getattr(item, "fixturenames", ()):
        item.add_report_section(call.when, "seed", f"replay with TEST_SEED={SESSION_SEED}")


@pytest.fixture(autouse=True)
def arena_fault_counters_stay_zero():
    yield
    assert_no_arena_faults()
