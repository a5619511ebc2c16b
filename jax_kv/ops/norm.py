"""RMSNorm as transformers computes it, the one definition the models' layers and their
projection's norm prologue (jax_kv.models.projection, norm=) both follow."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kv.ops.rows import one_row_as_two


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., H] normalized in float32, cast back, then scaled by weight [H] (transformers'
    order: the product is in x's dtype). A single row is normalized as two in the
    batch-invariant mode (jax_kv.ops.rows)."""

    def norm(x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return weight.reshape((1,) * (x.ndim - 1) + weight.shape) * x32.astype(x.dtype)

    return one_row_as_two(norm, x)
