"""Fresh random inputs for the op tests, in any dtype and layout."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_kv import Layout

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
HEADS = [(8, 8), (32, 8), (28, 4), (7, 1)]  # (Hq, Hkv): MHA, GQA 4, GQA 7, MQA 7
HEAD_DIMS = [64, 80, 96, 128, 256]


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
