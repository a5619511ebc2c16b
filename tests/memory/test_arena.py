"""VmmArena bookkeeping on the host driver (same contract as the CUDA driver): accounting,
one set-access call per contiguous range, the view rules, deferred decommit, exhaustion with
rollback, teardown. And: importing jax_kv.memory never imports CUDA."""

import gc
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv.memory import (
    ArenaError,
    ArenaExhausted,
    EagerArena,
    HostDriver,
    VmmArena,
    host_arena,
    reservation_ladder,
)

GiB = 1 << 30

G = 64 << 10  # the host granule of the shared `arena` fixture (conftest.py)


def test_import_does_not_load_cuda():
    code = "import sys, jax_kv.memory, jax_kv.cache; print('cuda.bindings' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_reservation_ladder_h200():
    total = 143771 << 20  # H200, as nvidia-smi reports it
    sizes = reservation_ladder(total, 2 << 20)
    assert sizes[0] == 16 * total // (2 << 20) * (2 << 20)
    assert sizes[-1] == 64 * GiB
    assert all(a > b for a, b in zip(sizes, sizes[1:], strict=False))


def test_ladder_reports_size_that_succeeded():
    driver = HostDriver(granule=G, total_memory=8 * GiB, max_reserve_bytes=100 * GiB)
    a = VmmArena(driver=driver, pool_bytes=0)
    assert a.stats().reservation_ladder == (128 * GiB, 64 * GiB)
    assert a.reserved_bytes == 64 * GiB
    a.close()


def test_ladder_exhausted_raises_and_releases():
    driver = HostDriver(granule=G, total_memory=8 * GiB, max_reserve_bytes=10 * GiB)
    with pytest.raises(ArenaExhausted, match="every reservation size failed"):
        VmmArena(driver=driver, pool_bytes=0)


def test_commit_accounting_one_access_call_per_contiguous_range(arena):
    r = arena.allocate(10 * G)
    rep = r.commit_ranges([(0, 2 * G), (2 * G, 3 * G + 1), (6 * G, 7 * G)])
    assert (rep.granules, rep.map_calls, rep.set_access_calls) == (5, 5, 2)
    assert r.committed_bytes == arena.committed_bytes == 5 * G
    again = r.commit(3 * G)  # already mapped: nothing to do
    assert again.granules == 0
    s = arena.stats()
    assert (s.map_calls, s.set_access_calls, s.create_calls) == (5, 2, 5 + 1)  # + the zero granule
    assert s.reserved_bytes == 256 << 20 and s.commit_seconds > 0


def test_pool_is_used_before_the_driver(arena):
    arena.prefill(4 * G)  # the zero granule was created with the arena: 1 + 4 handles
    assert arena.stats().pooled_bytes == 4 * G and arena.stats().create_calls == 1 + 4
    arena.allocate(4 * G).commit(4 * G)
    s = arena.stats()
    assert s.create_calls == 1 + 4 and s.pooled_bytes == 0 and s.committed_bytes == 4 * G


def test_export_is_zero_copy_and_aligned(arena):
    r = arena.allocate(4 * G)
    r.commit(4 * G)
    view = np.frombuffer(arena.driver.host_view(r.ptr, 4 * 64 * 4), np.float32)
    view[:] = np.arange(256)
    x = r.export((4, 64), jnp.float32)
    assert x.unsafe_buffer_pointer() == r.ptr and r.ptr % 256 == 0
    np.testing.assert_array_equal(np.asarray(x).ravel(), np.arange(256, dtype=np.float32))
    assert arena.live_views == 1


def test_second_live_view_of_same_bytes_refused(arena):
    r = arena.allocate(4 * G)
    r.commit(4 * G)
    x = r.export((1024,), jnp.float32)
    with pytest.raises(ArenaError, match="never two live views"):
        r.export((8,), jnp.float32, offset=256)
    y = r.export((8,), jnp.float32, offset=4096)  # disjoint bytes: fine
    assert arena.live_views == 2
    del x, y


def test_deleter_releases_view_when_xla_drops_the_last_array(arena):
    r = arena.allocate(G)
    r.commit(G)
    x = r.export((16,), jnp.float32)
    y = x  # another Python reference to the same buffer
    del x
    gc.collect()
    assert arena.live_views == 1
    del y
    arena.wait_unviewed([r])
    s = arena.stats()
    assert (s.views_exported, s.views_released, s.live_views) == (1, 1, 0)
    z = r.export((16,), jnp.float32)  # the bytes are free to view again
    z.delete()
    arena.wait_unviewed([r])


def test_free_and_close_refused_under_a_live_view(arena):
    r = arena.allocate(G)
    r.commit(G)
    x = r.export((16,), jnp.float32)
    with pytest.raises(ArenaError, match="live view"):
        r.free()
    with pytest.raises(ArenaError, match="still live"):
        arena.close()
    x.delete()
    arena.wait_unviewed([r])
    r.free()
    arena.close()


def test_decommit_is_deferred_and_skips_viewed_granules(arena):
    r = arena.allocate(8 * G)
    r.commit(8 * G)
    x = r.export((G // 4,), jnp.float32, offset=6 * G)  # a view over granule 6
    assert r.decommit(2 * G) == 6 * G  # queued, not yet unmapped
    assert arena.committed_bytes == 8 * G
    assert arena.stats().pending_decommit_bytes == 6 * G
    assert arena.flush() == 5 * G  # granule 6 stays: a live view covers it
    assert arena.committed_bytes == 3 * G
    x.delete()
    arena.wait_unviewed([r])
    assert arena.flush() == G
    assert arena.committed_bytes == 2 * G


def test_commit_cancels_a_pending_decommit(arena):
    r = arena.allocate(4 * G)
    r.commit(4 * G)
    r.decommit(0)
    rep = r.commit(4 * G)
    assert rep.granules == 0 and arena.stats().pending_decommit_bytes == 0


def test_exhaustion_is_all_or_nothing_with_bytes_in_the_message():
    a = VmmArena(
        driver=HostDriver(granule=G, total_memory=GiB, limit_bytes=(1 + 6) * G),  # + zero
        reserve_bytes=64 << 20,
        pool_bytes=0,
    )
    r1, r2 = a.allocate(4 * G), a.allocate(4 * G)
    r1.commit(4 * G)
    before = a.stats()
    with pytest.raises(ArenaExhausted) as e:
        a.commit([(r1, 0, 4 * G), (r2, 0, 4 * G)])  # needs 4 more, 2 available
    msg = str(e.value)
    assert f"requested {4 * G} bytes" in msg and f"committed {4 * G} bytes" in msg
    assert f"available {2 * G} bytes" in msg
    after = a.stats()
    assert after.committed_bytes == before.committed_bytes == 4 * G
    assert r2.committed_bytes == 0
    r2.commit(2 * G)  # still usable for what fits
    a.close()
    assert a.driver._live_handles == set()


def test_a_region_past_the_drivers_mapping_limit_is_refused_naming_it():
    """The CUDA driver refuses mappings past ~524,000 per process (bench/experiments/
    zero_map_cost.py on an H100): a region maps the zero granule at each granule, so a
    reservation of slots x max_len can pass it. The refusal names the mappings held and what to
    reserve instead, and leaves the arena as it was (no zero mapping of the region left)."""
    a = host_arena(reserve_bytes=64 << 20, granule=G)
    first = a.allocate(4 * G)
    before = a.stats()
    real_map, maps = a.driver.map, [0]

    def map_refusing_past_6(va, handle):
        maps[0] += 1
        if maps[0] > 6:
            raise ArenaExhausted("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")
        return real_map(va, handle)

    a.driver.map = map_refusing_past_6
    with pytest.raises(ArenaExhausted) as e:
        a.allocate(8 * G)  # the 7th zero mapping is refused
    msg = str(e.value)
    held = before.zero_mapped_bytes // G + 6
    assert f"held {held} mappings when the driver refused one" in msg, msg
    assert "its 8 granules" in msg and "fewer slots or a shorter max_len" in msg, msg
    assert a.stats().zero_mapped_bytes == before.zero_mapped_bytes
    a.driver.map = real_map
    second = a.allocate(8 * G)  # the address space it did not take is still there
    second.commit(G)
    assert a.committed_bytes == G
    del first, second
    a.close()


def test_arena_limit_bytes():
    a = host_arena(reserve_bytes=64 << 20, granule=G, limit_bytes=None)
    a.limit_bytes = 3 * G
    r = a.allocate(4 * G)
    with pytest.raises(ArenaExhausted, match="requested"):
        r.commit(4 * G)
    assert a.committed_bytes == 0 and a.stats().pooled_bytes == 3 * G  # handles kept, pooled
    a.close()


def test_teardown_releases_everything(arena):
    regions = [arena.allocate(3 * G) for _ in range(3)]
    for r in regions:
        r.commit(3 * G)
    arena.prefill(2 * G)
    regions[0].decommit(G)
    arena.close()
    s = arena.stats()
    assert s.committed_bytes == 0 and s.pooled_bytes == 0
    assert arena.driver._live_handles == set()
    arena.close()  # idempotent
    with pytest.raises(ArenaError, match="closed"):
        arena.allocate(G)


def test_allocate_checks_alignment(arena):
    with pytest.raises(ValueError, match="align"):
        arena.allocate(G, align=128)
    r = arena.allocate(100, align=4096)
    assert r.ptr % G == 0 and r.reserved_bytes == G


def test_eager_arena_limit():
    a = EagerArena(limit_bytes=1024)
    x = a.zeros((64,), jnp.float32)
    assert a.committed_bytes == 256
    with pytest.raises(ArenaExhausted, match="requested 1024 bytes, committed 256 bytes"):
        a.zeros((256,), jnp.float32)
    a.release(x)
    assert a.committed_bytes == 0
