"""Refused calls: each bad input raises an error that names the argument and the expectation,
and the cache arrays passed in are unchanged afterwards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import caches, randn

from jax_kv import Layout, gqa_decode, gqa_prefill, grow_cache

B, Hq, Hkv, D, S, T = 2, 8, 2, 64, 16, 4
LAYOUT = Layout.SEQ_MAJOR


@pytest.fixture
def args(rng):
    q = randn(rng, (B, Hq, D), jnp.float32)
    k, v = randn(rng, (B, Hkv, D), jnp.float32), randn(rng, (B, Hkv, D), jnp.float32)
    kc, vc = caches(rng, LAYOUT, B, S, Hkv, D, jnp.float32)
    return dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, lengths=jnp.array([0, 3], jnp.int32))


def call_decode(a, **kw):
    return gqa_decode(
        a["q"], a["k"], a["v"], a["k_cache"], a["v_cache"], a["lengths"], **{"layout": LAYOUT, **kw}
    )


def refused(a, exc, match, **changes):
    before = {n: np.asarray(a[n]).copy() for n in ("k_cache", "v_cache")}
    bad = {**a, **{k: v for k, v in changes.items() if k in a}}
    kw = {k: v for k, v in changes.items() if k not in a}
    with pytest.raises(exc, match=match):
        out = call_decode(bad, **kw)
        jax.block_until_ready(out)
    for n, x in before.items():
        np.testing.assert_array_equal(np.asarray(a[n]), x, err_msg=f"{n} changed")


CASES = {
    "q rank": (dict(q=jnp.zeros((B, 1, Hq, D))), r"q: expected rank 3 \[B, Hq, D\]"),
    "k dtype": (dict(k=jnp.zeros((B, Hkv, D), jnp.float16)), r"k: expected dtype float32"),
    "cache dtype": (
        dict(v_cache=jnp.zeros(LAYOUT.cache_shape(B, S, Hkv, D), jnp.bfloat16)),
        r"v_cache: expected dtype float32",
    ),
    "head ratio": (dict(q=jnp.zeros((B, 7, D))), r"Hq to be a multiple of Hkv=2"),
    "head dim": (
        dict(q=jnp.zeros((B, Hq, 48)), k=jnp.zeros((B, Hkv, 48)), v=jnp.zeros((B, Hkv, 48))),
        r"head_dim D must be one of",
    ),
    "q int": (dict(q=jnp.zeros((B, Hq, D), jnp.int32)), r"q: expected dtype bfloat16"),
    "cache rank": (dict(k_cache=jnp.zeros((B, S, Hkv * D))), r"k_cache: expected rank 4"),
    "cache batch": (
        dict(k_cache=jnp.zeros(LAYOUT.cache_shape(3, S, Hkv, D))),
        r"k_cache: expected \[B, S, Hkv, D\] \(SEQ_MAJOR\) with B=2",
    ),
    "v_cache shape": (
        dict(v_cache=jnp.zeros(LAYOUT.cache_shape(B, S + 1, Hkv, D))),
        r"v_cache: expected the shape of k_cache",
    ),
    "k shape": (dict(k=jnp.zeros((B, Hkv + 1, D))), r"k: expected \[B, Hkv, D\]"),
    "lengths dtype": (
        dict(lengths=jnp.array([0, 3], jnp.int16)),
        r"lengths: expected int32 \[B=2\]",
    ),
    "lengths shape": (
        dict(lengths=jnp.array([0, 3, 1], jnp.int32)),
        r"lengths: expected int32 \[B=2\]",
    ),
    "lengths negative": (
        dict(lengths=jnp.array([-1, 3], jnp.int32)),
        r"lengths: expected 0 <= lengths\[b\] < capacity S=16, got lengths\[0\]",
    ),
    "lengths full": (
        dict(lengths=jnp.array([0, S], jnp.int32)),
        r"lengths: expected 0 <= lengths\[b\] < capacity S=16, got lengths\[1\]=16",
    ),
    "window zero": (dict(window=0), r"window: expected an int > 0 or None, got 0"),
    "window negative": (dict(window=-3), r"window: expected an int > 0"),
    "window float": (dict(window=2.5), r"window: expected an int > 0"),
    "softcap": (dict(softcap=-1.0), r"softcap: expected a finite float > 0"),
    "scale": (dict(scale=float("nan")), r"scale: expected a finite float"),
    "layout": (dict(layout="row-major"), r"layout: expected a jax_kv.Layout"),
    "layout int": (dict(layout=7), r"layout: expected a jax_kv.Layout"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_refuses(args, case):
    changes, match = CASES[case]
    refused(args, ValueError, match, **changes)


@pytest.mark.parametrize("bad", [S, -1, 2**31 - 1])
def test_traced_lengths_latched_by_handler_under_donation(args, bad):
    """Under jit the values are unknown in Python: the CPU handler latches like the CUDA
    kernels (status 1, that row NaN, its cache untouched, the other row computed) instead of
    failing the call, which under donation would delete the caller's cache, valid rows too."""
    step = jax.jit(
        lambda kc, vc, n: gqa_decode(
            args["q"], args["k"], args["v"], kc, vc, n, layout=LAYOUT, return_status=True
        ),
        donate_argnums=(0, 1),
    )
    kc, vc = args["k_cache"], args["v_cache"]
    before = np.asarray(kc).copy(), np.asarray(vc).copy()
    out, kc2, vc2, status = step(kc, vc, jnp.array([bad, 3], jnp.int32))
    assert np.asarray(status).tolist() == [1, 0]
    assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()
    np.testing.assert_array_equal(np.asarray(kc2[0]), before[0][0])
    np.testing.assert_array_equal(np.asarray(vc2[0]), before[1][0])
    written = np.asarray(kc2[1]) != before[0][1]
    assert written[3].all() and not np.delete(written, 3, axis=0).any()  # row 1: slot 3 only


def test_prefill_overflow_refused(rng, args):
    q = randn(rng, (B, T, Hq, D), jnp.float32)
    k = randn(rng, (B, T, Hkv, D), jnp.float32)
    kc, vc = args["k_cache"], args["v_cache"]
    before = np.asarray(kc).copy()
    with pytest.raises(ValueError, match=r"prefill would overflow the cache"):
        gqa_prefill(q, k, k, kc, vc, jnp.array([0, S - T + 1], jnp.int32), layout=LAYOUT)
    with pytest.raises(ValueError, match=r"new_lengths: expected 0 <= new_lengths\[b\] <= T=4"):
        gqa_prefill(
            q,
            k,
            k,
            kc,
            vc,
            jnp.array([0, 0], jnp.int32),
            new_lengths=jnp.array([5, 0], jnp.int32),
            layout=LAYOUT,
        )
    with pytest.raises(ValueError, match=r"q: expected rank 4 \[B, T, Hq, D\]"):
        gqa_prefill(args["q"], k, k, kc, vc, jnp.array([0, 0], jnp.int32), layout=LAYOUT)
    fn = jax.jit(lambda n: gqa_prefill(q, k, k, kc, vc, n, layout=LAYOUT, return_status=True))
    out, kc2, _, status = fn(jnp.array([0, S - T + 1], jnp.int32))
    assert np.asarray(status).tolist() == [0, 1]
    assert np.isnan(np.asarray(out[1])).all() and np.isfinite(np.asarray(out[0])).all()
    np.testing.assert_array_equal(np.asarray(kc2[1]), before[1])
    np.testing.assert_array_equal(np.asarray(kc), before)


def test_grow_refuses(rng):
    cache = randn(rng, LAYOUT.cache_shape(B, S, Hkv, D), jnp.float32)
    n = jnp.array([3, 4], jnp.int32)
    with pytest.raises(
        ValueError,
        match=r"new_capacity: expected an int >= the current "
        r"capacity S=16, got 8",
    ):
        grow_cache(cache, n, 8, layout=LAYOUT)
    with pytest.raises(ValueError, match=r"lengths: expected 0 <= lengths\[b\] <= capacity S=16"):
        grow_cache(cache, jnp.array([3, 17], jnp.int32), 32, layout=LAYOUT)
    with pytest.raises(ValueError, match=r"cache: expected dtype bfloat16, float16 or float32"):
        grow_cache(cache.astype(jnp.int32), n, 32, layout=LAYOUT)
    with pytest.raises(ValueError, match=r"layout: expected a jax_kv.Layout"):
        grow_cache(cache, n, 32, layout=None)
