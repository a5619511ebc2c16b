"""Zero blocks: past `zero_singles_limit` granules, a region is aligned to blocks of
`zero_block_granules` (Z) granules and maps the read-only zero memory as buddy pieces from
each block's start, [0], [1], [2-3], [4-7], .., [Z/2 .. Z-1] (log2 Z + 1 mappings a block)
instead of once per granule (the CUDA driver refuses mappings past about 524,000 per process:
bench/experiments/zero_map_cost.py). On the host driver, which, as cuMemUnmap, refuses to
unmap part of a mapping:

- a region of blocks is aligned to a block and mapped in that canonical form, a region end
  cutting a piece into aligned smaller ones;
- every uncommitted granule reads zeros, before a commit, beside committed granules, after a
  decommit;
- a commit unmaps the pieces holding its granules once each and maps their other granules
  back as aligned pieces ([4-7] less 4: [5], [6-7]); a decommit that leaves a canonical piece
  reading zeros maps it whole again, so a row growing from its start and released costs at
  most log2(Z) - 1 zero maps and as many unmaps more than granule by granule;
- a commit refused half way leaves the zero mappings as they were (no fault counter moves);
  a refused unmap while a piece is formed again leaves its granules reading zeros;
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


def blocks_arena(z=Z, **kw):
    kw.setdefault("reserve_bytes", 256 << 20)
    return host_arena(granule=G, zero_singles_limit=0, zero_block_granules=z, **kw)


def zero_maps(arena, region=None):
    """{start granule: granules} of every zero mapping; relative to `region`'s first granule
    and only those inside it, where given."""
    maps = arena._state.zero_maps
    if region is None:
        return dict(maps)
    first, n = region.offset // G, region.reserved_bytes // G
    return {s - first: k for s, k in maps.items() if first <= s < first + n}


BLOCK = {  # {start: granules} of a block of z granules that reads zeros, written out
    2: {0: 1, 1: 1},
    4: {0: 1, 1: 1, 2: 2},
    8: {0: 1, 1: 1, 2: 2, 4: 4},
    32: {0: 1, 1: 1, 2: 2, 4: 4, 8: 8, 16: 16},
}


def canonical(n, z):
    """The zero mappings of n granules (whole blocks) from a block's start that read zeros."""
    assert n % z == 0
    return {b + s: k for b in range(0, n, z) for s, k in BLOCK[z].items()}


def assert_sound(arena):
    """No fault counter, no granule both committed and zero-mapped or covered twice, and
    every zero mapping of a region of blocks inside it and an aligned piece of a canonical
    one: a power of two n at a multiple of n from its block's start, inside [0], [1], [2-3],
    [4-7], ..."""
    s = arena.stats()
    assert not any(s.faults.values()), s.faults
    state = arena._state
    covered = [j for start, n in state.zero_maps.items() for j in range(start, start + n)]
    assert len(covered) == len(set(covered)) == len(state.zero_mapped)  # no overlap
    assert not set(covered) & set(state.mapped)
    z = state.zero_block
    for start, n in state.zero_maps.items():
        assert arena._region_of(start) is arena._region_of(start + n - 1), (start, n)
        assert n & (n - 1) == 0, (start, n)
        r = start % z
        if n > 1:
            assert r and r % n == 0 and 1 << (r.bit_length() - 1) >= n, (start, n)


def assert_canonical(arena, regions):
    """Every canonical piece of a region of blocks with nothing committed is one mapping."""
    state, z = arena._state, arena._state.zero_block
    for region in regions:
        first, end = region.offset // G, (region.offset + region.reserved_bytes) // G
        for b in range(first - first % z, end, z):
            for s, k in BLOCK[z].items():
                piece = range(b + s, b + s + k)
                if piece.start < first or piece.stop > end:
                    continue
                if all(j in state.zero_mapped for j in piece):
                    assert state.zero_maps.get(b + s) == k, (b + s - first, k)


@pytest.fixture
def arena():
    a = blocks_arena()
    yield a
    gc.collect()
    if not a.closed:
        a.close()
    assert a.driver.live_handles == 0


def test_a_region_maps_each_block_as_buddy_pieces_from_its_start(arena):
    before = arena.stats().zero_mappings  # the zero granule's own mapping
    r = arena.allocate(10 * G)
    first = r.offset // G
    assert first % Z == 0  # aligned to a block
    # [0], [1], [2-3] | [4], [5], [6-7] | [8], [9]
    assert zero_maps(arena, r) == {0: 1, 1: 1, 2: 2, 4: 1, 5: 1, 6: 2, 8: 1, 9: 1}
    assert arena.stats().zero_mappings - before == 8
    assert arena.stats().zero_mapped_bytes - G == 10 * G
    assert (read(arena, r, 0, 10 * G) == 0).all()
    assert_sound(arena)


@pytest.mark.parametrize("z", [2, 8, 32])
def test_a_block_is_log2_z_plus_one_mappings(z):
    a = blocks_arena(z)
    r = a.allocate(2 * z * G)
    log2 = z.bit_length() - 1
    assert a.stats().zero_mappings == 1 + 2 * (log2 + 1)
    assert zero_maps(a, r) == canonical(2 * z, z)
    assert sorted(a._state.zero_pieces) == [1 << k for k in range(1, log2)]  # 2 .. z/2
    assert (read(a, r, 0, 2 * z * G) == 0).all()
    assert_sound(a)
    r.commit(2 * z * G)
    a.decommit_now([(r, 0, 2 * z * G)])
    assert zero_maps(a, r) == canonical(2 * z, z)
    del r
    a.close()
    assert a.driver.live_handles == 0


def test_a_region_end_cuts_a_piece_into_aligned_pieces():
    a = blocks_arena(8)
    r = a.allocate(7 * G)  # [0], [1], [2-3], [4-7] cut at 7: [4-5], [6]
    assert zero_maps(a, r) == {0: 1, 1: 1, 2: 2, 4: 2, 6: 1}
    assert_sound(a)
    del r
    a.close()


def test_committing_granule_0_unmaps_only_its_own_piece(arena):
    r = arena.allocate(8 * G)
    before, stats = zero_maps(arena, r), arena.stats()
    r.commit(G)
    after = arena.stats()
    assert after.unmap_calls - stats.unmap_calls == 1
    assert after.zero_map_calls == stats.zero_map_calls
    assert zero_maps(arena, r) == {k: n for k, n in before.items() if k != 0}
    fill(arena, r, 0, G, 5)
    assert (read(arena, r, 0, G) == 5).all() and (read(arena, r, G, 7 * G) == 0).all()
    assert_sound(arena)


def test_committing_granule_2_unmaps_its_piece_and_maps_granule_3_back(arena):
    r = arena.allocate(8 * G)
    stats = arena.stats()
    r.commit_ranges([(2 * G, 3 * G)])
    after = arena.stats()
    assert after.unmap_calls - stats.unmap_calls == 1  # [2-3]
    assert after.zero_map_calls - stats.zero_map_calls == 1  # [3]
    assert zero_maps(arena, r) == {0: 1, 1: 1, 3: 1, 4: 1, 5: 1, 6: 2}
    fill(arena, r, 2 * G, G, 5)
    assert (read(arena, r, 0, 2 * G) == 0).all() and (read(arena, r, 3 * G, 5 * G) == 0).all()
    arena.decommit_now([(r, 2 * G, 3 * G)])  # [3] unmapped, [2-3] mapped whole again
    assert zero_maps(arena, r) == canonical(8, Z)
    assert (read(arena, r, 0, 8 * G) == 0).all()  # the old bytes do not show through
    assert_sound(arena)


def test_a_split_piece_leaves_aligned_pieces_so_the_next_commit_splits_nothing():
    a = blocks_arena(8)
    r = a.allocate(8 * G)
    r.commit(5 * G)  # granules 0-4: [4-7] less 4 is [5], [6-7] (greedy would be [5-6], [7])
    assert zero_maps(a, r) == {5: 1, 6: 2}
    stats = a.stats()
    r.commit(6 * G)  # granule 5: its own piece, nothing mapped back
    after = a.stats()
    assert zero_maps(a, r) == {6: 2}
    assert after.unmap_calls - stats.unmap_calls == 1
    assert after.zero_map_calls == stats.zero_map_calls
    assert_sound(a)
    a.decommit_now([(r, 4 * G, 8 * G)])  # [6-7] unmapped, [4-7] whole again
    assert zero_maps(a, r) == {4: 4}
    a.decommit_now([(r, 0, 4 * G)])
    assert zero_maps(a, r) == canonical(8, 8)
    assert (read(a, r, 0, 8 * G) == 0).all()
    assert_sound(a)
    del r
    a.close()


def test_commit_across_blocks_and_decommit_form_the_canonical_pieces_again(arena):
    r = arena.allocate(8 * G)
    before = zero_maps(arena, r)
    r.commit_ranges([(G, 6 * G)])  # granules 1-5: [1], [2-3], [4], [5] go; [6-7] stays
    assert zero_maps(arena, r) == {0: 1, 6: 2}
    fill(arena, r, G, 5 * G, 5)
    assert (read(arena, r, G, 5 * G) == 5).all()
    assert (read(arena, r, 0, G) == 0).all() and (read(arena, r, 6 * G, 2 * G) == 0).all()
    arena.decommit_now([(r, 3 * G, 6 * G)])  # [3] alone ([2] committed), [4], [5]
    assert zero_maps(arena, r) == {0: 1, 3: 1, 4: 1, 5: 1, 6: 2}
    arena.decommit_now([(r, 0, 3 * G)])  # [1], and [2-3] whole again
    assert zero_maps(arena, r) == before
    assert (read(arena, r, 0, 8 * G) == 0).all()
    assert arena.committed_bytes == 0
    assert_sound(arena)


def row_request_calls(z, k, *, blocks):
    """(zero maps, unmaps) of one request on a fresh row of z granules: granules 0..k-1
    committed one at a time from the row's start, then all decommitted at once. Also checks
    that the row ends in the layout it started in (the next request costs the same)."""
    a = host_arena(
        reserve_bytes=64 << 20,
        granule=G,
        zero_singles_limit=0 if blocks else 1 << 30,
        zero_block_granules=z,
    )
    r = a.allocate(z * G)
    assert r.zero_blocks == blocks
    layout, before = zero_maps(a, r), a.stats()
    for j in range(k):
        r.commit_ranges([(j * G, (j + 1) * G)])
    a.decommit_now([(r, 0, k * G)])
    after = a.stats()
    assert zero_maps(a, r) == layout
    assert (read(a, r, 0, z * G) == 0).all()
    del r
    a.close()
    return after.zero_map_calls - before.zero_map_calls, after.unmap_calls - before.unmap_calls


@pytest.mark.parametrize("z", [2, 4, 8, 32])
def test_a_row_growing_from_its_start_costs_about_what_granule_by_granule_does(z):
    """The bound, proved for a row of z granules and k = 1..z. Granule by granule a request
    costs k zero maps (at the release) and 2k unmaps (each commit's zero granule, each granule
    at the release). With buddy pieces, commit j unmaps the one piece starting at j (k unmaps,
    P of them canonical pieces, P those meeting [0, k)) and maps the aligned pieces of its
    rest; each of those is unmapped later by a commit (k - P of them) or, e(k) in k-1's
    canonical piece, at the release, which also unmaps the k granules and maps the P canonical
    pieces. So zero maps = (k - P + e(k)) + P = k + e(k) and unmaps = 2k + e(k): e(k) more of
    each, e(k) = popcount(end - k) the aligned pieces of [k, end), end the end of k-1's
    canonical piece; at most log2(z) - 1 each (k = z/2 + 1), 2 (log2(z) - 1) together."""
    log2 = z.bit_length() - 1
    for k in range(1, z + 1):
        maps_b, unmaps_b = row_request_calls(z, k, blocks=True)
        maps_s, unmaps_s = row_request_calls(z, k, blocks=False)
        assert (maps_s, unmaps_s) == (k, 2 * k)  # granule by granule
        r = (k - 1) % z
        end = k if r < 2 else (k - 1) - r + 2 * (1 << (r.bit_length() - 1))
        extra = (end - k).bit_count()
        assert (maps_b - maps_s, unmaps_b - unmaps_s) == (extra, extra), k
        assert extra <= log2 - 1
    # The worst case is reached: the row's first granule past its half.
    if z >= 4:
        maps_b, unmaps_b = row_request_calls(z, z // 2 + 1, blocks=True)
        assert maps_b + unmaps_b == 3 * (z // 2 + 1) + 2 * (log2 - 1)


def test_a_refused_commit_leaves_the_zero_mappings_as_they_were(arena):
    r = arena.allocate(8 * G)
    r.commit(G)
    covered, maps = set(arena._state.zero_mapped), zero_maps(arena)
    arena.driver.inject_failure("map", after=4)  # [7] back, 3 granules, then refused
    with pytest.raises(ArenaError):
        r.commit(7 * G)
    assert r.committed_bytes == G
    assert set(arena._state.zero_mapped) == covered  # every granule reads zeros again
    assert zero_maps(arena) == maps
    assert (read(arena, r, G, 7 * G) == 0).all()
    assert_sound(arena)
    r.commit(8 * G)  # and it commits once the driver does
    assert r.committed_bytes == 8 * G
    assert_sound(arena)


def test_a_refused_unmap_while_a_piece_forms_again_leaves_its_granules_reading_zeros():
    """Forming [4-7] again unmaps [5] and [6-7]; where the driver refuses [6-7], 4 and 5 are
    mapped as [4-5] instead (not left unbacked), and the next decommit forms [4-7]."""
    a = blocks_arena(8)
    r = a.allocate(8 * G)
    r.commit(5 * G)  # [5], [6-7] stay
    a.driver.inject_failure("unmap", after=5 + 1)  # the 5 granules, [5], then [6-7] refused
    a.decommit_now([(r, 0, 5 * G)])  # the zero maps' error is the decommit's to swallow
    assert zero_maps(a, r) == {0: 1, 1: 1, 2: 2, 4: 2, 6: 2}
    assert (read(a, r, 0, 8 * G) == 0).all()
    assert_sound(a)
    r.commit_ranges([(4 * G, 5 * G)])  # [4-5] less 4: [5]
    assert zero_maps(a, r) == {0: 1, 1: 1, 2: 2, 5: 1, 6: 2}
    a.decommit_now([(r, 4 * G, 5 * G)])
    assert zero_maps(a, r) == canonical(8, 8)
    assert_sound(a)
    del r
    a.close()


def test_a_refused_map_while_a_piece_forms_again_maps_its_smaller_pieces_back():
    """Forming [4-7] again unmaps [5] and [6-7] first; where the driver then refuses the map of
    [4-7], [5] and [6-7] are mapped back (they read zeros before the decommit) and only the
    decommitted granule is left unbacked, as granule by granule (review of db850e0)."""
    a = blocks_arena(8)
    r = a.allocate(8 * G)
    r.commit(5 * G)  # [5], [6-7] read zeros
    a.driver.inject_failure("map")
    a.decommit_now([(r, 4 * G, 5 * G)])  # the zero maps' error is the decommit's to swallow
    assert zero_maps(a, r) == {5: 1, 6: 2}
    assert (read(a, r, 5 * G, 3 * G) == 0).all()
    assert a.stats().unbacked_bytes == G
    r.commit_ranges([(4 * G, 5 * G)])  # the unbacked granule commits again
    a.decommit_now([(r, 0, 5 * G)])
    assert zero_maps(a, r) == canonical(8, 8) and a.stats().unbacked_bytes == 0
    assert_sound(a)
    del r
    a.close()


def test_two_runs_inside_one_piece_form_it_once():
    """Decommitting granules 4 and 6 of a block whose 5 and 7 read zeros forms [4-7] once:
    one zero map, one set-access (review of db850e0: the piece was formed twice, and two
    refused set-access calls then raised a KeyError out of the decommit)."""
    a = blocks_arena(8)
    r = a.allocate(8 * G)
    r.commit_ranges([(4 * G, 5 * G), (6 * G, 7 * G)])
    before = a.stats()
    a.decommit_now([(r, 4 * G, 7 * G)])
    after = a.stats()
    assert after.zero_map_calls - before.zero_map_calls == 1
    assert after.zero_access_calls - before.zero_access_calls == 1
    assert zero_maps(a, r) == canonical(8, 8)
    r.commit_ranges([(4 * G, 5 * G), (6 * G, 7 * G)])
    a.driver.inject_failure("set_access")  # [4-7] taken back: its granules unbacked
    a.decommit_now([(r, 4 * G, 7 * G)])  # an ArenaError, swallowed, never a KeyError
    state = a._state
    covered = [j for start, n in state.zero_maps.items() for j in range(start, start + n)]
    assert len(covered) == len(set(covered)) == len(state.zero_mapped)
    r.commit_ranges([(4 * G, 8 * G)])  # what the refusal left unbacked commits again
    a.decommit_now([(r, 4 * G, 8 * G)])
    assert zero_maps(a, r) == canonical(8, 8)
    assert_sound(a)
    del r
    a.close()


def test_share_and_copy_on_write_into_a_region_of_blocks(arena):
    src, dst = arena.allocate(4 * G), arena.allocate(8 * G)
    src.commit(4 * G)
    fill(arena, src, 0, 4 * G, 7)
    arena.share(src, 0, dst, 2 * G, 3 * G)  # granules 2-4 of dst: across its two blocks
    assert (read(arena, dst, 2 * G, 3 * G) == 7).all()
    assert (read(arena, dst, 0, 2 * G) == 0).all() and (read(arena, dst, 5 * G, 3 * G) == 0).all()
    assert zero_maps(arena, dst) == {0: 1, 1: 1, 5: 1, 6: 2}
    assert_sound(arena)
    arena.copy_on_write(dst, 4 * G, G)  # dst's own copy of the last shared granule
    fill(arena, dst, 4 * G, G, 9)
    assert (read(arena, src, 2 * G, G) == 7).all() and (read(arena, dst, 4 * G, G) == 9).all()
    arena.decommit_now([(dst, 0, 8 * G)])
    assert (read(arena, src, 0, 4 * G) == 7).all()  # the writer's granules stay
    assert zero_maps(arena, dst) == canonical(8, Z)
    assert_sound(arena)


def test_close_unmaps_every_piece_and_releases_every_handle():
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
    assert b.stats().zero_mappings == 1 + 2 * 3  # 2 blocks of [0], [1], [2-3]
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


def test_the_mapping_limit_error_counts_piece_mappings():
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


@pytest.mark.parametrize("z", [4, 8])
def test_random_commits_and_decommits_keep_every_uncommitted_granule_zero(rng, z):
    """Also: each zero mapping an aligned buddy piece, each canonical piece with nothing
    committed one mapping, and a region that could not be aligned to a block (the reservation
    has no aligned room) mapping the same way."""
    a = blocks_arena(z, reserve_bytes=512 * G)
    regions = [a.allocate(int(n) * G) for n in rng.integers(1, 20, 4)]
    regions.append(a.allocate(3 * G))  # the free tail now starts 3 granules past a block
    regions.append(a.allocate(max(size for _, size in a._free_va)))  # all of it: unaligned
    assert regions[-1].offset // G % z == 3
    try:
        for _ in range(60):
            r = regions[int(rng.integers(len(regions)))]
            n = min(r.reserved_bytes // G, 40)  # the unaligned one: its first 40 granules
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo + 1, n + 1))
            if rng.random() < 0.5:
                r.commit_ranges([(lo * G, hi * G)])
                fill(a, r, lo * G, (hi - lo) * G, 3)
            else:
                a.decommit_now([(r, lo * G, hi * G)])
            assert_sound(a)
            assert_canonical(a, regions)
            for region in regions:
                first = region.offset // G
                for j in range(min(region.reserved_bytes // G, 40)):
                    committed = first + j in a._state.mapped
                    got = read(a, region, j * G, G)
                    assert (got == 3).all() if committed else (got == 0).all(), (j, committed)
                    assert committed or first + j in a._state.zero_mapped
    finally:
        del regions
        gc.collect()
        a.close()
    assert a.driver.live_handles == 0
    assert np.int64(0) == a.committed_bytes


@pytest.mark.gpu
def test_zero_blocks_on_cuda():
    """The same paths on the CUDA driver, Z = 8: a region of 10 granules is [0], [1], [2-3],
    [4-7], [8], [9] (the zero granule, pieces of 2 and 4) and reads zeros through a jax view;
    committing granule 4 maps [5] and [6-7] back (a 2-granule piece mapped at a split), the
    committed granule holds what was written, its neighbours read zeros; the decommit unmaps
    [5] and [6-7] and maps [4-7] whole again; close() releases every handle."""
    import jax.numpy as jnp

    from jax_kv.memory import VmmArena

    z = 8
    arena = VmmArena(pool_bytes=0, zero_singles_limit=0, zero_block_granules=z)
    g = arena.granule
    region = arena.allocate(10 * g)
    first = region.offset // g
    assert region.zero_blocks and arena.stats().zero_mappings == 1 + 6

    def row_sums():
        view = region.export((10, g // 4), jnp.float32)
        sums = np.asarray(jnp.abs(view).sum(axis=1))
        del view
        arena.wait_unviewed([region], timeout=60)
        return sums

    assert not row_sums().any()
    region.commit_ranges([(4 * g, 5 * g)])
    maps = {s - first: k for s, k in arena._state.zero_maps.items() if first <= s < first + 10}
    assert maps == {0: 1, 1: 1, 2: 2, 5: 1, 6: 2, 8: 1, 9: 1}
    arena.write(region.ptr + 4 * g, np.ones(g // 4, np.float32).tobytes())
    sums = row_sums()
    assert sums[4] == g // 4 and not sums[:4].any() and not sums[5:].any()
    arena.decommit_now([(region, 4 * g, 5 * g)])
    assert arena._state.zero_maps[first + 4] == 4  # whole again
    assert not row_sums().any()
    s = arena.stats()
    assert not any(s.faults.values()), s.faults
    region.free()
    arena.close()
    assert arena.stats().handles_live == 0


def test_every_zero_piece_is_made_with_the_first_region_of_blocks():
    """Made later, a commit or a release under memory pressure could find no memory for one.
    A block's largest piece is half of it: none of Z granules, none at all at Z = 2."""
    for z, sizes in ((2, []), (4, [2]), (16, [2, 4, 8])):
        a = blocks_arena(z)
        assert not a._state.zero_pieces
        r = a.allocate(3 * G)
        assert sorted(a._state.zero_pieces) == sizes
        assert a.stats().zero_handles == 1 + len(sizes)
        del r
        a.close()
    with pytest.raises(ValueError, match="power of two"):
        host_arena(reserve_bytes=64 << 20, granule=G, zero_block_granules=3)


@pytest.mark.parametrize("op", ["map", "unmap", "set_access"])
def test_one_driver_failure_anywhere_in_a_commit_or_share_leaves_zeros_readable(op):
    """One failure at each driver call of a commit inside a piece, of one across blocks, of a
    row's next granule splitting a piece of 4 and of a share (Z = 4 and 8): the call is
    refused, every granule not committed still reads zeros (a zero mapping without access
    would fault the read), the fault counters stay zero, and the arena commits once the
    driver does."""
    scenarios = ("inside", "across", "grow", "share")
    for z in (4, 8):
        for after in range(16):
            for scenario in scenarios:
                a = blocks_arena(z)
                src = a.allocate(4 * G)
                src.commit(4 * G)
                fill(a, src, 0, 4 * G, 7)
                r = a.allocate(16 * G)
                r.commit(G if scenario != "grow" else 4 * G)
                a.driver.inject_failure(op, after=after)
                try:
                    if scenario == "inside":
                        r.commit(3 * G)
                    elif scenario == "across":
                        r.commit(11 * G)
                    elif scenario == "grow":
                        r.commit(5 * G)  # granule 4: [4-7] at z = 8, [4] at z = 4
                    else:
                        a.share(src, 0, r, 2 * G, 4 * G)
                except ArenaError:
                    pass
                a.driver._failures.clear()
                first = r.offset // G
                case = (z, op, after, scenario)
                for j in range(16):
                    if first + j in a._state.mapped:
                        continue
                    assert first + j in a._state.zero_mapped, (*case, j)
                    assert (read(a, r, j * G, G) == 0).all(), (*case, j)
                s = a.stats()
                assert not any(s.faults.values()) or s.quarantined_bytes, case
                if not s.quarantined_bytes:
                    assert_sound(a)
                    r.commit(16 * G)
                    assert r.committed_bytes == 16 * G
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
