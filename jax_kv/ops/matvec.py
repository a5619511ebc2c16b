"""matvec: y = x @ w.T for the few rows of a decode step (XLA FFI target jax_kv_matvec), with
the elementwise work around a projection folded in.

At B * T <= 4 rows XLA strength-reduces such a dot to multiply + reduce fusions, which ran the
decode projections at about 2 TB/s on the H200 (bench/NOTES.md); the CUDA kernel
(cuda/matvec.cu) streams w in 16-byte loads instead, and also does the RMSNorm before the
projection and the SwiGLU or residual add after it, which were graph nodes of their own.
Everywhere else (more rows, a K that is not whole 16-byte vectors, mixed dtypes, a CPU, no CUDA
module) it is the same computation in plain JAX, so models call it for every projection.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import _ffi
from jax_kv.config import runtime_config
from jax_kv.ops import _common
from jax_kv.ops.norm import rms_norm

MAX_ROWS = 4  # kMatvecMaxRows in cuda/matvec.cuh
MAX_STAGED_BYTES = 47 * 1024  # kMatvecMaxStagedBytes: x and norm in shared memory
ACTIVATIONS = (None, "swiglu")


def xla_matvec(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    activation: str | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """matvec's contract as XLA's dot and elementwise ops, nothing of jax_kv's CUDA: what
    matvec falls back to, and the plain-JAX comparator's projection in bench/."""
    if norm is not None:
        x = rms_norm(x, norm, eps)
    # float32 as float32 (GPU dots default to TF32 for it): the contract accumulates in float32.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.matmul(x, w.T, precision=precision)
    if b is not None:
        y = y + b.reshape((1,) * (y.ndim - 1) + b.shape)
    if activation == "swiglu":
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return y if residual is None else residual + y


def model_projection() -> Callable[..., jax.Array]:
    """The projection the models use: matvec with JAX_KV_MATVEC=on, else xla_matvec (the
    default: XLA's dots measured faster at B=1 on the H200; bench/NOTES.md)."""
    return matvec if runtime_config().matvec else xla_matvec


def matvec(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    activation: str | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] @ w [N, K]^T (+ b [N]) -> [..., N] in x's dtype, accumulated in float32.

    norm [K]: x goes through rms_norm(x, norm, eps) first (jax_kv.ops.norm).
    activation "swiglu": w is [2N, K] (gate rows, then up rows; b [2N]) and the result is
    silu(gate) * up [..., N].
    residual [..., N]: added to the result.

    The CUDA kernel runs where the leading dims of x hold at most 4 rows, every operand shares
    a dtype of bfloat16, float16 or float32, K is a multiple of 16 bytes and, with norm, x and
    norm fit in 47 KiB ((M + 1) * K elements: each CTA stages them); otherwise, on
    other platforms, the same steps in plain JAX (xla_matvec), each rounded to x's dtype where
    the kernel rounds. Whether the models project through it is JAX_KV_MATVEC's choice
    (model_projection).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"w: expected [N, K] with K = x.shape[-1], got x {x.shape}, w {w.shape}")
    swiglu = activation == "swiglu"
    if swiglu and w.shape[0] % 2:
        raise ValueError(f"w: expected [2N, K] (gate rows, then up rows) for swiglu, got {w.shape}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"b: expected [{w.shape[0]}], got {b.shape}")
    *lead, K = x.shape
    if norm is not None and norm.shape != (K,):
        raise ValueError(f"norm: expected [{K}] (one weight per input feature), got {norm.shape}")
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    if residual is not None and residual.shape != (*lead, N):
        raise ValueError(f"residual: expected {(*lead, N)}, got {residual.shape}")
    M = 1
    for d in lead:
        M *= d
    dtype = jnp.dtype(x.dtype)
    operands = (w, b, norm, residual)
    eligible = (
        1 <= M <= MAX_ROWS
        and dtype in _common.SUPPORTED_DTYPES
        and all(a is None or jnp.dtype(a.dtype) == dtype for a in operands)
        and (K * dtype.itemsize) % 16 == 0
        and (norm is None or (M + 1) * K * dtype.itemsize <= MAX_STAGED_BYTES)
        and _ffi.cuda_module() is not None
    )

    def plain(x, w, b, norm, residual):
        return xla_matvec(x, w, b, norm=norm, eps=eps, activation=activation, residual=residual)

    if not eligible:
        return plain(x, w, b, norm, residual)
    _ffi.register()

    def cuda(x, w, b, norm, residual):
        call = jax.ffi.ffi_call(
            "jax_kv_matvec", jax.ShapeDtypeStruct((M, N), dtype), vmap_method="sequential"
        )
        none = jnp.zeros((0,), dtype)
        y = call(
            x.reshape(M, K),
            w,
            none if b is None else b,
            none if norm is None else norm,
            none if residual is None else residual.reshape(M, N),
            eps=np.float32(eps),
            swiglu=swiglu,
        )
        return y.reshape(*lead, N)

    return jax.lax.platform_dependent(x, w, b, norm, residual, cuda=cuda, default=plain)
