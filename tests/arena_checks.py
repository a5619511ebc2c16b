"""The arenas' must-be-zero fault counters, checked after every test by conftest.py, and a
closed arena's emptiness."""

import gc

from jax_kv.memory.arena import live_arenas


def assert_no_arena_faults() -> None:
    """Every VmmArena still referenced in this process, open or closed, has its
    FAULT_COUNTERS at zero."""
    for arena in live_arenas():
        faults = arena.stats().faults
        assert not any(faults.values()), (
            f"an arena's must-be-zero counters moved: {faults} (closed={arena.closed})"
        )


def close_and_check(arena) -> None:
    """Closes `arena` (once XLA dropped the views it still held) and asserts it gave back
    every handle and byte and no fault counter moved."""
    gc.collect()
    if not arena.closed:
        arena.close()
    s = arena.stats()
    assert s.handles_live == 0 and s.committed_bytes == 0, s
    assert not any(s.faults.values()), s
