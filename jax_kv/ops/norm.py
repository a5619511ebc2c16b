"""RMSNorm as transformers computes it, the one definition the models' layers and their
projection's norm prologue (jax_kv.models.projection, norm=) both follow."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kv.config import runtime_config


def sum_in_fixed_order(x: jax.Array) -> jax.Array:
    """x [..., H] -> [..., 1]: the sum over the last axis as a halving tree of elementwise adds
    (zeros pad H to a power of two), one order for every row whatever the array's shape.

    XLA picks a reduction's strategy, and with it the order of its sums, by shape: on this
    repository's CPU RMSNorm's sum of squares ran as a YNNPACK fusion over 16 rows and as a
    reduce-window tree over 2, and 3-5 of a layer's 576 bf16 outputs parted with trained
    weights (bench/NOTES.md, "The batch-invariant mode"). Elementwise adds are exact IEEE
    operations on the same operands however XLA fuses or parallelizes them."""
    width = x.shape[-1]
    padded = 1 << max(0, width - 1).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - width)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., H] normalized in float32, cast back, then scaled by weight [H] (transformers'
    order: the product is in x's dtype). In the batch-invariant mode (JAX_KV_BATCH_INVARIANT)
    the mean of squares sums in one fixed order (sum_in_fixed_order)."""
    x32 = x.astype(jnp.float32)
    if runtime_config().batch_invariant:
        mean = sum_in_fixed_order(x32 * x32) * jnp.float32(1.0 / x.shape[-1])
    else:
        mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    x32 = x32 * jax.lax.rsqrt(mean + eps)
    return weight.reshape((1,) * (x.ndim - 1) + weight.shape) * x32.astype(x.dtype)
