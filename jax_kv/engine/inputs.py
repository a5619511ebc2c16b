"""StepInputs: the Engine's per-step inputs at fixed device addresses, written in stream order.

XLA runs a compiled step's kernels as a recorded CUDA graph and replays it while the step's
buffers keep their addresses. An argument at a new address makes it record the graph again,
which runs every FFI handler's host code (measured on the Generator's decode step: a fresh
`lengths` buffer per step re-recorded it at every step; jax_kv/decode/generator.py). The
Engine's per-step values (tokens, lengths, the decode write bound, the prefill's sequence
offsets, the rows' sampling parameters) change at every step, so they live in arrays that keep
their addresses: a write is a small compiled call that takes the arrays donated and returns
them in place (XLA aliases each output to its donated input), with the host's values packed in
one upload.

Why a compiled call and not a host copy into fixed memory: the write is ordered on the device
after the calls dispatched before it. The Engine writes call N+1's inputs while call N runs and
reads the old values (Engine._dispatch_next); a copy on another stream would race with it. The
token picker writes its tokens into the `tokens` array the same way, so the next decode call
can take them on the device, before the host has read them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.parallel import put_replicated


def _update(old: tuple[jax.Array, ...], packed: jax.Array) -> tuple:
    """old: the fields (4-byte dtypes), donated; packed int32 [sum of lengths + fields]: their
    new bytes end to end, then one word per field, nonzero where the field takes them (the
    others keep theirs). `where`, not a plain copy: XLA would return `packed`'s slice itself,
    at a new address."""
    out, offset = [], 0
    take = packed[packed.shape[0] - len(old) :] != 0
    for i, field in enumerate(old):
        n = field.shape[0]
        new = jax.lax.bitcast_convert_type(packed[offset : offset + n], field.dtype)
        out.append(jnp.where(take[i], new, field))
        offset += n
    return tuple(out)


class StepInputs:
    """Named 1-D arrays (int32, uint32 or float32) the host writes before each call.

    Args:
        fields: name -> (length, dtype) of each array.
        mesh: the Engine's mesh (None: one device); the arrays are whole on every device.
        device: without a mesh, the device the arrays live on (default: JAX's first).
    """

    def __init__(
        self, fields: dict[str, tuple[int, Any]], mesh: Any = None, device: Any = None
    ) -> None:
        self.mesh = mesh
        self.device = jax.devices()[0] if device is None else device
        self._names = list(fields)
        # name -> (offset, n, dtype, its take word's index)
        self._layout: dict[str, tuple[int, int, np.dtype, int]] = {}
        offset = 0
        for i, (name, (n, dtype)) in enumerate(fields.items()):
            dtype = np.dtype(dtype)
            if dtype.itemsize != 4:
                raise ValueError(f"{name}: expected a 4-byte dtype, got {dtype}")
            self._layout[name] = (offset, int(n), dtype, i)
            offset += int(n)
        self.words = offset
        self._write = jax.jit(_update, donate_argnums=(0,))
        # Zeros, then once through the compiled write: its outputs are buffers XLA owns and
        # can update in place from the first call on (an upload may alias host memory, which
        # a donation cannot reuse: the first write would move it).
        zeros = tuple(self._put(np.zeros((n,), dtype)) for _, n, dtype, _ in self._layout.values())
        every = np.zeros((self.words + len(self._names),), np.int32)
        every[self.words :] = 1
        first = self._write(zeros, self._upload(every))
        self._arrays: dict[str, jax.Array] = dict(zip(self._names, first, strict=True))
        self.writes = 0  # compiled writes (one upload each), after this first one

    def __getitem__(self, name: str) -> jax.Array:
        return self._arrays[name]

    def write(self, **values: Any) -> None:
        """Sets the named arrays to `values` (each of its field's length; cast to its dtype);
        the others keep their values. All are checked before any is written. One upload of
        every field's words (the unnamed ones as zeros, not taken) and one compiled call."""
        packed = np.zeros((self.words + len(self._names),), np.int32)
        take = packed[self.words :]  # a view: one word per field
        for name, value in values.items():
            if name not in self._layout:
                raise ValueError(f"{name}: not one of the inputs {self._names}")
            offset, n, dtype, i = self._layout[name]
            data = np.asarray(value, dtype)
            if data.shape != (n,):
                raise ValueError(f"{name}: expected shape ({n},), got {data.shape}")
            packed[offset : offset + n] = data.view(np.int32)
            take[i] = 1
        if not values:
            return
        old = tuple(self._arrays.values())  # in the fields' order
        new = self._write(old, self._upload(packed))
        self._arrays = dict(zip(self._names, new, strict=True))
        self.writes += 1

    def _upload(self, packed: np.ndarray) -> Any:
        # Without a mesh the compiled write takes the host array itself: jit's C++ path
        # uploads it with the call, to the fields' device (~17 us a write on a CPU, against
        # ~37 through jax.device_put's Python). Under a mesh it is put whole on every device.
        return packed if self.mesh is None else put_replicated(packed, self.mesh)

    def _put(self, values: np.ndarray) -> jax.Array:
        # Committed to the device, as every compiled call's output is: an uncommitted first
        # value would be another jit signature of each step (one more compile).
        if self.mesh is None:
            return jax.device_put(values, self.device)
        return put_replicated(values, self.mesh)

    def replace(self, name: str, array: jax.Array) -> None:
        """Takes `array` as field `name`: a compiled call's output aliased to the field it
        was given donated (the token picker's), at the same address."""
        self._arrays[name] = array

    def close(self) -> None:
        """Drops the arrays. Idempotent."""
        arrays = list(self._arrays.values())
        self._arrays.clear()
        for a in arrays:
            if not a.is_deleted():
                a.delete()


__all__ = ["StepInputs"]
