"""matvec: y = x @ w.T (+ b) for the few rows of a decode step (XLA FFI target jax_kv_matvec).

At B * T <= 4 rows XLA strength-reduces such a dot to multiply + reduce fusions, which ran the
decode projections at about 2 TB/s on the H200 (bench/NOTES.md); the CUDA kernel
(cuda/matvec.cu) streams w in 16-byte loads instead. Everywhere else (more rows, a K that is not
whole 16-byte vectors, a CPU, no CUDA module) it is the plain dot, so models call it for every
projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kv import _ffi
from jax_kv.config import runtime_config
from jax_kv.ops import _common

MAX_ROWS = 4  # kMatvecMaxRows in cuda/matvec.cuh


def _dot(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = x @ w.T
    return y if b is None else y + b.reshape((1,) * (y.ndim - 1) + b.shape)


def matvec(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w [N, K]^T (+ b [N]) -> [..., N] in x's dtype, accumulated in float32.

    The CUDA kernel runs where the leading dims of x hold at most 4 rows, x, w (and b) share a
    dtype of bfloat16, float16 or float32 and K is a multiple of 16 bytes; otherwise, and on
    other platforms, or with JAX_KV_MATVEC=off, `x @ w.T (+ b)`.
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"w: expected [N, K] with K = x.shape[-1], got x {x.shape}, w {w.shape}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"b: expected [{w.shape[0]}], got {b.shape}")
    *lead, K = x.shape
    N = w.shape[0]
    M = 1
    for d in lead:
        M *= d
    dtype = jnp.dtype(x.dtype)
    eligible = (
        1 <= M <= MAX_ROWS
        and dtype in _common.SUPPORTED_DTYPES
        and jnp.dtype(w.dtype) == dtype
        and (b is None or jnp.dtype(b.dtype) == dtype)
        and (K * dtype.itemsize) % 16 == 0
        and _ffi.cuda_module() is not None
        and runtime_config().matvec
    )
    if not eligible:
        return _dot(x, w, b)
    _ffi.register()

    def cuda(x, w, b):
        call = jax.ffi.ffi_call(
            "jax_kv_matvec", jax.ShapeDtypeStruct((M, N), dtype), vmap_method="sequential"
        )
        bias = jnp.zeros((0,), dtype) if b is None else b
        return call(x.reshape(M, K), w, bias).reshape(*lead, N)

    return jax.lax.platform_dependent(x, w, b, cuda=cuda, default=_dot)
