"""StepInputs: the Engine's per-step inputs at fixed device addresses.

XLA runs a compiled step's kernels as a recorded CUDA graph and replays it while the step's
buffers keep their addresses. An argument at a new address makes it record the graph again,
which runs every FFI handler's host code (measured on the Generator's decode step: a fresh
`lengths` buffer per step re-recorded it at every step; jax_kv/decode/generator.py). The
Engine's per-step values (tokens, lengths, the decode write bound, the prefill's sequence
offsets, the rows' sampling parameters) change at every step, so on a VMM arena they live in
one small region exported once as views: the host rewrites their bytes in place between calls
(one host-to-device copy per call), as SlotCache does for its `committed` bound.

A write must not overlap a call in flight that reads the views: the Engine writes only after
the previous call's tokens reached the host. Without a VMM arena (EagerArena: the CPU default,
CUDA without VMM) each write uploads fresh arrays instead: the values are the same, the
addresses are not.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_kv.memory import MeshArena, VmmArena
from jax_kv.memory.arena import MIN_ALIGN
from jax_kv.memory.mesh import REPLICATED, allocate
from jax_kv.parallel import put_replicated


class StepInputs:
    """Named 1-D arrays the host writes before each call.

    Args:
        fields: name -> (length, dtype) of each array.
        arena: the cache's arena; a VmmArena or MeshArena gives fixed addresses (one region,
            replicated on every device of a mesh), anything else fresh uploads.
        mesh: the Engine's mesh (None: one device); the arrays are whole on every device.
    """

    def __init__(self, fields: dict[str, tuple[int, Any]], arena: Any, mesh: Any = None) -> None:
        self.mesh = mesh
        self._layout: dict[str, tuple[int, int, np.dtype]] = {}  # name -> (offset, n, dtype)
        offset = 0
        for name, (n, dtype) in fields.items():
            dtype = np.dtype(dtype)
            self._layout[name] = (offset, int(n), dtype)
            offset += -(-max(1, int(n)) * dtype.itemsize // MIN_ALIGN) * MIN_ALIGN
        self.nbytes = offset
        self.fixed = isinstance(arena, VmmArena | MeshArena)
        self._arena = arena
        self._arrays: dict[str, jax.Array] = {}
        self._region: Any = None
        self._mirror = np.zeros((offset,), np.uint8)  # the region's bytes, as last written
        self.writes = 0  # host-to-device copies (fixed) or upload rounds (not fixed)
        if not self.fixed:
            for name, (_, n, dtype) in self._layout.items():
                self._arrays[name] = put_replicated(np.zeros((n,), dtype), mesh)
            return
        self._region = allocate(arena, offset, REPLICATED)
        try:
            self._region.commit(offset)
            self._region.write(0, self._mirror.tobytes())
            for name, (off, n, dtype) in self._layout.items():
                self._arrays[name] = self._region.export((n,), dtype, offset=off)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> jax.Array:
        return self._arrays[name]

    def write(self, **values: Any) -> None:
        """Sets the named arrays to `values` (each of its field's length; cast to its dtype):
        on a VMM arena one copy of the bytes from the first named field to the last. All are
        checked before any is written."""
        checked = []
        for name, value in values.items():
            if name not in self._layout:
                raise ValueError(f"{name}: not one of the inputs {list(self._layout)}")
            offset, n, dtype = self._layout[name]
            data = np.asarray(value, dtype)
            if data.shape != (n,):
                raise ValueError(f"{name}: expected shape ({n},), got {data.shape}")
            checked.append((name, offset, data))
        if not self.fixed:
            for name, _, data in checked:
                self._arrays[name] = put_replicated(data, self.mesh)
        elif checked:
            for _, offset, data in checked:
                self._mirror[offset : offset + data.nbytes] = data.view(np.uint8)
            lo = min(offset for _, offset, _ in checked)
            hi = max(offset + data.nbytes for _, offset, data in checked)
            self._region.write(lo, self._mirror[lo:hi].tobytes())
        self.writes += 1

    def close(self) -> None:
        """Drops the views and frees the region. Idempotent."""
        arrays = list(self._arrays.values())
        self._arrays.clear()
        for a in arrays:
            if not a.is_deleted():
                a.block_until_ready()
                a.delete()
        del arrays
        if self._region is not None:
            self._arena.wait_unviewed([self._region])  # XLA drops its references lazily
            region, self._region = self._region, None
            region.free()


__all__ = ["StepInputs"]
