"""Sampling: greedy is argmax; top-k and top-p never pick outside their set; the seed
reproduces tokens; bad parameters are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv.decode.sampling import Sampling, argmax_rows, sample


def test_greedy_is_argmax(rng):
    logits = jnp.asarray(rng.standard_normal((4, 100)), jnp.float32)
    np.testing.assert_array_equal(
        sample(logits, jax.random.key(0), Sampling()), np.argmax(np.asarray(logits), axis=-1)
    )


@pytest.mark.parametrize("V", [1, 1023, 1024, 1025, 151936])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_rows_equals_argmax(rng, V, dtype):
    # Rows: random; the maximum tied at two places (the first wins); a NaN after the maximum
    # (argmax ranks NaN highest); all -inf (index 0); the maximum in the last, padded chunk.
    x = rng.standard_normal((5, V)).astype(np.float32)
    x[1, V // 3] = x[1, V - 1] = 9.0
    x[2, V // 2] = 9.0
    x[2, V - 1] = np.nan
    x[3] = -np.inf
    x[4, V - 1] = 9.0
    logits = jnp.asarray(x, dtype)
    want = np.argmax(np.asarray(logits.astype(jnp.float32)), axis=-1)
    got = np.asarray(jax.jit(argmax_rows)(logits))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_top_k_stays_in_the_top_k(rng):
    logits = jnp.asarray(rng.standard_normal((8, 50)), jnp.float32)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    s = Sampling(temperature=5.0, top_k=3)
    for i in range(20):
        tok = np.asarray(sample(logits, jax.random.key(i), s))
        assert all(tok[b] in top3[b] for b in range(8))


def test_top_p_stays_in_the_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p = 0.7 keeps the first two tokens only.
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(p)[None].repeat(4, 0), jnp.float32)
    s = Sampling(temperature=1.0, top_p=0.7)
    seen = set()
    for i in range(50):
        seen |= set(np.asarray(sample(logits, jax.random.key(i), s)).tolist())
    assert seen == {0, 1}


def test_seed_reproduces(rng):
    logits = jnp.asarray(rng.standard_normal((4, 1000)), jnp.float32)
    s = Sampling(temperature=1.0)
    a = sample(logits, jax.random.key(7), s)
    b = sample(logits, jax.random.key(7), s)
    c = sample(logits, jax.random.key(8), s)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-1.0), "temperature: expected >= 0"),
        (dict(top_k=-2), "top_k: expected an int >= 0"),
        (dict(top_p=0.0), "top_p: expected 0 < top_p <= 1"),
        (dict(top_p=1.5), "top_p: expected 0 < top_p <= 1"),
    ],
)
def test_bad_sampling_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)
