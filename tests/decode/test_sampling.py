"""Sampling: greedy is argmax; top-k and top-p never pick outside their set; the seed
reproduces tokens; bad parameters are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv.decode.sampling import Sampling, argmax_rows, sample, sample_rows


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
        (dict(temperature=-1.0), r"temperature: expected a finite number >= 0, got -1\.0"),
        (dict(temperature=-1e-30), r"temperature: expected a finite number >= 0"),
        (dict(temperature=float("nan")), r"temperature: expected a finite number >= 0, got nan"),
        (dict(temperature=float("inf")), r"temperature: expected a finite number >= 0, got inf"),
        (dict(temperature=np.float32("inf")), r"temperature: expected a finite number >= 0"),
        (dict(temperature=10**400), r"temperature: expected a finite number >= 0"),
        (dict(temperature="0.7"), r"temperature: expected a finite number >= 0, got str '0\.7'"),
        (dict(temperature=True), r"temperature: expected a finite number >= 0, got bool True"),
        (dict(temperature=None), r"temperature: expected a finite number >= 0, got NoneType"),
        (dict(top_k=-2), r"top_k: expected an int >= 0, got -2"),
        (dict(top_k=2.5), r"top_k: expected an int >= 0, got float 2\.5"),
        (dict(top_k=2.0), r"top_k: expected an int >= 0, got float 2\.0"),
        (dict(top_k=True), r"top_k: expected an int >= 0, got bool True"),
        (dict(top_k="5"), r"top_k: expected an int >= 0, got str '5'"),
        (dict(top_p=0.0), r"top_p: expected a finite number in \(0, 1\], got 0\.0"),
        (dict(top_p=-0.5), r"top_p: expected a finite number in \(0, 1\], got -0\.5"),
        (dict(top_p=1.5), r"top_p: expected a finite number in \(0, 1\], got 1\.5"),
        (dict(top_p=float("nan")), r"top_p: expected a finite number in \(0, 1\], got nan"),
        (dict(top_p=float("inf")), r"top_p: expected a finite number in \(0, 1\], got inf"),
        (dict(top_p=True), r"top_p: expected a finite number in \(0, 1\], got bool True"),
        (dict(top_p="0.9"), r"top_p: expected a finite number in \(0, 1\], got str"),
        (dict(seed=1.0), r"seed: expected an int in \[-2\*\*63, 2\*\*63\), got float 1\.0"),
        (dict(seed=True), r"seed: expected an int in \[-2\*\*63, 2\*\*63\), got bool True"),
        (dict(seed="7"), r"seed: expected an int in \[-2\*\*63, 2\*\*63\), got str '7'"),
        (dict(seed=2**63), r"seed: expected an int in \[-2\*\*63, 2\*\*63\), got 922"),
        (dict(seed=-(2**63) - 1), r"seed: expected an int in \[-2\*\*63, 2\*\*63\), got -922"),
        (dict(seed=np.uint64(2**64 - 1)), r"seed: expected an int in \[-2\*\*63, 2\*\*63\)"),
    ],
)
def test_bad_sampling_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**32, 2**63 - 1, np.int64(5), np.uint8(3)])
def test_seed_range_is_what_jax_random_key_accepts(seed):
    """The accepted range ends where jax.random.key's does: jax raises OverflowError at 2**63
    and below -2**63 (the two refused cases above)."""
    s = Sampling(temperature=1.0, seed=seed)
    assert type(s.seed) is int and s.seed == int(seed)
    jax.random.key(s.seed)
    for refused in (2**63, -(2**63) - 1):
        with pytest.raises(OverflowError):
            jax.random.key(refused)


def test_values_are_stored_as_python_numbers():
    """NumPy scalars become float / int: equal settings make equal, equally hashed step keys."""
    a = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.5), seed=1)
    b = Sampling(temperature=0.5, top_k=3, top_p=0.5, seed=1)
    assert (type(a.temperature), type(a.top_k), type(a.top_p)) == (float, int, float)
    assert a == b and hash(a) == hash(b)


# (temperature, logit scale): each makes logits / temperature overflow float32 (or divides by
# a temperature that rounds to 0), where sampling used to return the first +inf, not argmax.
TINY_TEMPERATURES = [(1e-30, 1e9), (1e-38, 10.0), (1e-45, 10.0), (1e-300, 1.0), (5e-324, 1.0)]


@pytest.mark.parametrize("temperature, scale", TINY_TEMPERATURES)
@pytest.mark.parametrize("kw", [dict(), dict(top_k=5), dict(top_p=0.9)])
def test_tiny_temperature_is_greedy(rng, temperature, scale, kw):
    x = rng.standard_normal((4, 100)).astype(np.float32)
    x[:, 0] = 0.1  # positive, never the maximum: the old overflow picked it
    x[:, 1:] *= np.float32(scale)
    x[:, 0] *= np.float32(scale)
    want = np.argmax(x, axis=-1)
    assert (want != 0).all()
    s = Sampling(temperature=temperature, **kw)
    assert s.greedy
    for i in range(3):
        got = np.asarray(jax.jit(sample, static_argnums=2)(jnp.asarray(x), jax.random.key(i), s))
        np.testing.assert_array_equal(got, want)


def test_greedy_threshold():
    assert Sampling(temperature=0.0).greedy and Sampling(temperature=9.9e-6).greedy
    assert not Sampling(temperature=1e-5).greedy and not Sampling(temperature=0.7).greedy


def test_small_temperature_above_threshold_still_samples():
    """At 2e-5 (above the threshold) two logits 1e-5 apart are drawn with odds exp(-0.5):
    both appear, nothing else does (no overflow to index 0)."""
    x = np.full((4, 100), -10.0, np.float32)
    x[:, 3], x[:, 7] = 5.0, 5.0 - 1e-5
    s = Sampling(temperature=2e-5)
    seen = set()
    for i in range(30):
        seen |= set(np.asarray(sample(jnp.asarray(x), jax.random.key(i), s)).tolist())
    assert seen == {3, 7}


def rows_of(samplings):
    return (
        jnp.asarray([s.temperature for s in samplings], jnp.float32),
        jnp.asarray([s.top_k for s in samplings], jnp.int32),
        jnp.asarray([s.top_p for s in samplings], jnp.float32),
    )


def test_sample_rows_equals_sample_row_by_row(rng):
    """Each row's own temperature / top_k / top_p, one compiled function for the mix: row b is
    what `sample` gives for that row alone with the same key (greedy rows are argmax)."""
    samplings = [
        Sampling(),
        Sampling(temperature=0.7),
        Sampling(temperature=1.3, top_k=5),
        Sampling(temperature=0.9, top_p=0.5),
        Sampling(temperature=1.0, top_k=20, top_p=0.8),
        Sampling(temperature=2.0, top_k=1000),  # k past the vocabulary: all
        Sampling(temperature=1e-6, top_k=3),  # below GREEDY_BELOW: greedy
    ]
    logits = jnp.asarray(rng.standard_normal((len(samplings), 300)) * 3, jnp.float32)
    step = jax.jit(sample_rows)
    drawn = set()
    for trial in range(16):
        keys = jax.random.split(jax.random.key(trial), len(samplings))
        got = np.asarray(step(logits, keys, *rows_of(samplings))).tolist()
        want = [int(sample(logits[b : b + 1], keys[b], s)[0]) for b, s in enumerate(samplings)]
        assert got == want, trial
        drawn.add(tuple(got[1:-1]))
    # The sampled rows really sample. Over all five: one row's draws can all be its argmax
    # (TEST_SEED=158140803: row 1's top logit led by enough that 16 draws at 0.7 agreed).
    assert len(drawn) > 1
    argmax = np.argmax(np.asarray(logits), axis=-1)
    assert got[0] == argmax[0] and got[-1] == argmax[-1]


def test_sample_rows_all_greedy_is_argmax(rng):
    logits = jnp.asarray(rng.standard_normal((4, 2000)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    got = sample_rows(logits, keys, *rows_of([Sampling()] * 4))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), axis=-1))
