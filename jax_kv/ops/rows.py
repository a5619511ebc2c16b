"""One row computed as two: the batch-invariant mode's guard against XLA's one-row paths."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_kv.config import runtime_config


def one_row_as_two(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """fn(x) for a row-wise fn of x [..., K] -> [..., N]; where x holds a single row and the
    batch-invariant mode is on (JAX_KV_BATCH_INVARIANT), fn runs on that row twice and the
    first is kept.

    XLA treats one row apart: a matmul of M = 1 takes a matrix-vector path, a reduction over a
    [1, K] array becomes a reduction of all its elements, and each sums in another order than
    the same op over M >= 2 rows. So a request computed alone (Generator at batch 1) rounds
    apart from the same request in a batch: on this repository's CPU, one decode step's logits
    for a row alone and in a batch of 4 differed in every element (SmolLM2-135M shape, bf16),
    and with trained weights RMSNorm's [1, 576] reduction alone parted 3 of a layer's 576 values
    (bench/NOTES.md, "The batch-invariant mode"). A decode step is bound by the weights' bytes,
    so the second row costs ~nothing."""
    rows = x.size // max(1, x.shape[-1]) if x.ndim else 1
    if rows != 1 or not runtime_config().batch_invariant:
        return fn(x)
    row = x.reshape(1, x.shape[-1])
    y = fn(jnp.concatenate([row, row]))[:1]
    return y.reshape(*x.shape[:-1], y.shape[-1])
