"""A stray read of a VMM cache never faults (issue 19, item 2), on the host driver (CI) and on
the CUDA driver (H200): every uncommitted granule of a region reads as zeros through the shared
read-only zero granule, a full-array reduction after growth equals the reduction over the live
prefix, committed bytes count real granules only, a recycled granule is zeroed at commit, and
a write past the committed capacity is refused by the op instead of touching the zero granule.
"""

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import randn

from jax_kv import Layout, gqa_prefill
from jax_kv.cache import KvCache
from jax_kv.memory import host_arena

Hkv, D = 2, 64


def arenas():
    return [
        pytest.param("host", id="host"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]


@pytest.fixture(params=arenas())
def arena(request):
    if request.param == "host":
        a = host_arena(reserve_bytes=1 << 30, granule=64 << 10)
    else:
        from jax_kv.memory import VmmArena

        a = VmmArena(pool_bytes=0)
    yield a
    gc.collect()
    if not a.closed:
        a.close()
        s = a.stats()
        assert s.committed_bytes == 0 and s.handles_live == 0, s


def assert_fault_counters_zero(arena):
    s = arena.stats()
    assert not any(s.faults.values()), s
    assert s.quarantined_bytes == 0, s


def on_device(arena) -> bool:
    """XLA's CPU client copies a donated DLPack-imported buffer instead of aliasing it, so on
    the host driver the tests write the arena's bytes directly and never donate its views."""
    return arena.driver.kind == "cuda"


def fill(cache, rng, n, dtype):
    """Writes n random tokens into every layer of a seq-major cache (on the device through a
    donated gqa_prefill bounded by the committed capacity; on the host driver straight into the
    mapped bytes); returns the K values written, float64 [B, n, Hkv, D]."""
    B = cache.batch
    q = randn(rng, (B, n, Hkv, D), dtype)
    k = randn(rng, (B, n, Hkv, D), dtype)
    if not on_device(cache.arena):
        tok, slot = cache.token_bytes, cache.max_len * cache.token_bytes
        raw = np.asarray(k).view(np.uint8).reshape(B, n * tok)
        for region in cache.growth.regions:
            for b in range(B):
                start = region.ptr + b * slot + int(cache.lengths[b]) * tok
                cache.arena.driver.host_view(start, n * tok)[:] = raw[b].tobytes()
        cache.advance(n)
        return np.asarray(k, np.float64)
    committed = jnp.full((B,), cache.capacity, jnp.int32)
    step = jax.jit(
        lambda kc, vc, n: gqa_prefill(q, k, k, kc, vc, n, committed=committed, layout=cache.layout)[
            1:
        ],
        donate_argnums=(0, 1),
    )
    lengths = jnp.asarray(cache.lengths)
    ks, vs = [], []
    for kc, vc in zip(cache.k, cache.v, strict=True):
        kc, vc = step(kc, vc, lengths)
        ks.append(kc)
        vs.append(vc)
    cache.accept(ks, vs)
    cache.advance(n)
    return np.asarray(k, np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_full_array_reduction_equals_live_prefix_after_growth(arena, rng, dtype):
    B, max_len = 2, 1 << 16
    cache = KvCache(
        num_layers=2, batch=B, num_kv_heads=Hkv, head_dim=D, dtype=dtype,
        layout=Layout.SEQ_MAJOR, arena=arena, max_len=max_len, min_bucket=64,
    )  # fmt: skip
    tok = Hkv * D * jnp.dtype(dtype).itemsize
    assert cache.shape == (B, max_len, Hkv, D)
    # Before any token: the whole max_len view reads as zeros, and costs one granule per slot.
    assert float(jnp.sum(jnp.abs(cache.k[0].astype(jnp.float32)))) == 0.0
    total = 0
    for n in (5, 200, arena.granule // tok + 3):  # across a granule boundary
        cache.ensure_capacity(total + n)
        written = fill(cache, rng, n, dtype)
        total += n
        for a in (*cache.k, *cache.v):  # every slot, every layer: a full-array read
            x = a.astype(jnp.float32)
            full, prefix = float(jnp.sum(x)), float(jnp.sum(x[:, :total]))
            assert np.isfinite(full) and full == pytest.approx(prefix, rel=1e-5, abs=1e-4)
            assert float(jnp.max(jnp.abs(x))) == float(jnp.max(jnp.abs(x[:, :total])))
        tail = np.asarray(cache.k[0][:, total:].astype(jnp.float32))
        assert not tail.any(), "past the live prefix every value reads 0"
        np.testing.assert_array_equal(
            np.asarray(cache.k[-1][:, total - n : total], np.float64), written
        )
    s = arena.stats()
    # Committed bytes count real granules only: ceil(capacity * tok / granule) per binding.
    per_binding = -(-cache.capacity * tok // arena.granule) * arena.granule
    slot = max_len * tok
    g = arena.granule
    expected = (
        4
        * g
        * sum(
            len({(b * slot + i) // g for i in range(0, cache.capacity * tok, g)}) for b in range(B)
        )
    )
    # The arena holds one more granule: the cache's control block (its committed [B] array).
    assert cache.committed_bytes == expected and s.committed_bytes == expected + g
    assert per_binding * B >= expected / 4
    assert s.zero_mapped_bytes >= 4 * B * slot - s.committed_bytes  # the rest reads zeros
    assert_fault_counters_zero(arena)
    cache.close()
    assert arena.stats().committed_bytes == 0
    assert_fault_counters_zero(arena)


def test_write_past_committed_is_refused_not_faulted(arena, rng):
    cache = KvCache(
        num_layers=1, batch=1, num_kv_heads=Hkv, head_dim=D, dtype=jnp.float32,
        layout=Layout.SEQ_MAJOR, arena=arena, max_len=1 << 15, min_bucket=64,
    )  # fmt: skip
    T = 8
    q = randn(rng, (1, T, Hkv, D), jnp.float32)
    past = jnp.asarray([cache.capacity - T + 1], jnp.int32)  # one token past the commit
    committed = jnp.asarray([cache.capacity], jnp.int32)
    step = jax.jit(
        lambda kc, vc, n, c: gqa_prefill(
            q, q, q, kc, vc, n, committed=c, layout=Layout.SEQ_MAJOR, return_status=True
        ),
        donate_argnums=(0, 1) if on_device(arena) else (),
    )
    out, kc, vc, status = step(cache.k[0], cache.v[0], past, committed)
    assert np.asarray(status).tolist() == [1]
    assert np.isnan(np.asarray(out)).all()
    if on_device(arena):  # in place: the arena's bytes are the output's
        cache.accept([kc], [vc])
    del kc, vc
    assert float(jnp.sum(jnp.abs(cache.k[0]))) == 0.0  # nothing written anywhere
    assert_fault_counters_zero(arena)
    cache.close()


def test_recycled_granule_reads_zero_and_decommit_restores_the_zero_mapping(arena):
    g = arena.granule
    region = arena.allocate(4 * g)
    zero0 = arena.stats().zero_mapped_bytes
    region.commit(2 * g)
    assert arena.stats().zero_mapped_bytes == zero0 - 2 * g
    view = region.export((4 * g // 4,), jnp.float32)
    if on_device(arena):
        ones = jnp.ones((2 * g // 4,), jnp.float32)
        view = jax.jit(lambda a: a.at[: 2 * g // 4].set(ones), donate_argnums=0)(view)
    else:
        arena.driver.host_view(region.ptr, 2 * g)[:] = np.ones(2 * g // 4, np.float32).tobytes()
    assert float(jnp.sum(view)) == 2 * g // 4
    del view
    arena.wait_unviewed([region], timeout=60)  # slow under compute-sanitizer
    arena.pool_target = 4 * g  # keep the handles: the next commit reuses them
    region.decommit(0)
    arena.flush()
    s = arena.stats()
    assert s.committed_bytes == 0 and s.pooled_bytes == 2 * g and s.zero_mapped_bytes == zero0
    view = region.export((4 * g // 4,), jnp.float32)
    assert float(jnp.sum(view)) == 0.0  # the zero granule again
    del view
    arena.wait_unviewed([region], timeout=60)  # slow under compute-sanitizer
    region.commit(4 * g)  # two recycled handles (with ones in them) and two fresh ones
    assert arena.stats().pooled_bytes == 0
    view = region.export((4 * g // 4,), jnp.float32)
    assert float(jnp.sum(view)) == 0.0, "a recycled granule must be zeroed at commit"
    del view
    arena.wait_unviewed([region], timeout=60)  # slow under compute-sanitizer
    assert_fault_counters_zero(arena)
    region.free()
    assert arena.stats().zero_mapped_bytes == arena.granule  # only the zero granule's own


@pytest.mark.gpu
def test_zero_mapping_cost_of_a_large_reservation_is_timed():
    """The start-up cost the zero granule adds: one cuMemMap per granule of a region and one
    read-only set-access per region. Printed for the closing note (Llama-3-8B shape at
    max_len 8192, B=8: 64 bindings of 128 MiB)."""
    from jax_kv.memory import VmmArena

    arena = VmmArena(pool_bytes=0)
    t0 = time.perf_counter()
    cache = KvCache(
        num_layers=32, batch=8, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
        layout=Layout.SEQ_MAJOR, arena=arena, max_len=8192,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    s = arena.stats()
    print(
        f"\nzero-mapped {s.zero_mapped_bytes / 2**30:.1f} GiB in {s.zero_map_calls} maps + "
        f"{s.zero_access_calls} set-access calls: {s.zero_map_seconds * 1e3:.1f} ms of a "
        f"{seconds * 1e3:.1f} ms cache construction; committed {s.committed_bytes >> 20} MiB"
    )
    assert float(jnp.sum(cache.k[31].astype(jnp.float32))) == 0.0
    assert_fault_counters_zero(arena)
    cache.close()
    gc.collect()
    arena.close()
    assert arena.stats().handles_live == 0
