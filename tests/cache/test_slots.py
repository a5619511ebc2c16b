"""SlotCache (issue 21, item 2): memory per request slot. On the host driver (CI) and the CUDA
driver (H200): a slot's granules are its own, committed by ensure_slot (all or nothing) and
returned by release_slot under the live views (the slot then reads zeros, the other slots keep
their data), committed bytes follow the slots and never exceed live bytes plus one granule
per (binding, slot in use). The eager path counts the same granules against a budget."""

import gc

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv.cache import CapacityError, SlotCache
from jax_kv.memory import ArenaExhausted, host_arena

L, B, D = 2, 4, 64


def arenas():
    return [
        pytest.param("host", id="host"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
        pytest.param("eager", id="eager"),
    ]


@pytest.fixture(params=arenas())
def arena(request):
    if request.param == "eager":
        yield None
        return
    if request.param == "host":
        a = host_arena(reserve_bytes=1 << 30, granule=64 << 10)
    else:
        from jax_kv.memory import VmmArena

        a = VmmArena(pool_bytes=0)
    yield a
    gc.collect()
    if not a.closed:
        a.close()


def make(arena, *, hkv=2, max_len=1000, dtype=jnp.float32, **kw):
    granule = None if arena is not None else 16 * hkv * D * jnp.dtype(dtype).itemsize
    return SlotCache(
        num_layers=L, num_slots=B, num_kv_heads=hkv, head_dim=D, dtype=dtype, max_len=max_len,
        arena=arena, granule_bytes=granule, **kw,
    )  # fmt: skip


def granule_tokens(arena):
    """Tokens per granule of a binding: 128 on the host arena, 4,096 on CUDA's 2 MiB."""
    with make(arena) as probe:
        return probe.granule // probe.token_bytes


def now(array):
    """The array's bytes as they are now. The cache writes its views in place, behind JAX's
    back, and a GPU array keeps the host copy of its first np.asarray (a CPU one is a view)."""
    return np.asarray(jnp.copy(array))


def write_token_rows(cache, b, n, value):
    """Writes `value` into the first n tokens of slot b of every binding (host bytes)."""
    row = np.full((n * cache.token_bytes // 4,), value, np.float32).tobytes()
    for r in cache.regions:
        cache.arena.write(r.ptr + b * cache.slot_bytes, row)


def test_geometry_slots_are_whole_granules_and_tokens(arena):
    # Hkv=3: a token is 768 bytes, which does not divide a 64 KiB (or 2 MiB) granule.
    with make(arena, hkv=3) as cache:
        assert cache.slot_bytes % cache.token_bytes == 0
        assert cache.slot_tokens >= cache.max_len
        if cache.is_vmm:  # no granule shared by two slots
            assert cache.slot_bytes % cache.granule == 0
            assert cache.slot_bytes - cache.max_len * cache.token_bytes < np.lcm(
                cache.granule, cache.token_bytes
            )
        else:  # the eager path only counts granules: dense rows of max_len
            assert cache.slot_tokens == cache.max_len
        assert cache.k[0].shape == (B, cache.slot_tokens, 3, D)
        assert now(cache.committed).tolist() == [0] * B
        assert cache.held_bytes == 0
        if cache.is_vmm:
            assert cache.committed_bytes == 0


def test_ensure_and_release_follow_the_slot(arena):
    with make(arena, max_len=4 * granule_tokens(arena)) as cache:
        g_tokens = cache.granule // cache.token_bytes
        n0 = cache.ensure_slot(0, 1)
        assert n0 == 1 and cache.granules_for(1) == 1
        assert cache.ensure_slot(0, g_tokens) == 0  # still one granule
        assert cache.ensure_slot(0, g_tokens + 1) == 1
        assert cache.ensure_slot(2, 3 * g_tokens) == 3
        assert now(cache.committed).tolist() == [2 * g_tokens, 0, 3 * g_tokens, 0]
        assert cache.held_bytes == 5 * cache.bindings * cache.granule
        if cache.is_vmm:
            assert cache.committed_bytes == cache.held_bytes
            write_token_rows(cache, 0, 2 * g_tokens, 1.0)
            write_token_rows(cache, 2, 3 * g_tokens, 2.0)
            k0 = now(cache.k[0])  # a copy: a zero-copy numpy view would hold the arena view
            assert (k0[0, : 2 * g_tokens] == 1).all() and (k0[2, : 3 * g_tokens] == 2).all()
            assert (k0[0, 2 * g_tokens :] == 0).all()  # the tail: the zero granule
        before = cache.held_bytes
        freed = cache.release_slot(0)
        assert freed == 2 * cache.bindings * cache.granule
        assert cache.held_bytes == before - freed
        assert now(cache.committed).tolist() == [0, 0, 3 * g_tokens, 0]
        assert cache.release_slot(0) == 0  # idempotent
        if cache.is_vmm:
            assert cache.committed_bytes == cache.held_bytes
            for a in (*cache.k, *cache.v):  # the live views: slot 0 zeros, slot 2 intact
                host = now(a)
                assert (host[0] == 0).all()
                assert (host[2, : 3 * g_tokens] == 2).all()
            # A released slot's granules come back as fresh zeros when committed again.
            cache.ensure_slot(0, 1)
            assert (now(cache.k[1])[0] == 0).all()
        else:
            assert cache.committed_bytes == 2 * L * B * cache.slot_bytes  # dense, always


def test_refusals_leave_the_cache_as_it_was(arena):
    with make(arena, budget_bytes=None if arena is None else None) as cache:
        cache.ensure_slot(1, 5)
        state = (cache.granules.copy(), now(cache.committed).copy(), cache.held_bytes)
        with pytest.raises(CapacityError, match=r"1001 tokens outside \[0, max_len=1000\]"):
            cache.ensure_slot(1, 1001)
        with pytest.raises(ValueError, match=r"slot expected in \[0, 4\), got 4"):
            cache.ensure_slot(4, 1)
        with pytest.raises(ValueError, match=r"slot expected an int, got True"):
            cache.release_slot(True)
        assert (cache.granules == state[0]).all()
        assert (now(cache.committed) == state[1]).all() and cache.held_bytes == state[2]


def test_budget_refuses_all_or_nothing(arena):
    g_tokens = granule_tokens(arena)
    with make(arena, max_len=4 * g_tokens) as probe:
        per_granule = probe.bindings * probe.granule
    with make(arena, max_len=4 * g_tokens, budget_bytes=3 * per_granule) as cache:
        cache.ensure_slot(0, 2 * g_tokens)
        assert cache.available_bytes() <= per_granule
        with pytest.raises(ArenaExhausted, match=r"slot 3 needs .* more bytes for .* tokens"):
            cache.ensure_slot(3, 2 * g_tokens)
        assert cache.granules.tolist() == [2, 0, 0, 0]
        assert now(cache.committed).tolist()[3] == 0
        if cache.is_vmm:
            assert cache.committed_bytes == 2 * per_granule
        cache.release_slot(0)
        cache.ensure_slot(3, 2 * g_tokens)  # the memory came back
        assert cache.granules.tolist() == [0, 0, 0, 2]


def test_invariant_over_a_random_schedule(arena):
    rng = np.random.default_rng(0)
    with make(arena, max_len=700) as cache:
        in_use = set()
        for _ in range(200):
            b = int(rng.integers(B))
            if b in in_use and rng.random() < 0.3:
                cache.release_slot(b)
                in_use.discard(b)
            else:
                n = min(cache.max_len, int(cache.lengths[b]) + int(rng.integers(1, 80)))
                cache.ensure_slot(b, n)
                cache.lengths[b] = n - 1  # the engine commits one token ahead of the live ones
                in_use.add(b)
            assert cache.held_bytes <= cache.live_bytes + cache.floor_bytes(len(in_use))
            assert (cache.committed_tokens() >= cache.lengths).all()
            if cache.is_vmm:
                assert cache.committed_bytes == cache.held_bytes


def test_a_refused_construction_raises_its_cause_and_leaves_the_arena_as_it_was():
    """The address space runs out after the slots' regions were allocated (at the control
    region): the caller sees ArenaExhausted, not a cleanup error, and the arena holds no
    region, view or committed byte of the cache (when a region after the slots' views was
    refused, those views had been unknown to close(): 'N view(s) still live' replaced the
    cause)."""
    # 4 slots x 4096 tokens x 512 B x 4 bindings = 32 MiB of slots, and granule 0 holds the
    # zero granule: no room is left for the control region.
    arena = host_arena(reserve_bytes=(32 << 20) + (64 << 10), granule=64 << 10)
    try:
        probe = dict(num_layers=L, num_slots=B, num_kv_heads=2, head_dim=D, dtype=jnp.float32,
                     arena=arena)  # fmt: skip
        with pytest.raises(ArenaExhausted, match="address space"):
            SlotCache(max_len=4096, **probe)
        s = arena.stats()
        assert (s.regions, s.live_views, s.committed_bytes) == (0, 0, 0)
        with SlotCache(max_len=2048, **probe) as cache:  # half the slots' space fits
            cache.ensure_slot(0, 1)
    finally:
        gc.collect()
        arena.close()


def test_the_prefix_store_is_no_larger_than_the_memory_that_could_back_it():
    """A cached block is physical memory: the store never needs more blocks than the arena's
    capacity holds. It takes no address space (it holds handles, VmmArena.hold)."""
    arena = host_arena(reserve_bytes=1 << 30, granule=64 << 10, limit_bytes=8 << 20)
    try:
        kw = dict(num_layers=L, num_slots=B, num_kv_heads=2, head_dim=D, dtype=jnp.float32,
                  max_len=4096, arena=arena)  # fmt: skip
        with SlotCache(prefix_store=True, **kw) as cache:
            per_block = cache.bindings * cache.block_tokens * cache.token_bytes
            assert arena.capacity_bytes == 8 << 20
            assert cache.store_blocks == (8 << 20) // per_block < B * 4096 // cache.block_tokens
            assert arena.stats().regions == cache.bindings + 1  # the slots' and the control
        with SlotCache(prefix_store=True, **(kw | {"max_len": 256})) as small:
            assert small.store_blocks == B * small.slot_tokens // small.block_tokens  # uncapped
    finally:
        gc.collect()
        arena.close()


def footprint(arena):
    s = arena.stats()
    return (s.regions, s.live_views, s.committed_bytes, s.handles_live)


def test_a_refused_budget_leaves_the_arena_as_it_was():
    """budget_bytes is checked before any memory is taken (it was checked after the regions
    and the committed control region existed, outside the cleanup)."""
    arena = host_arena(reserve_bytes=64 << 20, granule=64 << 10)
    try:
        before = footprint(arena)
        with pytest.raises(ValueError, match="budget_bytes: expected an int or None, got 1.5"):
            make(arena, budget_bytes=1.5)
        assert footprint(arena) == before
    finally:
        gc.collect()
        arena.close()


def test_beside_step_releases_without_waiting_for_the_device(arena, monkeypatch):
    """Inside beside_step() release_slot unmaps without a device synchronize (the engine's
    step in flight leaves the slot idle); outside it synchronizes first. Either way the slot
    then reads zeros, the other slots keep their data and the bound drops to 0."""
    if arena is None:
        pytest.skip("the eager path unmaps nothing")
    syncs = []
    driver = arena._state.driver
    real = driver.synchronize
    monkeypatch.setattr(driver, "synchronize", lambda: (syncs.append(1), real())[1])
    with make(arena, max_len=2 * granule_tokens(arena)) as cache:
        g_tokens = cache.granule // cache.token_bytes
        for b in (0, 1, 2):
            cache.ensure_slot(b, g_tokens + 1)
            write_token_rows(cache, b, g_tokens + 1, float(b + 1))
        syncs.clear()  # (the probe cache of granule_tokens closed with one)
        with cache.beside_step():
            assert cache.release_slot(0) == 2 * cache.bindings * cache.granule
        assert syncs == []
        cache.release_slot(1)
        assert syncs == [1]
        assert now(cache.committed).tolist() == [0, 0, 2 * g_tokens, 0]
        for a in (*cache.k, *cache.v):
            host = now(a)
            assert (host[:2] == 0).all() and (host[2, : g_tokens + 1] == 3).all()
        assert cache.committed_bytes == cache.held_bytes == 2 * cache.bindings * cache.granule


def test_hand_over_of_a_slot_linked_to_the_prefix_store_replaces_its_granules(arena):
    """hand_over(b, n) of a slot whose blocks the store holds (it wrote them) or maps (from
    the store): fresh zeroed granules replace the ones n tokens take, the rest are released,
    the store keeps its blocks (another slot still reads them) and the slot's links to the
    store are gone; committed bytes follow."""
    if arena is None:
        pytest.skip("the prefix store needs a VmmArena")
    # max_len in granules: a block is 128 tokens on the host arena, 4,096 on CUDA's 2 MiB.
    with make(arena, max_len=4 * granule_tokens(arena), prefix_store=True) as cache:
        bt = cache.block_tokens
        cache.ensure_slot(0, 2 * bt + 1)
        write_token_rows(cache, 0, 2 * bt + 1, 5.0)
        s0, s1 = cache.cache_block(0, 0), cache.cache_block(0, 1)
        cache.map_cached(1, [s0])  # slot 1 reads block 0 from the store
        cache.lengths[:2] = (2 * bt + 1, bt)
        assert cache.hand_over(0, 1) == 0  # its 1 own granule out, 1 fresh one in
        assert int(cache.granules[0]) == 1 and cache.lengths[0] == 0
        assert not cache.slot_cached[0] and set(cache.store_owner) == set()
        for a in (*cache.k, *cache.v):
            host = now(a)
            assert (host[0] == 0).all()  # fresh granules, and the zero granule past them
            assert (host[1, :bt] == 5).all()  # slot 1 still maps the store's block 0
        assert cache.committed_bytes == cache.held_bytes
        assert cache.cached_only_bytes == cache.block_bytes  # block 1: the store's alone
        cache.hand_over(1, bt + 1)
        assert cache.store_refs[s0] == 0 and not cache.slot_shared[1]
        assert int(cache.granules[1]) == 1  # all it held: hand_over never commits more
        assert (now(cache.k[0])[1] == 0).all()
        assert cache.cached_only_bytes == 2 * cache.block_bytes
        assert cache.committed_bytes == cache.held_bytes
        assert cache.evict(s0) + cache.evict(s1) == 2 * cache.block_bytes


def test_hand_over_keeps_the_granules_the_next_request_needs(arena):
    """hand_over(b, n): the granules n tokens take stay mapped as they are (no map call, the
    old bytes still there for the new request to overwrite), the rest are released, the bound
    and length start over; more tokens than held keep all; refusals name the argument."""
    g_tokens = granule_tokens(arena)
    with make(arena, max_len=4 * g_tokens) as cache:
        cache.ensure_slot(1, 3 * g_tokens)
        if cache.is_vmm:
            write_token_rows(cache, 1, 3 * g_tokens, 5.0)
            maps = cache.arena.stats().map_calls
        cache.lengths[1] = 3 * g_tokens
        assert cache.hand_over(1, g_tokens + 1) == cache.bindings * cache.granule
        assert int(cache.granules[1]) == 2 and cache.lengths[1] == 0
        assert now(cache.committed).tolist() == [0, 2 * g_tokens, 0, 0]
        assert cache.ensure_slot(1, 2 * g_tokens) == 0
        if cache.is_vmm:
            assert cache.arena.stats().map_calls == maps
            assert cache.committed_bytes == cache.held_bytes == 2 * cache.bindings * cache.granule
            for a in (*cache.k, *cache.v):
                host = now(a)
                assert (host[1, : 2 * g_tokens] == 5).all() and (host[1, 2 * g_tokens :] == 0).all()
        assert cache.hand_over(1, 4 * g_tokens) == 0 and int(cache.granules[1]) == 2
        with pytest.raises(CapacityError, match="hand_over: .* max_len"):
            cache.hand_over(1, 4 * g_tokens + 1)
        assert cache.release_slot(1) == 2 * cache.bindings * cache.granule
