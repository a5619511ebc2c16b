"""The cache's three growth strategies are chosen once, at construction, from the arena and
the layout (issue 20, item 4); GrowthEvent is keyword-only and its reasons live in one enum."""

import dataclasses

import jax.numpy as jnp
import pytest

from jax_kv import Layout
from jax_kv.cache import (
    REASON_SEQ_VMM,
    EagerGrowth,
    GrowthEvent,
    GrowthReason,
    HeadMajorVmmGrowth,
    KvCache,
    SeqMajorVmmGrowth,
)
from jax_kv.memory import EagerArena, host_arena


@pytest.mark.parametrize(
    "arena, layout, strategy",
    [
        ("host", Layout.SEQ_MAJOR, SeqMajorVmmGrowth),
        ("host", Layout.HEAD_MAJOR, HeadMajorVmmGrowth),
        ("eager", Layout.SEQ_MAJOR, EagerGrowth),
        ("eager", Layout.HEAD_MAJOR, EagerGrowth),
    ],
)
def test_strategy_follows_arena_and_layout(arena, layout, strategy):
    a = host_arena(granule=1 << 16) if arena == "host" else EagerArena()
    cache = KvCache(
        num_layers=1, batch=2, num_kv_heads=2, head_dim=64, dtype=jnp.float32, layout=layout,
        arena=a, max_len=1024, min_bucket=16,
    )  # fmt: skip
    assert type(cache.growth) is strategy
    event = cache.ensure_capacity(40)
    want = {
        SeqMajorVmmGrowth: GrowthReason.SEQ_VMM,
        HeadMajorVmmGrowth: GrowthReason.HEAD_VMM,
        EagerGrowth: GrowthReason.EAGER,
    }[strategy]
    assert event.reason == want and f"{event.reason}" == want.value
    assert event.keeps_compiled_step == (strategy is SeqMajorVmmGrowth)
    cache.close()


def test_growth_event_is_keyword_only():
    with pytest.raises(TypeError):
        GrowthEvent(1, 2, 0, 0, False, False, True, REASON_SEQ_VMM)  # type: ignore[misc]
    e = GrowthEvent(
        old_capacity=1, new_capacity=2, bytes_moved=0, granules_committed=0,
        shape_changed=False, pointer_changed=False, keeps_compiled_step=True,
        reason=REASON_SEQ_VMM,
    )  # fmt: skip
    assert e.grew and dataclasses.replace(e, seconds=1.0).seconds == 1.0
    assert REASON_SEQ_VMM == "seq-major VMM commit: pointers and shapes unchanged"
