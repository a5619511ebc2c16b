"""Zero blocks: past `zero_singles_limit` granules, a region maps the read-only zero memory
once per aligned block of `zero_block_granules` granules instead of once per granule (the CUDA
driver refuses mappings past about 524,000 per process: bench/experiments/zero_map_cost.py).
On the host driver, which, as cuMemUnmap, refuses to unmap part of a mapping:

- a region of blocks is aligned to a block; whole blocks inside it are one mapping each, a run
  of granules short of a block a few (pieces of 2^k granules: 3 are 2 + 1);
- every uncommitted granule reads zeros, before a commit, beside committed granules, after a
  decommit;
- a commit inside a block unmaps the block once and maps its other granules back as pieces;
  a decommit that leaves a block with nothing committed maps it as one block again;
- a commit refused half way leaves the zero mappings as they were (no fault counter moves);
- share and copy-on-write into a region of blocks, and close(), leave nothing mapped or held;
- below the limit nothing changes: one mapping per granule.
"""

import gc

import numpy as np
import pytest
from host_bytes import fill, read

from jax_kv.memory import ArenaError, ArenaExhausted, host_arena
from jax_kv.memory._drivers import HostDriver
from jax_kv.memory.arena import live_arenas

G = 64 << 10
Z = 4  # granules per zero block in these tests


def blocks_arena(**kw):
    return host_arena(
        reserve_bytes=256 << 20, granule=G, zero_singles_limit=0, zero_block_granules=Z, **kw
    )


def zero_maps(arena):
    """(start granule, granules) of every zero mapping, relative to the region's start."""
    return dict(arena._state.zero_maps)


def assert_sound(arena):
    s = arena.stats()
    assert not any(s.faults.values()), s.faults
    state = arena._state
    covered = [j for start, n in state.zero_maps.items() for j in range(start, start + n)]
    assert len(covered) == len(set(covered)) == len(state.zero_mapped)  # no overlap
    assert not set(covered) & set(state.mapped)


@pytest.fixture
def arena():
    a = blocks_arena()
    yield a
    gc.collect()
    if not a.closed:
        a.close()
    assert a.driver.live_handles == 0


def test_a_region_maps_whole_blocks_once_and_its_tail_as_a_piece(arena):
    before = arena.stats().zero_mappings  # the zero granule's own mapping
    r = arena.allocate(10 * G)
    first = r.offset // G
    assert first % Z == 0  # aligned to a block
    maps = zero_maps(arena)
    assert maps[first] == Z and maps[first + Z] == Z  # two whole blocks
    assert maps[first + 8] == 2  # the block the region does not fill: one piece of 2
    assert arena.stats().zero_mappings - before == 3
    assert arena.stats().zero_mapped_bytes - G == 10 * G
    assert (read(arena, r, 0, 10 * G) == 0).all()
    assert_sound(arena)


def test_commit_inside_a_block_and_decommit_bring_the_block_back(arena):
    r = arena.allocate(8 * G)
    first = r.offset // G
    before = zero_maps(arena)
    unmaps = arena.stats().unmap_calls
    r.commit(G)  # granule 0: block 0 unmapped once, granules 1-3 mapped back as 2 + 1
    maps = zero_maps(arena)
    assert first not in maps and maps[first + 1] == 2 and maps[first + 3] == 1
    assert maps[first + Z] == Z
    assert arena.stats().unmap_calls - unmaps == 1
    fill(arena, r, 0, G, 5)
    assert (read(arena, r, 0, G) == 5).all() and (read(arena, r, G, 7 * G) == 0).all()
    r.commit(6 * G)  # granules 1-5: the pieces go, block 1 is unmapped once
    maps = zero_maps(arena)
    assert set(range(first, first + 6)).isdisjoint(maps)
    assert maps[first + 6] == 2
    assert (read(arena, r, 0, G) == 5).all() and (read(arena, r, 6 * G, 2 * G) == 0).all()
    assert_sound(arena)
    arena.decommit_now([(r, 2 * G, 6 * G)])  # block 1 keeps nothing committed: one block
    maps = zero_maps(arena)
    assert maps[first + Z] == Z and maps[first + 2] == 2
    assert (read(arena, r, 2 * G, 6 * G) == 0).all()
    arena.decommit_now([(r, 0, 2 * G)])
    assert zero_maps(arena) == before  # both blocks whole again
    assert (read(arena, r, 0, 8 * G) == 0).all()  # the old bytes do not show through
    assert arena.committed_bytes == 0
    assert_sound(arena)


def test_a_refused_commit_leaves_the_zero_mappings_as_they_were(arena):
    r = arena.allocate(8 * G)
    r.commit(G)
    covered = set(arena._state.zero_mapped)
    arena.driver.inject_failure("map", after=4)  # the zero block's granules go, then it fails
    with pytest.raises(ArenaError):
        r.commit(7 * G)
    assert r.committed_bytes == G
    assert set(arena._state.zero_mapped) == covered  # every granule reads zeros again
    assert (read(arena, r, G, 7 * G) == 0).all()
    assert_sound(arena)
    r.commit(8 * G)  # and it commits once the driver does
    assert r.committed_bytes == 8 * G
    assert_sound(arena)


def test_share_and_copy_on_write_into_a_region_of_blocks(arena):
    src, dst = arena.allocate(4 * G), arena.allocate(8 * G)
    src.commit(4 * G)
    fill(arena, src, 0, 4 * G, 7)
    arena.share(src, 0, dst, 2 * G, 3 * G)  # granules 2-4 of dst: across its two blocks
    assert (read(arena, dst, 2 * G, 3 * G) == 7).all()
    assert (read(arena, dst, 0, 2 * G) == 0).all() and (read(arena, dst, 5 * G, 3 * G) == 0).all()
    assert_sound(arena)
    arena.copy_on_write(dst, 4 * G, G)  # dst's own copy of the last shared granule
    fill(arena, dst, 4 * G, G, 9)
    assert (read(arena, src, 2 * G, G) == 7).all() and (read(arena, dst, 4 * G, G) == 9).all()
    arena.decommit_now([(dst, 0, 8 * G)])
    assert (read(arena, src, 0, 4 * G) == 7).all()  # the writer's granules stay
    first = dst.offset // G
    assert zero_maps(arena)[first] == Z and zero_maps(arena)[first + Z] == Z
    assert_sound(arena)


def test_close_unmaps_every_block_and_releases_every_handle():
    a = blocks_arena()
    regions = [a.allocate(n * G) for n in (3, 8, 13)]
    regions[1].commit(5 * G)
    regions[2].commit(2 * G)
    del regions
    gc.collect()
    a.close()
    assert a.driver.live_handles == 0
    assert a.stats().zero_mappings == 0


def test_below_the_limit_each_granule_is_one_mapping():
    a = host_arena(reserve_bytes=256 << 20, granule=G)
    r = a.allocate(8 * G)
    assert all(n == 1 for n in a._state.zero_maps.values())
    assert a.stats().zero_mappings == 1 + 8
    assert not a._state.zero_pieces  # created only when a region needs them
    del r
    a.close()


def test_the_limit_switches_new_regions_to_blocks_counting_every_arena_of_the_process():
    """The driver's limit is per process: the mappings of every open arena count."""
    gc.collect()
    held = sum(
        a.stats().zero_mappings + len(a._state.mapped)
        for a in live_arenas()
        if not a.closed and a.driver.kind == "cpu"
    )
    limit = held + 1 + 8 + 2  # this test's first arena: its zero granule, 8 granules, 2 more
    kw = dict(reserve_bytes=256 << 20, granule=G, zero_singles_limit=limit, zero_block_granules=Z)
    a = host_arena(**kw)
    small = a.allocate(8 * G)  # 1 + 8 mappings of this arena: singles
    b = host_arena(**kw)  # another arena: its zero granule is one more mapping of the process
    big = b.allocate(8 * G)  # 9 + 1 + 8 > limit - held: blocks
    assert not small.zero_blocks and big.zero_blocks
    assert b.stats().zero_mappings == 1 + 2
    a.close()
    small2 = b.allocate(2 * G)  # a closed, its mappings gone: singles again
    assert not small2.zero_blocks
    del small, big, small2
    b.close()


def test_the_host_driver_refuses_to_unmap_part_of_a_mapping():
    d = HostDriver(granule=G, total_memory=64 << 20)
    va = d.reserve(8 * G)
    block = d.create(4)
    d.map(va, block, 4)
    with pytest.raises(ArenaError, match="splits the mapping"):
        d.unmap(va + G, G)
    with pytest.raises(ArenaError, match="splits the mapping"):
        d.unmap(va, 2 * G)
    with pytest.raises(ArenaError, match="mapped whole"):
        d.map(va + 4 * G, block, 1)
    d.unmap(va, 4 * G)
    d.release(block)
    assert d.live_handles == 0
    d.free_va(va, 8 * G)
    d.close()


def test_the_mapping_limit_error_counts_block_mappings():
    a = blocks_arena()
    real_map, maps = a.driver.map, [0]

    def refusing(va, handle, granules=1):
        maps[0] += 1
        if maps[0] > 2:
            raise ArenaExhausted("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")
        return real_map(va, handle, granules)

    a.driver.map = refusing
    before = a.stats()
    with pytest.raises(ArenaExhausted, match="fewer slots or a shorter max_len"):
        a.allocate(16 * G)
    after = a.stats()
    assert after.zero_mapped_bytes == before.zero_mapped_bytes
    assert after.zero_mappings == before.zero_mappings
    a.driver.map = real_map
    r = a.allocate(16 * G)
    assert (read(a, r, 0, 16 * G) == 0).all()
    del r
    a.close()


def test_random_commits_and_decommits_keep_every_uncommitted_granule_zero(rng):
    a = blocks_arena()
    regions = [a.allocate(int(n) * G) for n in rng.integers(1, 20, 4)]
    try:
        for _ in range(60):
            r = regions[int(rng.integers(len(regions)))]
            n = r.reserved_bytes // G
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo + 1, n + 1))
            if rng.random() < 0.5:
                r.commit_ranges([(lo * G, hi * G)])
                fill(a, r, lo * G, (hi - lo) * G, 3)
            else:
                a.decommit_now([(r, lo * G, hi * G)])
            assert_sound(a)
            for region in regions:
                first = region.offset // G
                for j in range(region.reserved_bytes // G):
                    committed = first + j in a._state.mapped
                    got = read(a, region, j * G, G)
                    assert (got == 3).all() if committed else (got == 0).all(), (j, committed)
                    assert committed or first + j in a._state.zero_mapped
            whole = [s for s, k in a._state.zero_maps.items() if k == Z]
            assert all(s % Z == 0 for s in whole)
    finally:
        del regions
        gc.collect()
        a.close()
    assert a.driver.live_handles == 0
    assert np.int64(0) == a.committed_bytes


@pytest.mark.gpu
def test_zero_blocks_on_cuda():
    """The same paths on the CUDA driver: a region of blocks (Z = 4: whole blocks, a piece of
    2, the zero granule) reads zeros through a jax view before a commit, beside a committed
    granule that holds what was written, and after the decommit maps the block whole again;
    close() releases every handle."""
    import jax.numpy as jnp

    from jax_kv.memory import VmmArena

    arena = VmmArena(pool_bytes=0, zero_singles_limit=0, zero_block_granules=Z)
    g = arena.granule
    region = arena.allocate(10 * g)
    assert region.zero_blocks and arena.stats().zero_mappings == 1 + 3  # 2 blocks + a piece

    def row_sums():
        view = region.export((10, g // 4), jnp.float32)
        sums = np.asarray(jnp.abs(view).sum(axis=1))
        del view
        arena.wait_unviewed([region], timeout=60)
        return sums

    assert not row_sums().any()
    region.commit(g)  # block 0 unmapped once, granules 1-3 mapped back as 2 + 1
    arena.write(region.ptr, np.ones(g // 4, np.float32).tobytes())
    sums = row_sums()
    assert sums[0] == g // 4 and not sums[1:].any()
    arena.decommit_now([(region, 0, g)])
    assert arena._state.zero_maps[region.offset // g] == Z  # whole again
    assert not row_sums().any()
    s = arena.stats()
    assert not any(s.faults.values()), s.faults
    region.free()
    arena.close()
    assert arena.stats().handles_live == 0


def test_every_zero_piece_is_made_with_the_first_region_of_blocks(arena):
    """Made later, a commit or a release under memory pressure could find no memory for one."""
    assert not arena._state.zero_pieces
    arena.allocate(3 * G)
    assert sorted(arena._state.zero_pieces) == [2, 4]
    with pytest.raises(ValueError, match="power of two"):
        host_arena(reserve_bytes=64 << 20, granule=G, zero_block_granules=3)


@pytest.mark.parametrize("op", ["map", "unmap", "set_access"])
def test_one_driver_failure_anywhere_in_a_commit_or_share_leaves_zeros_readable(op):
    """One failure at each driver call of a commit inside a block, of one across two blocks and
    of a share: the call is refused, every granule not committed still reads zeros (a zero
    mapping without access would fault the read), the fault counters stay zero, and the arena
    commits once the driver does."""
    for after in range(12):
        for scenario in ("inside", "across", "share"):
            a = blocks_arena()
            src = a.allocate(4 * G)
            src.commit(4 * G)
            fill(a, src, 0, 4 * G, 7)
            r = a.allocate(8 * G)
            r.commit(G)
            a.driver.inject_failure(op, after=after)
            try:
                if scenario == "inside":
                    r.commit(3 * G)
                elif scenario == "across":
                    r.commit(6 * G)
                else:
                    a.share(src, 0, r, 2 * G, 4 * G)
            except ArenaError:
                pass
            a.driver._failures.clear()
            first = r.offset // G
            for j in range(8):
                if first + j in a._state.mapped:
                    continue
                assert first + j in a._state.zero_mapped, (op, after, scenario, j)
                assert (read(a, r, j * G, G) == 0).all(), (op, after, scenario, j)
            s = a.stats()
            assert not any(s.faults.values()) or s.quarantined_bytes, (op, after, scenario)
            if not s.quarantined_bytes:
                r.commit(8 * G)
                assert r.committed_bytes == 8 * G
            del src, r
            gc.collect()
            a.close()


def test_a_failure_while_making_a_zero_piece_leaves_nothing_behind():
    for op in ("map", "set_access", "unmap"):
        a = blocks_arena()
        live = a.driver.live_handles  # the zero granule
        a.driver.inject_failure(op)
        with pytest.raises(ArenaError):
            a.allocate(8 * G)
        assert a.driver.live_handles == live and not a._state.zero_pieces, op
        r = a.allocate(8 * G)  # and it works once the driver does
        assert (read(a, r, 0, 8 * G) == 0).all()
        del r
        a.close()
        assert a.driver.live_handles == 0
