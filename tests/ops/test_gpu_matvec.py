"""The CUDA matvec kernel against float64: row counts 1..4 (and leading dims), K from one
16-byte vector to several load rounds per row, N not a multiple of the CTA's rows, every dtype,
with and without bias; every warps-per-row shape (1 for long N, up to 8 for a few long rows) and
grids that walk several row groups per CTA (N past SMs x resident CTAs x rows); the fused forms
(RMSNorm before, SwiGLU and residual after) against a float64 reference that rounds where the
contract does; NaN propagates; the handler ran (host-call counter); more rows, and a norm whose
staging would pass 47 KiB, fall back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import DTYPES, cuda_module, randn
from reference import assert_close, matvec_ref

from jax_kv import matvec
from jax_kv.ops.matvec import MAX_STAGED_BYTES

pytestmark = pytest.mark.gpu
dtype_ids = lambda d: jnp.dtype(d).name  # noqa: E731


def check(rng, lead, N, K, dtype, bias):
    x = randn(rng, (*lead, K), dtype)
    w = jnp.asarray(rng.standard_normal((N, K), np.float32) / np.sqrt(K), dtype)
    b = randn(rng, (N,), dtype) if bias else None
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if bias:
        want = want + np.asarray(b, np.float64)
    mod = cuda_module()
    before = mod.host_calls()["jax_kv_matvec"]
    y = jax.jit(matvec)(x, w, b)
    assert y.shape == (*lead, N) and y.dtype == dtype
    assert_close(y, want, jnp.dtype(dtype).name, "y")
    return mod.host_calls()["jax_kv_matvec"] - before


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("K", [8, 896, 2048, 2056, 4864])
def test_matvec_matches_reference(rng, dtype, M, K):
    assert check(rng, (M,), 1157, K, dtype, bias=M % 2 == 1) >= 1


@pytest.mark.parametrize("lead, N", [((1, 1), 896), ((2, 1), 7), ((1,), 1)])
def test_matvec_leading_dims_and_small_n(rng, lead, N):
    assert check(rng, lead, N, 64, jnp.bfloat16, bias=True) >= 1


# (N, K): 7 long rows (8 warps a row), 896 x 896 (2 warps a row: 112 CTAs of 8 rows would leave
# SMs idle), 20000 x 1536 (one warp a row, 2500 row groups: several per CTA, two load rounds a
# row), 3 x 14336 (7 rounds a row at 8 warps).
@pytest.mark.parametrize("N, K", [(7, 4864), (896, 896), (20000, 1536), (3, 14336)])
@pytest.mark.parametrize("M", [1, 3])
def test_matvec_grid_shapes(rng, N, K, M):
    assert check(rng, (M,), N, K, jnp.bfloat16, bias=True) >= 1


def test_matvec_nan_propagates(rng):
    x = randn(rng, (1, 256), jnp.bfloat16)
    w = randn(rng, (40, 256), jnp.bfloat16).at[17, 100].set(jnp.nan)
    y = np.asarray(jax.jit(matvec)(x, w), np.float32)
    assert np.isnan(y[0, 17]) and np.isfinite(np.delete(y[0], 17)).all()


def test_matvec_falls_back_past_four_rows_and_odd_k(rng):
    # 5 rows, or K not whole 16-byte vectors: XLA's dot, the handler never runs.
    assert check(rng, (5,), 64, 64, jnp.bfloat16, bias=False) == 0
    assert check(rng, (1,), 64, 12, jnp.bfloat16, bias=False) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("K", [896, 4864])
@pytest.mark.parametrize(
    "norm, activation, residual, bias",
    [
        (True, None, False, True),
        (True, "swiglu", False, False),
        (False, "swiglu", True, True),
        (False, None, True, False),
    ],
)
def test_matvec_fused_forms(rng, dtype, M, K, norm, activation, residual, bias):
    N = 1157
    W = 2 * N if activation else N
    x = randn(rng, (M, K), dtype)
    w = jnp.asarray(rng.standard_normal((W, K), np.float32) / np.sqrt(K), dtype)
    b = randn(rng, (W,), dtype) if bias else None
    g = randn(rng, (K,), dtype) if norm else None
    r = randn(rng, (M, N), dtype) if residual else None
    kw = dict(norm=g, eps=1e-6, activation=activation, residual=r)
    mod = cuda_module()
    before = mod.host_calls()["jax_kv_matvec"]
    y = jax.jit(lambda x, w, b, g, r: matvec(x, w, b, **kw | dict(norm=g, residual=r)))(
        x, w, b, g, r
    )
    # Under the norm, M = 4 at K = 4864 stages 48.6 KB (16-bit) or 97 KB (f32): plain JAX, the
    # handler never runs.
    staged = (M + 1) * K * jnp.dtype(dtype).itemsize <= MAX_STAGED_BYTES
    assert (mod.host_calls()["jax_kv_matvec"] > before) == (staged or not norm)
    assert y.shape == (M, N) and y.dtype == dtype
    assert_close(y, matvec_ref(x, w, b, **kw), jnp.dtype(dtype).name, "y")


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_matvec_norm_many_row_groups(rng, activation):
    """The norm staged once per CTA serves every row group the CTA walks (N = 20000)."""
    M, K, N = 2, 1536, 20000
    W = 2 * N if activation else N
    x = randn(rng, (M, K), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((W, K), np.float32) / np.sqrt(K), jnp.bfloat16)
    g = randn(rng, (K,), jnp.bfloat16)
    r = randn(rng, (M, N), jnp.bfloat16)
    kw = dict(eps=1e-6, activation=activation)
    y = jax.jit(lambda x, w, g, r: matvec(x, w, norm=g, residual=r, **kw))(x, w, g, r)
    assert_close(y, matvec_ref(x, w, norm=g, residual=r, **kw), "bfloat16", "y")
