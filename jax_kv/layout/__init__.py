"""The one descriptor of a KV cache's physical geometry.

A layout is an axis order over (B, S, Hkv, D). Shapes, strides and the capacity axis are all
derived from that order, in Python here and in C++ (`ffi/common.h`, `AxisOrderOf`), so a third
layout is one more row in each table, not a branch in every op.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class KvStrides(NamedTuple):
    """Element strides of one cache array; the head_dim stride is 1."""

    b: int
    s: int
    h: int


class Layout(enum.IntEnum):
    """Physical layout of a per-layer K or V cache.

    HEAD_MAJOR: [B, Hkv, S, D]. The per-head stride is the capacity: growing re-strides
        every (b, h) stripe (bytes moved = live bytes).
    SEQ_MAJOR: [B, S, Hkv, D]. The per-token stride Hkv*D does not depend on the capacity:
        under VMM a slot reserved at max_len grows by committing memory, moving 0 bytes.
    """

    HEAD_MAJOR = 0
    SEQ_MAJOR = 1

    @property
    def axes(self) -> str:
        """Axis names in memory order, e.g. "BHSD"."""
        return _AXES[self]

    @property
    def seq_axis(self) -> int:
        return self.axes.index("S")

    def cache_shape(
        self, batch: int, capacity: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int]:
        """The array shape of a cache with this layout."""
        extent = {"B": batch, "S": capacity, "H": num_kv_heads, "D": head_dim}
        return tuple(extent[a] for a in self.axes)  # type: ignore[return-value]

    def dims_of(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """(B, S, Hkv, D) of a cache array with this layout."""
        if len(shape) != 4:
            raise ValueError(f"cache: expected rank 4 {self.axes}, got shape {tuple(shape)}")
        extent = dict(zip(self.axes, shape, strict=True))
        return extent["B"], extent["S"], extent["H"], extent["D"]

    def capacity_of(self, shape: tuple[int, ...]) -> int:
        return self.dims_of(shape)[1]

    def strides(self, capacity: int, num_kv_heads: int, head_dim: int) -> KvStrides:
        """Element strides (b, s, h) of a contiguous cache array."""
        shape = self.cache_shape(1, capacity, num_kv_heads, head_dim)
        stride, acc = {}, 1
        for axis, extent in zip(reversed(self.axes), reversed(shape), strict=True):
            stride[axis] = acc
            acc *= extent
        return KvStrides(stride["B"], stride["S"], stride["H"])

    @classmethod
    def parse(cls, value: Layout | str | int) -> Layout:
        """Layout from an enum, a name ("seq-major", "SEQ_MAJOR") or its int value."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"layout: expected a jax_kv.Layout ({names}), got {value!r}")


_AXES = {Layout.HEAD_MAJOR: "BHSD", Layout.SEQ_MAJOR: "BSHD"}

__all__ = ["KvStrides", "Layout"]
