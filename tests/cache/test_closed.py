"""A closed KvCache refuses every call by name, closing twice is harmless, a close that fails
(a view still referenced) can be retried (a SlotCache's too), and the Generator never lets a
failed close hide the error that stopped it (issue 19, item 6)."""

import jax.numpy as jnp
import pytest

import jax_kv.models as jm
from jax_kv.cache import CacheClosedError, KvCache, SlotCache
from jax_kv.decode import Generator
from jax_kv.memory import ArenaError, host_arena


def make(arena=None):
    return KvCache(
        num_layers=1, batch=2, num_kv_heads=2, head_dim=64, dtype=jnp.float32,
        arena=arena, max_len=1024, min_bucket=16,
    )  # fmt: skip


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.ensure_capacity(40),
        lambda c: c.advance(1),
        lambda c: c.accept([], []),
        lambda c: c.committed_tokens(),
        lambda c: c.pointers(),
    ],
    ids=["ensure_capacity", "advance", "accept", "committed_tokens", "pointers"],
)
@pytest.mark.parametrize("arena", ["eager", "host"])
def test_a_closed_cache_refuses_every_call(call, arena):
    cache = make(host_arena(granule=1 << 16) if arena == "host" else None)
    cache.close()
    with pytest.raises(CacheClosedError, match=r"^\w+: this KvCache is closed"):
        call(cache)
    cache.close()  # again: nothing to do
    assert cache.stats()["committed_bytes"] == 0


def make_slots(arena):
    return SlotCache(
        num_layers=1, num_slots=2, num_kv_heads=2, head_dim=64, dtype=jnp.float32,
        max_len=1024, arena=arena,
    )  # fmt: skip


@pytest.mark.parametrize("build", [make, make_slots], ids=["KvCache", "SlotCache"])
def test_a_failed_close_can_be_retried(build):
    """A close the arena refuses (a view of the cache still referenced somewhere, as a
    donation chain can leave one) leaves the cache open, so close() can be called again (a
    SlotCache's retry was a no-op: it set `closed` before the wait, and kept its regions)."""
    arena = host_arena(granule=1 << 16)
    cache = build(arena)
    real = arena.wait_unviewed
    calls = []

    def refuse_once(regions, timeout=5.0):
        calls.append(1)
        if len(calls) == 1:
            raise ArenaError("1 view(s) still live after 5.0 s")
        real(regions, timeout)

    arena.wait_unviewed = refuse_once
    with pytest.raises(ArenaError, match="still live"):
        cache.close()
    assert not cache.closed
    cache.close()
    assert cache.closed and arena.stats().committed_bytes == 0 and len(calls) == 2
    s = arena.stats()
    assert (s.unaccounted_committed_bytes, s.unbacked_bytes, s.regions) == (0, 0, 0)


def test_generator_reports_the_cause_not_the_close(monkeypatch):
    model = jm.random_model("tiny-llama", seed=0)
    gen = Generator(model, min_bucket=8)

    def boom(*a, **k):
        raise RuntimeError("the prefill ran out of memory")

    def failing_close(self):
        raise ArenaError("2 view(s) still live after 5.0 s")

    monkeypatch.setattr(Generator, "_run", boom)
    monkeypatch.setattr(KvCache, "close", failing_close)
    with pytest.raises(RuntimeError, match="the prefill ran out of memory") as e:
        gen.generate([[1, 2, 3]], 4)
    assert any("closing the KvCache failed: 2 view(s) still live" in n for n in e.value.__notes__)
