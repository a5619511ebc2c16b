"""One physical granule mapped at several addresses (issue 23, item 1), on the host driver,
whose handles are memfd granules mapped MAP_SHARED, as cuMemMap maps one handle at several
addresses: a shared range shows the writer's bytes; unmapping one mapping leaves the others;
committed_bytes counts physical memory once and mapped_bytes every mapping; a handle returns to
the pool only with its last mapping; copy_on_write gives a shared granule a copy of its own;
refusals change nothing; close() releases each handle once."""

import gc

import numpy as np
import pytest
from host_bytes import fill, read

from jax_kv.memory import ArenaError

G = 64 << 10  # the host granule of the shared `arena` fixture (conftest.py)


def accounting(arena):
    s = arena.stats()
    return (s.committed_bytes, s.mapped_bytes, s.shared_mappings, s.pooled_bytes, s.handles_live)


@pytest.fixture
def shared(arena):
    """src: 4 granules committed and filled with 7; dst: 4 granules reserved, the last 3 of
    which map src's granules 1-3."""
    src, dst = arena.allocate(4 * G), arena.allocate(4 * G)
    src.commit(4 * G)
    fill(arena, src, 0, 4 * G, 7)
    report = arena.share(src, G, dst, G, 3 * G)
    assert report.granules == 3
    return src, dst


def test_a_shared_range_shows_the_writers_bytes(arena, shared):
    src, dst = shared
    assert (read(arena, dst, G, 3 * G) == 7).all()
    assert (read(arena, dst, 0, G) == 0).all()  # not shared: the zero granule
    fill(arena, src, 2 * G, 16, 9)  # a later write through one mapping shows in the other
    assert (read(arena, dst, 2 * G, 16) == 9).all()


def test_physical_memory_counts_once(arena, shared):
    s = arena.stats()
    assert s.committed_bytes == 4 * G and s.mapped_bytes == 7 * G
    assert s.shared_mappings == 3 and s.share_calls == 3
    assert arena.committed_bytes == 4 * G
    assert s.handles_live == arena.driver.live_handles


@pytest.mark.parametrize("spare", [0, 64], ids=["by-other-regions", "by-mappings"])
def test_physical_bytes_of_some_regions_counts_a_shared_handle_once(arena, shared, spare):
    """Against the arena's own count (all regions) and by hand: src holds 4 handles, dst maps 3
    of them and commits 1 of its own; a third region commits 2 that neither of the others maps.
    A spare reserved region of 64 granules makes the regions left out outnumber the mappings:
    the count then goes over the mappings instead of over the regions left out."""
    src, dst = shared
    if spare:
        arena.allocate(spare * G)
    dst.commit(G)  # dst's granule 0: a handle of its own
    other = arena.allocate(4 * G)
    other.commit(2 * G)
    assert arena.physical_bytes([src, dst, other]) == arena.committed_bytes == 7 * G
    assert arena.physical_bytes([src]) == 4 * G
    assert arena.physical_bytes([dst]) == 4 * G  # 3 shared + its own
    assert arena.physical_bytes([dst, src]) == 5 * G  # the shared three once
    assert arena.physical_bytes([other]) == 2 * G
    assert arena.physical_bytes([other, dst]) == 6 * G
    assert arena.physical_bytes([]) == 0


@pytest.mark.parametrize("first", ["dst", "src"])
def test_unmapping_one_mapping_leaves_the_others(arena, shared, first):
    src, dst = shared
    arena.pool_target = 0  # a handle whose last mapping goes is released, not pooled
    gone, kept = (dst, src) if first == "dst" else (src, dst)
    gone.decommit(0)
    arena.flush()
    s = arena.stats()
    assert s.shared_mappings == 0
    if first == "dst":
        assert s.committed_bytes == 4 * G and s.mapped_bytes == 4 * G  # src holds all four
        assert (read(arena, src, 0, 4 * G) == 7).all()
    else:
        # src's granule 0 was its own: released; 1-3 live on through dst.
        assert s.committed_bytes == 3 * G and s.mapped_bytes == 3 * G
        assert (read(arena, dst, G, 3 * G) == 7).all()
        assert (read(arena, src, 0, 4 * G) == 0).all()  # src reads the zero granule again
    assert arena.driver.live_handles == s.handles_live == 3 + (first == "dst") + s.zero_handles
    kept.decommit(0)
    arena.flush()
    s = arena.stats()
    assert (s.committed_bytes, s.mapped_bytes, s.handles_live) == (0, 0, 1)  # the zero granule


def test_copy_on_write_gives_a_granule_its_own_copy(arena, shared):
    src, dst = shared
    assert arena.copy_on_write(dst, G, 2 * G) == 2
    s = arena.stats()
    assert s.cow_copies == 2 and s.shared_mappings == 1
    assert s.committed_bytes == 6 * G and s.mapped_bytes == 7 * G
    assert (read(arena, dst, G, 3 * G) == 7).all()  # the copies hold the shared bytes
    fill(arena, dst, G, 2 * G, 5)  # writable now, and private
    assert (read(arena, src, G, 2 * G) == 7).all()
    fill(arena, src, 3 * G, 8, 3)  # the granule still shared still shows the writer
    assert (read(arena, dst, 3 * G, 8) == 3).all()
    assert arena.copy_on_write(dst, G, 2 * G) == 0  # nothing shared left there


def test_copy_on_write_of_both_mappings_in_one_range(arena):
    a = arena.allocate(4 * G)
    a.commit(G)
    fill(arena, a, 0, G, 4)
    arena.share(a, 0, a, G, G)  # granules 0 and 1 of one region map one handle
    assert arena.copy_on_write(a, 0, 2 * G) == 1  # one copy makes both private
    s = arena.stats()
    assert s.shared_mappings == 0 and s.committed_bytes == 2 * G
    fill(arena, a, 0, 8, 1)
    assert (read(arena, a, G, G) == 4).all()


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((0, 1, G), ValueError, r"share: offset and nbytes must be multiples of the granule"),
        ((0, 0, 5 * G), ValueError, r"share: \[0, 327680\) passes the region's 262144"),
        ((0, 2 * G, G), ArenaError, r"destination granule 0 of the range is already committed"),
    ],
)
def test_bad_shares_are_refused_and_change_nothing(arena, shared, args, error, match):
    src, dst = shared
    before = accounting(arena)
    src_offset, dst_offset, nbytes = args
    with pytest.raises(error, match=match):
        arena.share(src, src_offset, dst, dst_offset, nbytes)
    assert accounting(arena) == before


def test_sharing_an_uncommitted_source_is_refused(arena):
    src, dst = arena.allocate(2 * G), arena.allocate(2 * G)
    src.commit(G)
    before = accounting(arena)
    match = r"share: source granule 1 of the range \(src_offset=0\) is not committed"
    with pytest.raises(ArenaError, match=match):
        arena.share(src, 0, dst, 0, 2 * G)
    assert accounting(arena) == before
    assert (read(arena, dst, 0, 2 * G) == 0).all()


def test_a_failed_share_maps_nothing(arena):
    src, dst = arena.allocate(4 * G), arena.allocate(4 * G)
    src.commit(4 * G)
    fill(arena, src, 0, 4 * G, 6)
    before = accounting(arena)
    arena.driver.inject_failure("map", after=2)  # the third granule's map fails
    with pytest.raises(ArenaError, match="injected map failure"):
        arena.share(src, 0, dst, 0, 4 * G)
    assert accounting(arena) == before
    assert (read(arena, dst, 0, 4 * G) == 0).all()  # the zero granule is back everywhere
    arena.share(src, 0, dst, 0, 4 * G)  # and the range can be shared afterwards
    assert (read(arena, dst, 0, 4 * G) == 6).all()


def test_a_failed_copy_on_write_keeps_the_shared_mapping(arena, shared):
    src, dst = shared
    arena.driver.inject_failure("map")  # the copy's new mapping fails
    with pytest.raises(ArenaError, match="injected map failure"):
        arena.copy_on_write(dst, G, G)
    s = arena.stats()
    assert s.shared_mappings == 3 and s.cow_copies == 0 and s.committed_bytes == 4 * G
    assert (read(arena, dst, G, 3 * G) == 7).all()
    fill(arena, src, G, 8, 2)
    assert (read(arena, dst, G, 8) == 2).all()  # still the same granule


def assert_close_leaves_nothing(arena):
    """close() unmaps every mapping the driver holds and releases every handle."""
    gc.collect()
    arena.close()
    assert not arena.driver._mappings and arena.driver.live_handles == 0


def test_a_refused_unmap_in_a_failed_shares_rollback_quarantines_the_granule(arena):
    """A share whose set-access is refused unmaps what it mapped; where that unmap is refused
    too, the granule is quarantined (still mapped: never zero-mapped over, unmapped by close),
    not left mapped behind the books."""
    src, dst = arena.allocate(2 * G), arena.allocate(2 * G)
    src.commit(G)
    arena.driver.inject_failure("set_access")
    arena.driver.inject_failure("unmap", after=1)  # the zero granule's unmap, then refused
    with pytest.raises(ArenaError, match="injected set_access failure"):
        arena.share(src, 0, dst, 0, G)
    assert arena.stats().quarantined_bytes == G
    del src, dst
    assert_close_leaves_nothing(arena)


def test_a_refused_unmap_of_the_copy_scratch_is_unmapped_at_close(arena, shared):
    src, dst = shared
    arena.driver.inject_failure("unmap")  # the scratch mapping's unmap, after the copy
    with pytest.raises(ArenaError, match="injected unmap failure"):
        arena.copy_on_write(dst, G, G)
    del src, dst
    assert_close_leaves_nothing(arena)


def test_close_releases_each_shared_handle_once(arena, shared):
    src, dst = shared
    del src, dst
    gc.collect()
    s = arena.stats()
    created = s.create_calls
    arena.close()
    s = arena.stats()
    assert s.release_calls == created and arena.driver.live_handles == 0


@pytest.mark.gpu
def test_cuda_granules_shared_between_two_views():
    """The same on the H200: cuMemMap of one handle at a second address, read through JAX."""
    import jax.numpy as jnp

    from jax_kv.memory import VmmArena

    arena = VmmArena(reserve_bytes=1 << 30)
    g = arena.granule
    src, dst = arena.allocate(2 * g), arena.allocate(2 * g)
    src.commit(2 * g)
    n = 2 * g // 4
    arena.write(src.ptr, np.arange(n, dtype=np.float32).tobytes())
    arena.share(src, 0, dst, 0, 2 * g)
    s = arena.stats()
    assert (s.committed_bytes, s.mapped_bytes, s.shared_mappings) == (2 * g, 4 * g, 2)
    view = dst.export((n,), jnp.float32)
    np.testing.assert_array_equal(np.asarray(view), np.arange(n, dtype=np.float32))
    del view
    gc.collect()
    src.decommit(0)
    arena.flush()
    view = dst.export((n,), jnp.float32)  # the other mapping keeps the memory
    np.testing.assert_array_equal(np.asarray(view), np.arange(n, dtype=np.float32))
    assert arena.stats().committed_bytes == 2 * g
    del view
    gc.collect()
    src.free()
    dst.free()
    arena.close()
    assert arena.stats().handles_live == 0
