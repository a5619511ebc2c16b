"""KvCache on the CUDA VmmArena (H200): tokens appended by a jitted donated step across at
least three growth events in both layouts, checked against a NumPy reference cache, with
(a) data equal to the reference, (b) seq-major: 0 bytes moved, pointers and shapes unchanged,
committed bytes within live + one granule + one bucket per slot, (c) head-major: bytes moved
equal to the live bytes at each growth, (d) device free memory restored after teardown."""

import gc

import jax.numpy as jnp
import numpy as np
import pytest
from inputs import append_step, live_prefix

from jax_kv import Layout
from jax_kv.cache import REASON_HEAD_VMM, REASON_SEQ_VMM, KvCache

pytestmark = pytest.mark.gpu

L, B, Hkv, D = 2, 2, 8, 128
DTYPE = jnp.bfloat16


def free_memory():
    from cuda.bindings import driver as cu

    err, free, _ = cu.cuMemGetInfo()
    assert err == cu.CUresult.CUDA_SUCCESS
    return int(free)


@pytest.fixture(scope="module")
def arena():
    from jax_kv.memory import VmmArena

    a = VmmArena(pool_bytes=0)
    print(f"\nreservation ladder tried {a.stats().reservation_ladder}, got {a.reserved_bytes}")
    yield a
    gc.collect()
    a.close()


@pytest.mark.parametrize("layout", [Layout.SEQ_MAJOR, Layout.HEAD_MAJOR], ids=lambda x: x.name)
def test_growth_keeps_data_and_geometry(arena, layout, rng):
    max_len, bucket = 8192, 256
    cache = KvCache(
        num_layers=L,
        batch=B,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=DTYPE,
        layout=layout,
        arena=arena,
        max_len=max_len,
        min_bucket=bucket,
    )
    g, tok = arena.granule, Hkv * D * 2
    step = append_step(layout)
    shape0, ptrs0 = cache.shape, cache.pointers()
    ref_k, ref_v, events = [], [], []
    T = 1300 if layout == Layout.SEQ_MAJOR else 1100
    for t in range(T):
        e = cache.ensure_capacity(t + 1)
        if e.grew:
            events.append(e)
            if layout == Layout.SEQ_MAJOR:  # (b)
                assert (e.reason, e.bytes_moved, e.keeps_compiled_step) == (REASON_SEQ_VMM, 0, True)
                assert cache.pointers() == ptrs0 and cache.shape == shape0
            else:  # (c)
                assert e.reason == REASON_HEAD_VMM and e.shape_changed and not e.pointer_changed
                assert e.bytes_moved == 2 * L * B * t * tok == cache.live_bytes
            if t:  # (a) at every growth
                np.testing.assert_array_equal(live_prefix(cache, cache.k, t), np.stack(ref_k, 2))
        if layout == Layout.SEQ_MAJOR:
            bound = 2 * L * B * ((t + 1) * tok + g + bucket * tok)
            assert cache.committed_bytes <= bound
        kn = rng.standard_normal((L, B, Hkv, D)).astype(np.float32)
        vn = rng.standard_normal((L, B, Hkv, D)).astype(np.float32)
        ptrs = cache.pointers()
        k, v = step(cache.k, cache.v, jnp.asarray(kn, DTYPE), jnp.asarray(vn, DTYPE), jnp.int32(t))
        cache.accept(k, v)  # raises if XLA did not update the arena memory in place
        assert cache.pointers() == ptrs
        cache.advance(1)
        ref_k.append(np.asarray(jnp.asarray(kn, DTYPE).astype(jnp.float32)))
        ref_v.append(np.asarray(jnp.asarray(vn, DTYPE).astype(jnp.float32)))
    assert len(events) >= 3
    np.testing.assert_array_equal(live_prefix(cache, cache.k, T), np.stack(ref_k, 2))
    np.testing.assert_array_equal(live_prefix(cache, cache.v, T), np.stack(ref_v, 2))
    print(
        f"{layout.name}: "
        + "; ".join(
            f"{e.old_capacity}->{e.new_capacity} moved={e.bytes_moved} granules="
            f"{e.granules_committed} {e.seconds * 1e6:.0f}us"
            for e in events
        )
    )
    cache.close()


def test_refused_commit_leaves_cache_intact(rng):
    from jax_kv.memory import ArenaExhausted, VmmArena

    with VmmArena(pool_bytes=0) as arena:
        layout = Layout.HEAD_MAJOR
        cache = KvCache(
            num_layers=L,
            batch=B,
            num_kv_heads=Hkv,
            head_dim=D,
            dtype=DTYPE,
            layout=layout,
            arena=arena,
            max_len=8192,
            min_bucket=256,
        )
        step = append_step(layout)
        for t in range(256):
            kn = jnp.asarray(rng.standard_normal((L, B, Hkv, D)), DTYPE)
            cache.accept(*step(cache.k, cache.v, kn, kn, jnp.int32(t)))
            cache.advance(1)
        before = live_prefix(cache, cache.k, 256)
        arena.limit_bytes = arena.committed_bytes  # nothing more
        with pytest.raises(ArenaExhausted, match="requested .* committed .* available"):
            cache.ensure_capacity(257)
        assert cache.capacity == 256
        np.testing.assert_array_equal(live_prefix(cache, cache.k, 256), before)
        arena.limit_bytes = None
        assert cache.ensure_capacity(257).new_capacity == 512
        np.testing.assert_array_equal(live_prefix(cache, cache.k, 256), before)
        cache.close()


def test_teardown_restores_device_free_memory():
    from jax_kv.memory import VmmArena

    jnp.zeros(()).block_until_ready()  # JAX's own context and allocator up first
    free0 = free_memory()
    arena = VmmArena(pool_bytes=64 << 20)
    cache = KvCache(
        num_layers=4,
        batch=4,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=DTYPE,
        layout=Layout.SEQ_MAJOR,
        arena=arena,
        max_len=32768,
        min_bucket=256,
    )
    cache.ensure_capacity(16384)
    committed = arena.committed_bytes
    assert committed >= 4 * 2 * 4 * 16384 * Hkv * D * 2
    assert free_memory() <= free0 - committed
    cache.close()
    arena.close()
    assert abs(free_memory() - free0) <= 2 * arena.granule, (free0, free_memory())


def test_unbounded_capacity_reservation_on_device():
    from jax_kv.memory import VmmArena

    with VmmArena(pool_bytes=0) as arena:
        cache = KvCache(
            num_layers=32,
            batch=1,
            num_kv_heads=8,
            head_dim=128,
            dtype=DTYPE,
            layout=Layout.SEQ_MAJOR,
            arena=arena,
        )
        bpt = 32 * 2 * 8 * 128 * 2
        assert cache.plan.source == "unbounded"
        assert 0 < cache.max_len <= arena.reserved_bytes // bpt
        assert cache.reserved_bytes >= cache.max_len * bpt
        assert cache.committed_bytes < 64 * (2 << 20) + 64 * 256 * 8 * 128 * 2
        print(f"\nunbounded Llama-3-8B-shaped cache: max_len resolved to {cache.max_len}")
        cache.close()
