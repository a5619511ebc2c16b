"""The arena fails closed (issue 19, item 8), driven by the host driver's injected failures: a
granule whose unmap fails is quarantined and never handed out again, a commit's rollback never
pools a still-mapped handle, the must-be-zero counters stay zero on every normal path, and
close() leaves 0 committed bytes and every handle released (counted on both sides)."""

import pytest

from jax_kv.memory import ArenaError

G = 64 << 10  # the host granule of the shared `arena` fixture (conftest.py)


def zero_faults(arena):
    return not any(arena.stats().faults.values())


def held_handles(arena):
    """Handles the arena can account for: committed, pooled, quarantined, the zero ones."""
    s = arena.stats()
    return (s.committed_bytes + s.pooled_bytes + s.quarantined_bytes) // G + s.zero_handles


def test_unmap_failure_quarantines_the_granule(arena):
    r = arena.allocate(4 * G)
    r.commit(4 * G)
    arena.pool_target = 8 * G
    arena.driver.inject_failure("unmap")
    r.decommit(2 * G)  # granules 2 and 3: the first unmap fails
    arena.flush()
    s = arena.stats()
    assert s.quarantined_bytes == G and s.committed_bytes == 2 * G
    assert s.pooled_bytes == G, "only the granule that unmapped cleanly is pooled"
    assert s.handles_live == held_handles(arena) == arena.driver.live_handles
    with pytest.raises(ArenaError, match=r"granule \d+ is quarantined"):
        r.commit(4 * G)
    assert arena.stats().committed_bytes == 2 * G  # the refusal changed nothing
    assert zero_faults(arena)
    r.free()
    assert arena.stats().regions == 0
    arena.close()
    s = arena.stats()
    assert s.committed_bytes == 0 and s.handles_live == 0 and arena.driver.live_handles == 0


def test_rollback_never_pools_a_still_mapped_handle(arena):
    r = arena.allocate(4 * G)
    arena.driver.inject_failure("set_access")  # after the maps: the commit rolls back
    # The commit unmaps 4 zero mappings first; the first rollback unmap after them fails.
    arena.driver.inject_failure("unmap", after=4)
    with pytest.raises(ArenaError, match="commit refused"):
        r.commit(4 * G)
    s = arena.stats()
    assert s.committed_bytes == 0 and s.quarantined_bytes == G
    assert s.pooled_bytes == 3 * G, "the handle still mapped must not be in the pool"
    assert s.handles_live == held_handles(arena) == arena.driver.live_handles
    # The granules that rolled back read as zeros again (zero-mapped), none is unbacked.
    assert zero_faults(arena)
    arena.close()
    assert arena.stats().handles_live == 0 and arena.driver.live_handles == 0


def test_failed_zero_mapping_at_allocate_returns_the_address_space(arena):
    free = arena.free_va_bytes
    arena.driver.inject_failure("map", times=1)
    with pytest.raises(ArenaError, match="injected map failure"):
        arena.allocate(8 * G)
    assert arena.free_va_bytes == free and arena.stats().regions == 0
    assert arena.stats().zero_mapped_bytes == G  # only the zero granule's own mapping
    r = arena.allocate(8 * G)  # the same range works next time
    r.commit(8 * G)
    assert zero_faults(arena)


def test_release_failure_keeps_the_handle_counted(arena):
    r = arena.allocate(2 * G)
    r.commit(2 * G)
    arena.pool_target = 0
    arena.driver.inject_failure("release")
    r.decommit(0)
    arena.flush()
    s = arena.stats()
    assert s.committed_bytes == 0 and s.quarantined_bytes == G
    assert s.handles_live == held_handles(arena) == arena.driver.live_handles
    arena.close()
    assert arena.stats().handles_live == 0 and arena.driver.live_handles == 0


def test_counters_zero_through_many_cycles(arena):
    """Commit/decommit/free cycles: no handle, committed byte or fault counter drifts."""
    arena.pool_target = 2 * G
    for i in range(50):
        r = arena.allocate((i % 5 + 1) * G)
        r.commit(min(i % 3 + 1, i % 5 + 1) * G)
        r.decommit(G)
        if i % 2:
            arena.flush()
        r.free()
        assert zero_faults(arena)
        s = arena.stats()
        assert s.committed_bytes == 0 and s.regions == 0
        assert s.handles_live == held_handles(arena) == arena.driver.live_handles
    arena.close()
    assert arena.stats().handles_live == 0 and arena.driver.live_handles == 0


def test_every_test_checks_the_live_arenas_fault_counters(arena):
    """conftest's autouse check fails a test after which any live arena's must-be-zero counter
    moved (and the counters a stats() reports are the ones FAULT_COUNTERS names)."""
    from arena_checks import assert_no_arena_faults

    from jax_kv.memory.arena import FAULT_COUNTERS, live_arenas

    assert arena in live_arenas()
    assert set(arena.stats().faults) == set(FAULT_COUNTERS)
    assert_no_arena_faults()
    arena._counts["ref_underflows"] += 1
    try:
        with pytest.raises(AssertionError, match="ref_underflows"):
            assert_no_arena_faults()
    finally:
        arena._counts["ref_underflows"] -= 1
