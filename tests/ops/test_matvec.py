"""matvec on the CPU: the plain dot (x @ w.T + b) against float64, and shape errors that name
the argument. The CUDA kernel is checked in test_gpu_matvec.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from inputs import randn
from reference import assert_close

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
