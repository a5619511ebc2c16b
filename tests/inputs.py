"""Fresh random inputs for the op tests, in any dtype and layout; the CUDA module for GPU tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import Layout
from jax_kv.ops._common import SUPPORTED_HEAD_DIMS

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
HEADS = [(8, 8), (32, 8), (28, 4), (7, 1)]  # (Hq, Hkv): MHA, GQA 4, GQA 7, MQA 7
HEAD_DIMS = list(SUPPORTED_HEAD_DIMS)


def randn(rng: np.random.Generator, shape, dtype) -> jnp.ndarray:
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def caches(rng, layout: Layout, B, S, Hkv, D, dtype):
    """Random (never zero) caches: stale data past the live prefix must stay untouched."""
    shape = layout.cache_shape(B, S, Hkv, D)
    return randn(rng, shape, dtype), randn(rng, shape, dtype)


def edge_lengths(rng, B: int, S: int, room: int = 1) -> np.ndarray:
    """0, 1, the last legal value and random ones: every edge in one call."""
    last = S - room
    fixed = [0, min(1, last), last, min(54, last), min(97, last)]
    vals = [fixed[i] if i < len(fixed) else int(rng.integers(0, last + 1)) for i in range(B)]
    return np.asarray(vals, np.int32)


def append_step(layout: Layout):
    """A jitted step writing one new token's K and V (each [L, B, Hkv, D]) at position `pos`
    of every sequence of per-layer caches in `layout`, in place (the caches are donated)."""
    s = layout.seq_axis

    def put(cache, x, pos):
        start = tuple(pos if axis == s else 0 for axis in range(4))
        return jax.lax.dynamic_update_slice(cache, jnp.expand_dims(x, s), start)

    def step(ks, vs, k_new, v_new, pos):
        return (
            [put(c, x, pos) for c, x in zip(ks, k_new, strict=True)],
            [put(c, x, pos) for c, x in zip(vs, v_new, strict=True)],
        )

    return jax.jit(step, donate_argnums=(0, 1))


def live_prefix(cache, arrays, n: int | None = None) -> np.ndarray:
    """[L, B, n, Hkv, D] float64 of the first n positions (default: the KvCache's lengths[0])
    of per-layer arrays in the cache's layout, sliced on the device (a VMM cache's uncommitted
    tail is never touched)."""
    n = int(cache.lengths[0]) if n is None else n
    s = cache.layout.seq_axis
    out = []
    for a in arrays:
        x = jnp.moveaxis(jax.lax.slice_in_dim(a, 0, n, axis=s), s, 1)
        out.append(np.asarray(x.astype(jnp.float32), np.float64))
    return np.stack(out)


def cuda_module():
    """The registered CUDA FFI module (GPU tests only: fails where it is not built)."""
    from jax_kv import _ffi

    _ffi.register()
    mod = _ffi.cuda_module()
    assert mod is not None, "jax_kv._ffi_cuda is not built (JAX_KV_CUDA=ON) or no CUDA backend"
    return mod
