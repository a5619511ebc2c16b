"""EagerArena: ordinary XLA buffers (CPU, or CUDA without VMM). Growth is a new buffer plus a
copy of the live prefix (`jax_kv.grow_cache`), for both layouts; every growth changes shapes
and pointers, so the compiled step is invalidated."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_kv.memory._drivers import ArenaExhausted


@dataclasses.dataclass(frozen=True)
class EagerStats:
    committed_bytes: int  # bytes of the buffers this arena handed out and still tracks
    allocations: int
    allocated_bytes: int  # cumulative


class EagerArena:
    """Plain XLA buffers on `device`, with an optional byte limit (to test exhaustion).

    The arena tracks the bytes of the buffers it allocated that are still alive by its
    reckoning (`release` them when replaced); XLA owns the memory.
    """

    kind = "eager"

    def __init__(self, device: Any = None, *, limit_bytes: int | None = None) -> None:
        self.device = jax.devices()[0] if device is None else device
        self.limit_bytes = limit_bytes
        self._committed = 0
        self._allocations = 0
        self._allocated = 0

    @property
    def committed_bytes(self) -> int:
        return self._committed

    def available_bytes(self) -> int:
        stats = None
        try:
            stats = self.device.memory_stats()
        except Exception:  # noqa: BLE001 - CPU devices may not report
            stats = None
        device_free = None
        if stats and "bytes_limit" in stats:
            device_free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        limit_free = None if self.limit_bytes is None else self.limit_bytes - self._committed
        options = [x for x in (device_free, limit_free) if x is not None]
        return max(0, min(options)) if options else 2**63 - 1

    def reserve(self, nbytes: int) -> None:
        """Refuses with ArenaExhausted when `nbytes` more would pass the limit."""
        if self.limit_bytes is not None and self._committed + nbytes > self.limit_bytes:
            raise ArenaExhausted(
                f"EagerArena: requested {nbytes} bytes, committed {self._committed} bytes, "
                f"available {max(0, self.limit_bytes - self._committed)} bytes "
                f"(limit {self.limit_bytes})"
            )

    def zeros(self, shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.Array:
        """Zeros of `shape` on the arena's device, or laid out as `sharding` (a
        jax.sharding.Sharding: each device makes only its own shard)."""
        nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
        self.reserve(nbytes)
        try:
            if sharding is not None:
                array = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
            else:
                # Committed to the device, as a compiled step's outputs are: an uncommitted
                # array fed to a step the first time, its output the next, would be two jit
                # signatures of one step (two compiles).
                with jax.default_device(self.device):
                    array = jax.device_put(jnp.zeros(shape, dtype), self.device)
        except Exception as e:  # XLA's RESOURCE_EXHAUSTED
            if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
                raise ArenaExhausted(
                    f"EagerArena: requested {nbytes} bytes, committed {self._committed} "
                    f"bytes, available {self.available_bytes()} bytes ({e})"
                ) from e
            raise
        self.track(array)
        return array

    def track(self, array: jax.Array) -> None:
        self._committed += array.nbytes
        self._allocations += 1
        self._allocated += array.nbytes

    def release(self, array: jax.Array) -> None:
        self._committed -= array.nbytes
        if not array.is_deleted():
            array.delete()

    def stats(self) -> EagerStats:
        return EagerStats(self._committed, self._allocations, self._allocated)

    def close(self) -> None:
        pass
