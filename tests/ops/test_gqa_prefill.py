"""gqa_prefill on CPU against the float64 reference: ragged new_lengths, past tokens, window
and softcap, both layouts, every dtype, and prefill followed by decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import DTYPES, HEAD_DIMS, HEADS, caches, randn
from reference import assert_close, gqa_attention_ref, gqa_decode_ref

from jax_kv import Layout, gqa_decode, gqa_prefill


def run_prefill(rng, layout, dtype, Hq, Hkv, D, *, T=9, S=40, ragged=True, **kw):
    # Sequences: empty past + full prompt, past + empty prompt, past up to S - T, one token,
    # and random.
    past = np.array([0, 5, S - T, 1, int(rng.integers(0, S - T + 1))], np.int32)
    new = np.array([T, 0, T, 1, int(rng.integers(0, T + 1))], np.int32)
    if not ragged:
        new[:] = T
    B = len(past)
    q = randn(rng, (B, T, Hq, D), dtype)
    k, v = randn(rng, (B, T, Hkv, D), dtype), randn(rng, (B, T, Hkv, D), dtype)
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    fn = jax.jit(lambda *a, **n: gqa_prefill(*a, layout=layout, **n, **kw))
    out, kc2, vc2 = fn(
        q, k, v, kc, vc, jnp.asarray(past), **({"new_lengths": jnp.asarray(new)} if ragged else {})
    )
    ref_out, ref_kc, ref_vc = gqa_attention_ref(
        q, k, v, kc, vc, past, new, layout=int(layout), **kw
    )
    assert_close(out, ref_out, jnp.dtype(dtype).name)
    for b in range(B):  # rows past new_lengths[b] are exactly zero
        assert not np.asarray(out[b, new[b] :], np.float64).any()
    np.testing.assert_array_equal(np.asarray(kc2, np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc2, np.float64), ref_vc)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_prefill_matches_reference(rng, layout, dtype, heads):
    run_prefill(rng, layout, dtype, *heads, 64)


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_prefill_head_dims(rng, D):
    run_prefill(rng, Layout.SEQ_MAJOR, jnp.bfloat16, 8, 2, D, T=5, S=24)


@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_prefill_window_softcap(rng, layout, window):
    run_prefill(rng, layout, jnp.float32, 8, 4, 64, window=window)
    run_prefill(rng, layout, jnp.float32, 8, 4, 64, window=window, softcap=1.5, scale=0.3)


def test_prefill_default_new_lengths(rng):
    run_prefill(rng, Layout.HEAD_MAJOR, jnp.float16, 8, 8, 80, ragged=False)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_prefill_then_decode(rng, layout):
    """Prefill a ragged batch, then decode 3 tokens: the cache the ops build agrees with the
    reference's at every step, and so does every output."""
    B, T, Hq, Hkv, D, S = 3, 6, 8, 2, 64, 16
    dtype = jnp.float32
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    ref_kc, ref_vc = np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    new = np.array([6, 2, 4], np.int32)
    q = randn(rng, (B, T, Hq, D), dtype)
    k, v = randn(rng, (B, T, Hkv, D), dtype), randn(rng, (B, T, Hkv, D), dtype)
    zeros = np.zeros(B, np.int32)
    out, kc, vc = gqa_prefill(
        q, k, v, kc, vc, jnp.asarray(zeros), new_lengths=jnp.asarray(new), layout=layout
    )
    ref, ref_kc, ref_vc = gqa_attention_ref(q, k, v, ref_kc, ref_vc, zeros, new, layout=int(layout))
    assert_close(out, ref, "float32")
    lengths = new.copy()
    for _ in range(3):
        q1 = randn(rng, (B, Hq, D), dtype)
        k1, v1 = randn(rng, (B, Hkv, D), dtype), randn(rng, (B, Hkv, D), dtype)
        out, kc, vc = gqa_decode(q1, k1, v1, kc, vc, jnp.asarray(lengths), layout=layout)
        ref, ref_kc, ref_vc = gqa_decode_ref(
            q1, k1, v1, ref_kc, ref_vc, lengths, layout=int(layout)
        )
        assert_close(out, ref, "float32")
        lengths += 1
    np.testing.assert_array_equal(np.asarray(kc, np.float64), ref_kc)
