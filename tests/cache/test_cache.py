"""KvCache growth paths on CPU: EagerArena (both layouts, through jitted donated steps and
grow_cache) and the host-memory VmmArena (seq-major commit, head-major in-place re-stride).
Data is checked against a NumPy reference at every growth; failures leave the cache intact."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import append_step, live_prefix

from jax_kv import Layout, gqa_decode
from jax_kv.cache import (
    REASON_EAGER,
    REASON_HEAD_VMM,
    REASON_NONE,
    REASON_SEQ_VMM,
    CapacityError,
    KvCache,
)
from jax_kv.memory import ArenaExhausted, EagerArena, host_arena

L, B, Hkv, D = 2, 2, 2, 64
G = 64 << 10
LAYOUTS = [Layout.SEQ_MAJOR, Layout.HEAD_MAJOR]


def make_cache(layout, arena, *, num_layers=L, batch=B, **kw) -> KvCache:
    """A float32 KvCache of this module's shape (L layers, B sequences, Hkv heads of D)."""
    return KvCache(
        num_layers=num_layers,
        batch=batch,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=jnp.float32,
        layout=layout,
        arena=arena,
        **kw,
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_eager_growth_keeps_data_across_three_growths(layout, rng):
    cache = make_cache(layout, EagerArena(), min_bucket=8)
    step = append_step(layout)
    ref_k, ref_v, events = [], [], []
    for t in range(40):
        event = cache.ensure_capacity(t + 1)
        if event.grew:
            events.append(event)
            assert event.reason == REASON_EAGER
            assert event.shape_changed and event.pointer_changed
            assert not event.keeps_compiled_step
            assert event.bytes_moved == cache.live_bytes == 2 * L * B * t * Hkv * D * 4
            np.testing.assert_array_equal(live_prefix(cache, cache.k), np.stack(ref_k, 2))
        else:
            assert event.reason == REASON_NONE
        kn = rng.standard_normal((L, B, Hkv, D)).astype(np.float32)
        vn = rng.standard_normal((L, B, Hkv, D)).astype(np.float32)
        ptrs = cache.pointers()
        k, v = step(cache.k, cache.v, jnp.asarray(kn), jnp.asarray(vn), jnp.int32(t))
        cache.accept(k, v)
        assert cache.pointers() == ptrs  # donated: in place
        cache.advance(1)
        ref_k.append(kn)
        ref_v.append(vn)
    assert [(e.old_capacity, e.new_capacity) for e in events] == [(8, 16), (16, 32), (32, 64)]
    np.testing.assert_array_equal(live_prefix(cache, cache.k), np.stack(ref_k, 2))
    np.testing.assert_array_equal(live_prefix(cache, cache.v), np.stack(ref_v, 2))
    tail = np.asarray(cache.k[0])[:, 40:] if layout == Layout.SEQ_MAJOR else None
    if tail is not None:
        assert not tail.any()  # grow_cache zeros past the live prefix
    s = cache.stats()
    assert (s["growth_events"], s["growth_keeps"]) == (3, 0)
    cache.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_eager_cache_runs_gqa_decode_across_growth(layout, rng):
    Hq = 4
    cache = make_cache(layout, EagerArena(), num_layers=1, min_bucket=4)

    @jax.jit
    def decode(q, k, v, kc, vc, lengths):
        return gqa_decode(q, k, v, kc, vc, lengths, layout=layout)

    decode = jax.jit(decode, donate_argnums=(3, 4))
    ks = []
    for t in range(9):
        cache.ensure_capacity(t + 1)
        q = jnp.asarray(rng.standard_normal((B, Hq, D)).astype(np.float32))
        kn = rng.standard_normal((B, Hkv, D)).astype(np.float32)
        ks.append(kn)
        _, kc, vc = decode(
            q, jnp.asarray(kn), jnp.asarray(kn), cache.k[0], cache.v[0], jnp.asarray(cache.lengths)
        )
        cache.accept([kc], [vc])
        cache.advance(1)
    np.testing.assert_array_equal(live_prefix(cache, cache.k)[0], np.stack(ks, 1))
    assert cache.capacity == 16 and cache.growth_events == 2


def test_eager_failure_leaves_cache_usable_with_data_intact(rng):
    layout = Layout.HEAD_MAJOR
    arena = EagerArena()
    cache = make_cache(layout, arena, min_bucket=8, max_len=64)
    step = append_step(layout)
    for t in range(8):
        kn = jnp.asarray(rng.standard_normal((L, B, Hkv, D)).astype(np.float32))
        cache.accept(*step(cache.k, cache.v, kn, kn, jnp.int32(t)))
        cache.advance(1)
    before = live_prefix(cache, cache.k)
    arena.limit_bytes = arena.committed_bytes + 100  # room for nothing
    with pytest.raises(ArenaExhausted) as e:
        cache.ensure_capacity(9)
    for word in ("requested", "committed", "available", "stays at capacity 8"):
        assert word in str(e.value)
    with pytest.raises(CapacityError, match="exceeds the hard max of 64 tokens"):
        cache.ensure_capacity(65)
    assert cache.capacity == 8 and cache.shape == (B, Hkv, 8, D)
    np.testing.assert_array_equal(live_prefix(cache, cache.k), before)
    arena.limit_bytes = None  # memory back: the same cache grows and keeps its data
    assert cache.ensure_capacity(9).new_capacity == 16
    np.testing.assert_array_equal(live_prefix(cache, cache.k), before)


def test_metadata_capacity_and_unbounded_eager():
    kw = dict(
        num_layers=1,
        batch=1,
        num_kv_heads=1,
        head_dim=64,
        dtype=jnp.float32,
        arena=EagerArena(),
        min_bucket=16,
    )
    c = KvCache(**kw, model_max_len=20)
    assert (c.max_len, c.plan.source) == (20, "model metadata")
    assert c.ensure_capacity(17).new_capacity == 20  # last bucket clamps to the hard max
    with pytest.raises(CapacityError, match="model metadata"):
        c.ensure_capacity(21)
    u = KvCache(**kw)
    assert u.max_len is None and u.ensure_capacity(1000).new_capacity == 1024


# -- host-memory VMM: the VMM paths' bookkeeping and data movement on CPU ---------------------


def host_fill(cache, rng):
    """Writes random data into the committed live prefix through the host mapping."""
    drv = cache.arena.driver
    B_, S_ = cache.batch, cache.array_capacity
    full = []
    for r in cache.growth.regions:
        n = B_ * S_ * Hkv * D * 4
        x = np.frombuffer(drv.host_view(r.ptr, n), np.float32)
        if cache.layout == Layout.HEAD_MAJOR:
            x[:] = rng.standard_normal(x.size)
        else:  # only each slot's committed tokens: the rest is the read-only zero granule
            x = x.reshape(B_, S_, Hkv * D)
            for b, n in enumerate(cache.committed_tokens().tolist()):
                x[b, :n] = rng.standard_normal((n, Hkv * D))
        full.append(x)
    return full


def host_live(cache):
    drv = cache.arena.driver
    n_live = int(cache.lengths[0])
    out = []
    for r in cache.growth.regions:
        x = np.frombuffer(
            drv.host_view(r.ptr, cache.batch * cache.array_capacity * Hkv * D * 4), np.float32
        ).reshape(cache.shape)
        x = x[:, :n_live] if cache.layout == Layout.SEQ_MAJOR else x[:, :, :n_live]
        out.append(x.copy())
    return out


def test_host_vmm_seq_major_commits_in_place(rng):
    arena = host_arena(reserve_bytes=256 << 20, granule=G)
    max_len = 4096
    cache = make_cache(Layout.SEQ_MAJOR, arena, max_len=max_len, min_bucket=64)
    shape, ptrs = cache.shape, cache.pointers()
    assert shape == (B, max_len, Hkv, D)
    tok = Hkv * D * 4
    growths, prev = 0, 0
    for n in range(1, 1200, 7):
        host_fill(cache, rng)
        cache.lengths[:] = prev  # tokens a previous ensure_capacity made room for
        prev = n
        before = host_live(cache)
        e = cache.ensure_capacity(n)
        if e.grew:
            growths += 1
            assert (e.reason, e.bytes_moved, e.keeps_compiled_step) == (REASON_SEQ_VMM, 0, True)
            assert not e.shape_changed and not e.pointer_changed
        assert cache.pointers() == ptrs and cache.shape == shape
        for a, b in zip(before, host_live(cache), strict=True):
            np.testing.assert_array_equal(a, b)
        bound = 2 * L * B * (n * tok + G + 64 * tok)  # n + granule + one bucket per slot
        assert n * tok * 2 * L * B <= cache.committed_bytes <= bound
    assert growths >= 3
    cache.close()
    assert arena.committed_bytes == 0 and arena.live_views == 0
    arena.close()


def test_host_vmm_seq_major_commits_each_row_its_own_tokens(rng):
    """Seq-major on VMM: a row is committed to its own need, not the longest row's: one long
    prompt beside short ones holds one long slot. Data, pointers and shape stay; a refusal
    changes nothing; bad needs are refused by name."""
    arena = host_arena(reserve_bytes=256 << 20, granule=G)
    step, tok = G // (Hkv * D * 4), Hkv * D * 4  # one granule per commit step: 128 tokens
    cache = make_cache(
        Layout.SEQ_MAJOR, arena, batch=4, max_len=4096, min_bucket=step,
        initial_tokens=np.array([1000, 5, 0, step + 1]),
    )  # fmt: skip
    rows = lambda: cache.committed_tokens().tolist()  # noqa: E731
    ptrs, shape = cache.pointers(), cache.shape
    assert rows() == [1024, 128, 128, 256] and cache.capacity == 1024
    assert cache.committed_bytes == 2 * L * (1024 + 128 + 128 + 256) * tok
    assert arena.committed_bytes == cache.committed_bytes + G  # + the control region's granule
    host_fill(cache, rng)
    cache.lengths[:] = [1000, 5, 0, 129]
    before = [x.copy() for x in host_view_rows(cache)]

    e = cache.ensure_capacity(np.array([1001, 300, 1, 129]))
    assert rows() == [1024, 384, 128, 256]  # only row 1 grew: 2 granules per binding
    assert (e.granules_committed, e.bytes_moved, e.keeps_compiled_step) == (2 * 2 * L, 0, True)
    assert (e.old_capacity, e.new_capacity) == (1024, 1024)
    assert cache.would_grow(1025) and not cache.would_grow([1024, 384, 128, 256])
    assert cache.ensure_capacity([1000, 384, 1, 2]).reason == REASON_NONE
    assert cache.pointers() == ptrs and cache.shape == shape
    for a, b in zip(before, host_view_rows(cache), strict=True):
        for r, n in enumerate(cache.lengths.tolist()):
            np.testing.assert_array_equal(a[r][:n], b[r][:n])

    with pytest.raises(ValueError, match=r"advance: .*committed tokens \[1024, 384, 128, 256\]"):
        cache.advance([0, 0, 129, 0])
    for bad in ([1, 2], 2.5, True, "7", np.zeros((4, 1), np.int32), [0, -1, 0, 0]):
        with pytest.raises(ValueError, match=r"n: expected an int >= 0 or 4 of them"):
            cache.ensure_capacity(bad)

    committed = arena.committed_bytes
    arena.limit_bytes = committed + G  # one granule more: row 2 needs 8 per binding
    with pytest.raises(ArenaExhausted, match=r"n=\[B\] up to 1024.* stays at capacity 1024"):
        cache.ensure_capacity([0, 0, 1024, 0])
    assert rows() == [1024, 384, 128, 256] and arena.committed_bytes == committed
    arena.limit_bytes = None

    assert cache.ensure_capacity(500).new_capacity == 1024  # an int: every row to 500
    assert rows() == [1024, 512, 512, 512]
    cache.close()
    assert arena.committed_bytes == 0 and arena.live_views == 0
    arena.close()


def host_view_rows(cache):
    """Each binding's slots as [B, S, Hkv * D] host arrays (seq-major)."""
    drv, n = cache.arena.driver, cache.batch * cache.array_capacity * Hkv * D * 4
    return [
        np.frombuffer(drv.host_view(r.ptr, n), np.float32).reshape(cache.batch, -1, Hkv * D)
        for r in cache.growth.regions
    ]


def test_host_vmm_head_major_restrides_in_place(rng):
    arena = host_arena(reserve_bytes=256 << 20, granule=G)
    cache = make_cache(Layout.HEAD_MAJOR, arena, max_len=1024, min_bucket=16)
    ptrs = cache.pointers()
    events, prev = [], 16
    for n in (17, 40, 100, 300):
        host_fill(cache, rng)
        cache.lengths[:] = [prev, prev // 2]  # ragged (two runs), within the old capacity
        live_tokens, prev = prev + prev // 2, n
        drv = arena.driver
        before = []
        for r in cache.growth.regions:
            x = np.frombuffer(drv.host_view(r.ptr, B * Hkv * cache.capacity * D * 4), np.float32)
            before.append(x.reshape(cache.shape).copy())
        e = cache.ensure_capacity(n)
        events.append(e)
        assert (e.reason, e.shape_changed, e.pointer_changed) == (REASON_HEAD_VMM, True, False)
        assert e.bytes_moved == cache.live_bytes == 2 * L * live_tokens * Hkv * D * 4
        assert cache.pointers() == ptrs and cache.shape == (B, Hkv, e.new_capacity, D)
        for r, old in zip(cache.growth.regions, before, strict=True):
            x = np.frombuffer(drv.host_view(r.ptr, B * Hkv * cache.capacity * D * 4), np.float32)
            x = x.reshape(cache.shape)
            for b, length in enumerate(cache.lengths):
                np.testing.assert_array_equal(x[b, :, :length], old[b, :, :length])
    assert [e.new_capacity for e in events] == [32, 64, 128, 512]
    gc.collect()
    cache.close()
    arena.close()


def test_host_vmm_refused_commit_leaves_cache_intact(rng):
    arena = host_arena(reserve_bytes=256 << 20, granule=G)
    cache = make_cache(Layout.HEAD_MAJOR, arena, max_len=4096, min_bucket=64)
    host_fill(cache, rng)
    cache.lengths[:] = 60
    before = host_live(cache)
    committed = arena.committed_bytes
    arena.limit_bytes = committed + G  # one granule more: not enough for the next bucket
    with pytest.raises(ArenaExhausted) as e:
        cache.ensure_capacity(65)
    msg = str(e.value)
    assert "stays at capacity 64" in msg and "requested" in msg and "available" in msg
    assert cache.capacity == 64 and arena.committed_bytes == committed
    assert cache.shape == (B, Hkv, 64, D)
    for a, b in zip(before, host_live(cache), strict=True):
        np.testing.assert_array_equal(a, b)
    arena.limit_bytes = None
    assert cache.ensure_capacity(65).new_capacity == 128
    for a, b in zip(before, host_live(cache), strict=True):
        np.testing.assert_array_equal(a, b)
    cache.close()
    arena.close()
    assert arena.driver._live_handles == set()


def test_host_vmm_unbounded_reservation_is_bounded():
    arena = host_arena(reserve_bytes=64 << 20, granule=G, limit_bytes=16 << 20)
    cache = make_cache(Layout.SEQ_MAJOR, arena, num_layers=1, batch=1, min_bucket=64)
    tok = 2 * Hkv * D * 4  # K and V
    assert cache.plan.source == "unbounded"
    # device (limit, less the zero granule) bound, below the arena's VA
    assert cache.max_len == ((16 << 20) - G) // tok
    with pytest.raises(CapacityError, match="reservation"):
        cache.ensure_capacity(cache.max_len + 1)
    cache.close()
    arena.close()


def test_host_vmm_head_major_refused_scratch_leaves_no_freed_region_behind(rng):
    """The re-stride's scratch grows with the live tokens: the old one is freed, then the new
    one allocated. When that allocation is refused, the strategy must not keep the freed region
    (a later growth freed it again, or committed into address space another region owns)."""
    arena = host_arena(reserve_bytes=256 << 20, granule=G)
    cache = make_cache(Layout.HEAD_MAJOR, arena, max_len=4096, min_bucket=16)
    host_fill(cache, rng)
    cache.lengths[:] = [10, 5]
    cache.ensure_capacity(17)  # a scratch for 15 live tokens (one granule: 128 tokens)
    real = arena.allocate

    def refuse(nbytes):
        raise ArenaExhausted("injected: no address space for the scratch")

    cache.ensure_capacity(300)
    cache.lengths[:] = [200, 100]  # 300 live tokens: a scratch of 3 granules
    arena.allocate = refuse
    with pytest.raises(ArenaExhausted, match="injected"):
        cache.ensure_capacity(600)
    arena.allocate = real
    cache.lengths[:] = [60, 40]  # 100 live tokens: the freed scratch's size would do
    regions = arena.stats().regions
    before = host_live(cache)
    e = cache.ensure_capacity(600)  # a fresh scratch, not the freed one
    assert e.bytes_moved == cache.live_bytes and arena.stats().regions == regions + 1
    after = host_live(cache)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    gc.collect()
    cache.close()
    assert arena.stats().regions == 0
    arena.close()
