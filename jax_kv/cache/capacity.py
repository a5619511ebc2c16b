"""Capacity planning: the hard max (caller, model metadata, unbounded), the VMM reservation,
and the power-of-two buckets the shape-changing growth paths (and the loop's prompt padding)
grow by."""

from __future__ import annotations

import dataclasses

INT32_MAX = 2**31 - 1


class CapacityError(ValueError):
    """A capacity above the hard max (or one no reservation can hold)."""


def bucket_for(n: int, min_bucket: int = 256, hard_max: int | None = None) -> int:
    """Smallest power of two >= n, at least `min_bucket`, clamped to `hard_max`."""
    if n < 0:
        raise ValueError(f"n: expected >= 0 tokens, got {n}")
    if min_bucket < 1 or min_bucket & (min_bucket - 1):
        raise ValueError(f"min_bucket: expected a power of two >= 1, got {min_bucket}")
    bucket = max(min_bucket, 1 << max(0, int(n) - 1).bit_length())
    return bucket if hard_max is None else min(bucket, hard_max)


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """hard_max: the most tokens the cache may ever hold (None: unbounded).
    source: "caller", "model metadata" or "unbounded".
    reservation_tokens: tokens the VMM reservation covers (None without VMM)."""

    hard_max: int | None
    source: str
    reservation_tokens: int | None


def resolve_capacity(
    max_len: int | None = None,
    model_max_len: int | None = None,
    *,
    bytes_per_token: int | None = None,
    device_free: int | None = None,
    arena_free: int | None = None,
) -> CapacityPlan:
    """The caller's cap, else model metadata (max_position_embeddings), else unbounded.

    With `bytes_per_token` (the VMM case: bytes of one position across every layer, K and V
    and the batch) the reservation is sized too: at the hard max, or for an unbounded cache at
    min(device_free, arena_free) // bytes_per_token, the largest length the device could ever
    hold, capped to the arena's free address space (the seed's open caveat) and to int32.
    """
    for name, value in (("max_len", max_len), ("model_max_len", model_max_len)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise CapacityError(f"{name}: expected an int >= 1 or None, got {value!r}")
    if max_len is not None:
        hard, source = int(max_len), "caller"
    elif model_max_len is not None:
        hard, source = int(model_max_len), "model metadata"
    else:
        hard, source = None, "unbounded"
    if hard is not None and hard > INT32_MAX:
        raise CapacityError(f"{source} capacity {hard} exceeds the int32 limit {INT32_MAX}")
    if bytes_per_token is None:
        return CapacityPlan(hard, source, None)
    if bytes_per_token < 1 or arena_free is None:
        raise ValueError("resolve_capacity: VMM needs bytes_per_token >= 1 and arena_free")
    if hard is not None:
        if hard * bytes_per_token > arena_free:
            raise CapacityError(
                f"{source} capacity {hard} tokens needs {hard * bytes_per_token} bytes of "
                f"address space; the arena has {arena_free} free"
            )
        return CapacityPlan(hard, source, hard)
    budget = arena_free if device_free is None else min(device_free, arena_free)
    tokens = min(budget // bytes_per_token, INT32_MAX)
    if tokens < 1:
        raise CapacityError(
            f"unbounded capacity: one token needs {bytes_per_token} bytes, only {budget} "
            f"available (device free {device_free}, arena free {arena_free})"
        )
    return CapacityPlan(None, source, tokens)


__all__ = ["INT32_MAX", "CapacityError", "CapacityPlan", "bucket_for", "resolve_capacity"]
