"""The host-driver arena the memory tests share: 256 MiB reserved in 64 KiB granules."""

import gc

import pytest

from jax_kv.memory import host_arena

G = 64 << 10  # host granule in these tests


@pytest.fixture
def arena():
    a = host_arena(reserve_bytes=256 << 20, granule=G)
    yield a
    gc.collect()
    if not a.closed:
        a.close()
