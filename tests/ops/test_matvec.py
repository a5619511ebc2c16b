"""matvec on the CPU: the plain dot (x @ w.T + b) and its fused forms (RMSNorm before, SwiGLU
and residual after) against float64, and errors that name the argument. The CUDA kernel is
checked in test_gpu_matvec.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from inputs import randn
from reference import assert_close, matvec_ref

from jax_kv import matvec


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (6,)])
@pytest.mark.parametrize("bias", [False, True])
def test_matvec_is_the_dot(rng, lead, bias):
    K, N = 64, 24
    x, w = randn(rng, (*lead, K), jnp.float32), randn(rng, (N, K), jnp.float32)
    b = randn(rng, (N,), jnp.float32) if bias else None
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if bias:
        want = want + np.asarray(b, np.float64)
    y = matvec(x, w, b)
    assert y.shape == (*lead, N) and y.dtype == jnp.float32
    assert_close(y, want, "float32", "y")


def test_matvec_shape_errors(rng):
    x, w = randn(rng, (1, 64), jnp.float32), randn(rng, (8, 64), jnp.float32)
    with pytest.raises(ValueError, match="w: expected"):
        matvec(x, w[:, :32])
    with pytest.raises(ValueError, match="b: expected"):
        matvec(x, w, w[0])


FUSED = [  # (norm, activation, residual)
    (True, None, False),
    (False, "swiglu", False),
    (False, None, True),
    (True, "swiglu", True),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("norm, activation, residual", FUSED)
def test_matvec_fused_forms(rng, dtype, norm, activation, residual):
    K, N = 64, 24
    lead = (2, 1)
    x = randn(rng, (*lead, K), dtype)
    w = jnp.asarray(rng.standard_normal((2 * N if activation else N, K)) / np.sqrt(K), dtype)
    g = randn(rng, (K,), dtype) if norm else None
    r = randn(rng, (*lead, N), dtype) if residual else None
    y = matvec(x, w, norm=g, eps=1e-5, activation=activation, residual=r)
    assert y.shape == (*lead, N) and y.dtype == dtype
    want = matvec_ref(
        np.asarray(x).reshape(-1, K),
        w,
        norm=g,
        eps=1e-5,
        activation=activation,
        residual=None if r is None else np.asarray(r).reshape(-1, N),
    )
    assert_close(np.asarray(y).reshape(-1, N), want, jnp.dtype(dtype).name, "y")


def test_matvec_fused_errors(rng):
    x, w = randn(rng, (1, 64), jnp.float32), randn(rng, (8, 64), jnp.float32)
    with pytest.raises(ValueError, match="activation: expected"):
        matvec(x, w, activation="gelu")
    with pytest.raises(ValueError, match=r"w: expected \[2N, K\]"):
        matvec(x, w[:7], activation="swiglu")
    with pytest.raises(ValueError, match="norm: expected"):
        matvec(x, w, norm=w[0, :32])
    with pytest.raises(ValueError, match="residual: expected"):
        matvec(x, w, activation="swiglu", residual=randn(rng, (1, 8), jnp.float32))
