"""Bucket policy and capacity resolution (pure functions)."""

import pytest

from jax_kv.cache import INT32_MAX, CapacityError, CapacityPlan, bucket_for, resolve_capacity


@pytest.mark.parametrize(
    "n, floor, hard, expected",
    [
        (0, 256, None, 256),
        (1, 256, None, 256),
        (256, 256, None, 256),
        (257, 256, None, 512),
        (4097, 256, None, 8192),
        (5, 1, None, 8),
        (300, 16, 400, 400),
        (3, 16, 400, 16),
    ],
)
def test_bucket_for(n, floor, hard, expected):
    assert bucket_for(n, floor, hard) == expected


def test_bucket_floor_must_be_power_of_two():
    with pytest.raises(ValueError, match="min_bucket"):
        bucket_for(10, 100)


def test_caller_then_metadata_then_unbounded():
    assert resolve_capacity(1024, 4096) == CapacityPlan(1024, "caller", None)
    assert resolve_capacity(None, 4096) == CapacityPlan(4096, "model metadata", None)
    assert resolve_capacity(None, None) == CapacityPlan(None, "unbounded", None)


def test_vmm_unbounded_is_bounded_by_device_and_arena():
    bpt = 128 << 10  # Llama-3-8B, B=1: 32 layers x K,V x 8 heads x 128 x bf16
    plan = resolve_capacity(bytes_per_token=bpt, device_free=80 << 30, arena_free=2 << 40)
    assert plan.hard_max is None and plan.reservation_tokens == (80 << 30) // bpt
    # The seed's open caveat: a huge idle device must not overrun the arena.
    plan = resolve_capacity(bytes_per_token=bpt, device_free=200 << 30, arena_free=64 << 30)
    assert plan.reservation_tokens == (64 << 30) // bpt


def test_vmm_unbounded_never_overflows_int32():
    plan = resolve_capacity(bytes_per_token=1, device_free=1 << 62, arena_free=1 << 62)
    assert plan.reservation_tokens == INT32_MAX


def test_vmm_hard_max_must_fit_the_arena():
    assert resolve_capacity(4096, bytes_per_token=8, arena_free=1 << 20).reservation_tokens == 4096
    with pytest.raises(CapacityError, match="needs 8388608 bytes of address space"):
        resolve_capacity(1 << 20, bytes_per_token=8, arena_free=1 << 20)


def test_vmm_no_room_for_one_token():
    with pytest.raises(CapacityError, match="one token needs"):
        resolve_capacity(bytes_per_token=1 << 20, device_free=10, arena_free=1 << 30)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_caps(bad):
    with pytest.raises(CapacityError, match="max_len"):
        resolve_capacity(bad)
    with pytest.raises(CapacityError):
        resolve_capacity(INT32_MAX + 1)
