"""The models' projection: y = x @ w.T as XLA's dot, with the RMSNorm before it and the
SwiGLU or residual add after it as XLA's elementwise ops (fused by XLA, not by jax_kv).

A CUDA kernel for the few rows of a decode step (with those folded in) was measured slower than
XLA's fusions on the H200 at every model size tried (bench/NOTES.md, "A matrix-vector kernel
for the projections"); it lives on branch `cuda-matvec`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_kv.config import runtime_config
from jax_kv.ops.norm import rms_norm


def matmul_rows(x: jax.Array, w: jax.Array, **kwargs: Any) -> jax.Array:
    """x [..., K] @ w.T [K, N] -> [..., N] (jnp.matmul's keywords pass through).

    In the batch-invariant mode (JAX_KV_BATCH_INVARIANT) a single row is multiplied as two
    (itself twice, the first kept). At M = 1 XLA and cuBLAS take a matrix-vector path that sums
    K in another order than any M >= 2 (on the H100 M = 1 differed from M = 8 in 6 of 8
    projection shapes, every M >= 2 agreed: bench/experiments/gemm_row_invariance.py), so a
    request computed alone (Generator at batch 1) would round apart from the same request in a
    batch: on this repository's CPU one decode step's logits for a row alone and in a batch of 4
    differed in every element (SmolLM2-135M shape, bf16; bench/NOTES.md, "The batch-invariant
    mode"). A decode step is bound by the weights' bytes, so the second row costs ~nothing.

    In the mode the product is also kept apart from what follows it (an optimization
    barrier): XLA may fold a residual or bias add into the GEMM (cuBLAS's C operand, beta = 1;
    an epilogue), a choice and a kernel that can follow the shape. On the H100, without the
    barrier, a decode row alone and in a batch of 16 parted first at layer 0's o-projection
    with equal inputs, where the same GEMM without its residual add gave equal bits at every
    M; with it, every prefill logit and 4 decode steps were equal (bench/NOTES.md, "Device
    session 2026-12-08 (seventeenth)")."""
    if not runtime_config().batch_invariant:
        return jnp.matmul(x, w.T, **kwargs)
    if x.size // max(1, x.shape[-1]) != 1:
        return jax.lax.optimization_barrier(jnp.matmul(x, w.T, **kwargs))
    row = x.reshape(1, x.shape[-1])
    y = jnp.matmul(jnp.concatenate([row, row]), w.T, **kwargs)
    return jax.lax.optimization_barrier(y)[:1].reshape(*x.shape[:-1], w.shape[0])


def project(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    activation: str | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """y [..., N] = act(rms_norm(x) [..., K] @ w.T + b) + residual, float32 accumulation.

    Args:
        x: [..., K] activations.
        w: [N, K] weights ([2N, K] with activation="swiglu": gate rows, then up rows).
        b: [N] (or [2N]) bias, or None.
        norm: [K] RMSNorm weight applied to x first (eps), or None.
        activation: None, or "swiglu" (silu(gate) * up of the two halves).
        residual: [..., N] added last, or None.
    """
    if norm is not None:
        x = rms_norm(x, norm, eps)
    # float32 as float32 (GPU dots default to TF32 for it): the contract accumulates in float32.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = matmul_rows(x, w, precision=precision)
    if b is not None:
        y = y + b.reshape((1,) * (y.ndim - 1) + b.shape)
    if activation == "swiglu":
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return y if residual is None else residual + y
