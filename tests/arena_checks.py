"""The arenas' must-be-zero fault counters, checked after every test by conftest.py."""

from jax_kv.memory.arena import live_arenas


def assert_no_arena_faults() -> None:
    """Every VmmArena still referenced in this process, open or closed, has its
    FAULT_COUNTERS at zero."""
    for arena in live_arenas():
        faults = arena.stats().faults
        assert not any(faults.values()), (
            f"an arena's must-be-zero counters moved: {faults} (closed={arena.closed})"
        )
