"""Review of c97e653 (seq-major VMM commits each row its own tokens): defects it left, shown on
the host-memory VmmArena. Each test here fails on c97e653."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv import Layout
from jax_kv.cache import REASON_SEQ_VMM, CapacityError, KvCache
from jax_kv.memory import ArenaExhausted, host_arena

L, Hkv, D = 2, 2, 64
G = 64 << 10
TOK = Hkv * D * 4  # float32: bytes of one token of one binding
STEP = G // TOK  # 128 tokens: one granule per commit step


def make_cache(arena, **kw) -> KvCache:
    return KvCache(
        num_layers=L, batch=4, num_kv_heads=Hkv, head_dim=D, dtype=jnp.float32,
        layout=Layout.SEQ_MAJOR, arena=arena, max_len=4096, min_bucket=STEP, **kw,
    )  # fmt: skip


@pytest.fixture
def arena():
    a = host_arena(reserve_bytes=256 << 20, granule=G)
    yield a
    a.limit_bytes = None
    a.close()


def test_a_per_row_growth_that_commits_granules_reports_grew(arena):
    """growth.py:332-333 keeps old/new_capacity as the longest row's, so a growth of a short
    row (granules mapped, counted in growth_events) is an event whose `grew` is False
    (events.py: grew = new_capacity != old_capacity): `if e.grew` loops miss it."""
    cache = make_cache(arena, initial_tokens=np.array([1000, 5, 0, 129]))
    try:
        events0 = cache.growth_events
        e = cache.ensure_capacity([1000, 300, 1, 129])  # row 1: 128 -> 384 tokens
        assert cache.committed_tokens().tolist() == [1024, 384, 128, 256]
        assert e.reason == REASON_SEQ_VMM and e.granules_committed > 0
        assert cache.growth_events == events0 + 1
        assert e.grew, (
            f"a growth that committed {e.granules_committed} granules says grew=False "
            f"({e.old_capacity} -> {e.new_capacity})"
        )
    finally:
        cache.close()


def test_capacity_error_for_a_per_row_need_states_that_needs_bytes(arena):
    """kv_cache.py:145/294/333: _check_hard_max(top) prices the refusal as `top` tokens for
    every row (B * top), not the per-row need the call asked for (the ArenaExhausted path prices the
    per-row need through _needed_bytes(need))."""
    cache = make_cache(arena)
    try:
        need = [5000, 1, 1, 1]
        with pytest.raises(CapacityError) as e:
            cache.ensure_capacity(need)
        want = 2 * L * sum(need) * TOK  # 10,246,144 bytes
        wrong = 2 * L * 4 * max(need) * TOK  # 40,960,000 bytes
        assert f"requested {wrong} bytes" not in str(e.value), str(e.value)
        assert f"requested {want} bytes" in str(e.value), str(e.value)
    finally:
        cache.close()


def test_refused_per_row_growth_never_reports_negative_bytes(arena):
    """_need accepts negative per-row needs; _needed_bytes sums them, so the refusal's
    'requested' is negative (growth.py:253 via kv_cache.py:312-324)."""
    cache = make_cache(arena, initial_tokens=np.array([1000, 5, 0, 129]))
    try:
        committed = arena.committed_bytes
        arena.limit_bytes = committed  # no granule more
        with pytest.raises((ValueError, ArenaExhausted)) as e:
            cache.ensure_capacity([-(10**6), 0, 1024, 0])
        arena.limit_bytes = None
        assert cache.committed_tokens().tolist() == [1024, 128, 128, 256]
        assert "requested -" not in str(e.value), str(e.value)
    finally:
        arena.limit_bytes = None
        cache.close()
