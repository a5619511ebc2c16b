"""Physical granules kept without a mapping (VmmArena.hold), on the host driver: the prefix
store holds a finished request's handles instead of mapping them at addresses of its own.

A held handle outlives the range it was held from; map_held maps it into a slot, read-only;
copy_on_write gives the slot a copy of its own even where the held handle has no other
mapping; release_held frees it once nothing maps it; committed_bytes and physical_bytes count
it once; close() releases it. Every refusal leaves the books as they were, and none of this
costs a driver call but the maps themselves."""

import gc

import numpy as np
import pytest
from host_bytes import fill, read

from jax_kv.memory import ArenaError

G = 64 << 10  # the host granule of the shared `arena` fixture (conftest.py)


def books(arena):
    s = arena.stats()
    return (s.committed_bytes, s.mapped_bytes, s.held_bytes, s.shared_mappings, s.pooled_bytes)


def driver_calls(arena):
    s = arena.stats()
    return s.map_calls + s.unmap_calls + s.set_access_calls + s.create_calls + s.release_calls


@pytest.fixture
def held(arena):
    """src: 3 granules committed, filled with 5, 6, 7, held, then decommitted."""
    src = arena.allocate(3 * G)
    src.commit(3 * G)
    for k in range(3):
        fill(arena, src, k * G, G, 5 + k)
    calls = driver_calls(arena)
    handles = arena.hold(src, 0, 3 * G)
    assert driver_calls(arena) == calls  # a hold is bookkeeping only
    arena.decommit_now([(src, 0, 3 * G)])
    return src, handles


def test_a_held_granule_outlives_its_range_and_keeps_its_bytes(arena, held):
    src, handles = held
    assert len(handles) == 3
    # Unmapped, still physical memory: committed once, mapped nowhere, not pooled.
    assert books(arena) == (3 * G, 0, 3 * G, 0, 0)
    assert (read(arena, src, 0, 3 * G) == 0).all()  # the range reads the zero granule
    dst = arena.allocate(4 * G)
    arena.map_held(handles, dst, G)
    for k in range(3):
        assert (read(arena, dst, (k + 1) * G, G) == 5 + k).all()
    assert (read(arena, dst, 0, G) == 0).all()
    assert books(arena) == (3 * G, 3 * G, 3 * G, 0, 0)
    assert arena.stats().hold_calls == 3


def test_release_while_mapped_frees_nothing_and_the_last_unmap_frees_all(arena, held):
    _, handles = held
    dst = arena.allocate(3 * G)
    arena.map_held(handles, dst, 0)
    assert arena.release_held(handles) == 0  # the mapping keeps them
    assert books(arena) == (3 * G, 3 * G, 0, 0, 0)
    assert (read(arena, dst, 0, G) == 5).all()
    arena.decommit_now([(dst, 0, 3 * G)])
    assert arena.committed_bytes == 0
    assert arena.stats().pooled_bytes + arena.stats().release_calls * G >= 3 * G


def test_release_of_an_unmapped_held_granule_frees_it_without_a_driver_call(arena, held):
    _, handles = held

    def mapping_calls():
        s = arena.stats()
        return (s.map_calls, s.unmap_calls, s.set_access_calls)

    calls = mapping_calls()
    assert arena.release_held(handles[:2]) == 2 * G
    assert arena.committed_bytes == G and arena.stats().held_bytes == G
    assert mapping_calls() == calls  # pooled (or released): nothing to unmap
    assert arena.release_held(handles[2:]) == G
    assert arena.committed_bytes == 0 and arena.stats().held_bytes == 0


def test_two_holds_of_one_handle_need_two_releases(arena):
    src = arena.allocate(G)
    src.commit(G)
    first, second = arena.hold(src, 0, G), arena.hold(src, 0, G)
    arena.decommit_now([(src, 0, G)])
    assert arena.release_held(first) == 0
    assert arena.committed_bytes == G
    assert arena.release_held(second) == G
    assert arena.committed_bytes == 0


def test_refusals_change_nothing(arena, held):
    src, handles = held
    before = books(arena)
    other = arena.allocate(G)
    with pytest.raises(ArenaError, match="not committed"):
        arena.hold(other, 0, G)  # nothing committed there
    dst = arena.allocate(3 * G)
    dst.commit(G)
    with pytest.raises(ArenaError, match="already committed"):
        arena.map_held(handles, dst, 0)
    stranger = arena.allocate(G)
    stranger.commit(G)
    (mapped_only,) = (arena._state.mapped[stranger.offset // G],)
    with pytest.raises(ArenaError, match="handle 0 is not held"):
        arena.map_held([mapped_only], dst, G)
    with pytest.raises(ValueError, match="passes the region"):
        arena.map_held(handles, dst, 2 * G)
    assert books(arena)[2:] == before[2:]
    assert arena.committed_bytes == before[0] + 2 * G  # the two commits made here
    underflows = arena.stats().ref_underflows
    arena.release_held(handles)
    assert arena.stats().ref_underflows == underflows
    assert src.granules == 0


def test_copy_on_write_of_a_granule_whose_only_other_reference_is_a_hold(arena, held):
    """The slot's mapping is the held handle's only mapping: the copy goes through the
    arena's scratch address, and the held bytes stay as they were."""
    _, handles = held
    dst = arena.allocate(3 * G)
    arena.map_held(handles, dst, 0)
    copied = arena.copy_on_write(dst, 0, 2 * G)
    assert copied == 2
    assert arena.stats().cow_copies == 2
    fill(arena, dst, 0, G, 42)  # writable now, and its own
    assert (read(arena, dst, 0, G) == 42).all()
    assert (read(arena, dst, G, G) == 6).all()
    other = arena.allocate(3 * G)
    arena.map_held(handles, other, 0)
    assert [int(read(arena, other, k * G, G)[0]) for k in range(3)] == [5, 6, 7]
    # 3 held + 2 copies; dst maps 2 copies and 1 held, other maps 3 held.
    assert arena.committed_bytes == 5 * G
    assert arena.stats().shared_mappings == 1  # handles[2] is mapped twice


def test_a_failed_copy_leaves_the_shared_mapping_and_the_pool(arena, held):
    _, handles = held
    dst = arena.allocate(G)
    arena.map_held(handles[:1], dst, 0)
    before = books(arena)
    arena.driver.inject_failure("set_access")  # the scratch mapping's access
    with pytest.raises(ArenaError):
        arena.copy_on_write(dst, 0, G)
    assert (read(arena, dst, 0, G) == 5).all()
    assert books(arena)[:4] == before[:4]
    assert arena.stats().cow_copies == 0
    assert arena.copy_on_write(dst, 0, G) == 1  # the scratch address still works


def test_physical_bytes_counts_a_held_handle_for_its_holder_only(arena, held):
    src, handles = held
    ids = {id(h) for h in handles}
    assert arena.physical_bytes([src], ids) == 3 * G
    assert arena.physical_bytes([src]) == 0  # held by someone not asking
    dst = arena.allocate(2 * G)
    arena.map_held(handles[:2], dst, 0)
    assert arena.physical_bytes([dst]) == 2 * G
    assert arena.physical_bytes([dst], ids) == 3 * G  # mapped and held: once


@pytest.mark.parametrize("spare", [0, 64], ids=["by-other-regions", "by-mappings"])
def test_physical_bytes_agrees_on_both_of_its_paths(arena, held, spare):
    """physical_bytes counts from the other regions' side when they are smaller, from the
    mappings otherwise: `spare` committed granules in another region pick the path."""
    _, handles = held
    if spare:
        big = arena.allocate(spare * G)
        big.commit(spare * G)
    dst = arena.allocate(2 * G)
    arena.map_held(handles[1:], dst, 0)
    ids = {id(h) for h in handles}
    assert arena.physical_bytes([dst]) == 2 * G
    assert arena.physical_bytes([dst], ids) == 3 * G
    assert arena.physical_bytes([dst], {id(handles[0])}) == 3 * G


def test_recommit_puts_fresh_zeroed_granules_in_place_and_leaves_held_ones(arena, held):
    """recommit: a range whose granules are held elsewhere gets fresh zeroed ones in place,
    without the zero granule mapped between; the held bytes stay; a granule never committed
    in the range is committed too."""
    _, handles = held
    dst = arena.allocate(4 * G)
    arena.map_held(handles, dst, 0)
    before = arena.stats()
    report = arena.recommit([(dst, 0, 4 * G)])
    after = arena.stats()
    assert report.granules == 4
    assert after.zero_map_calls == before.zero_map_calls  # nothing mapped the zero granule
    assert after.unmap_calls - before.unmap_calls == 3 + 1  # the 3 held + the zero granule at 3
    assert (read(arena, dst, 0, 4 * G) == 0).all()
    fill(arena, dst, 0, G, 9)
    other = arena.allocate(3 * G)
    arena.map_held(handles, other, 0)
    assert [int(read(arena, other, k * G, G)[0]) for k in range(3)] == [5, 6, 7]
    assert arena.committed_bytes == 7 * G  # 3 held + 4 fresh


def test_a_refused_recommit_leaves_the_range_decommitted(arena, held):
    _, handles = held
    dst = arena.allocate(3 * G)
    arena.map_held(handles, dst, 0)
    arena.driver.inject_failure("map")
    with pytest.raises(ArenaError):
        arena.recommit([(dst, 0, 3 * G)])
    assert dst.granules == 0
    assert (read(arena, dst, 0, 3 * G) == 0).all()  # the zero granule, not unbacked
    assert arena.stats().held_bytes == 3 * G and arena.committed_bytes == 3 * G
    with pytest.raises(ArenaError, match="granule-aligned"):
        arena.recommit([(dst, 1, G)])


def test_close_releases_held_handles(arena, held):
    created = arena.stats().create_calls
    arena.close()
    s = arena.stats()
    assert s.release_calls == created and arena.driver.live_handles == 0
    assert arena.release_held(held[1]) == 0  # after close: nothing left to give back
    gc.collect()


@pytest.mark.gpu
def test_cuda_held_granules_outlive_their_range_and_copy_on_write():
    """The same on CUDA: a held handle, unmapped from its range, mapped into another with
    cuMemMap and read through JAX; copy_on_write through the scratch address gives the slot a
    copy of its own while the held bytes stay."""
    import jax.numpy as jnp

    from jax_kv.memory import VmmArena

    arena = VmmArena(reserve_bytes=1 << 30)
    g = arena.granule
    n = 2 * g // 4
    values = np.arange(n, dtype=np.float32)
    src, dst, other = arena.allocate(2 * g), arena.allocate(2 * g), arena.allocate(2 * g)
    src.commit(2 * g)
    arena.write(src.ptr, values.tobytes())
    handles = arena.hold(src, 0, 2 * g)
    src.decommit(0)
    arena.flush()
    assert arena.stats().held_bytes == 2 * g and arena.committed_bytes == 2 * g
    arena.map_held(handles, dst, 0)
    view = dst.export((n,), jnp.float32)
    np.testing.assert_array_equal(np.asarray(view), values)
    del view
    gc.collect()
    assert arena.copy_on_write(dst, 0, 2 * g) == 2
    arena.write(dst.ptr, np.zeros(n, np.float32).tobytes())  # the copy is dst's own
    arena.map_held(handles, other, 0)
    view = other.export((n,), jnp.float32)
    np.testing.assert_array_equal(np.asarray(view), values)
    del view
    gc.collect()
    for region in (src, dst, other):
        region.free()
    assert arena.release_held(handles) == 2 * g
    arena.close()
    assert arena.stats().handles_live == 0
