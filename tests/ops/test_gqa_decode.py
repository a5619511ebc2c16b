"""gqa_decode on CPU against the float64 reference: layouts, dtypes, GQA ratios, head dims,
lengths at the edges, window, softcap, in-place update under donation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import DTYPES, HEAD_DIMS, HEADS, caches, edge_lengths, randn
from reference import assert_close, gqa_decode_ref

from jax_kv import Layout, gqa_decode


def run_decode(rng, layout, dtype, Hq, Hkv, D, S=128, B=6, **kw):
    q = randn(rng, (B, Hq, D), dtype)
    k, v = randn(rng, (B, Hkv, D), dtype), randn(rng, (B, Hkv, D), dtype)
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    lengths = edge_lengths(rng, B, S)
    step = jax.jit(lambda *a: gqa_decode(*a, layout=layout, **kw))
    out, kc2, vc2 = step(q, k, v, kc, vc, jnp.asarray(lengths))
    ref_out, ref_kc, ref_vc = gqa_decode_ref(q, k, v, kc, vc, lengths, layout=int(layout), **kw)
    name = jnp.dtype(dtype).name
    assert out.dtype == dtype and out.shape == (B, Hq, D)
    err = assert_close(out, ref_out, name)
    # The caches are copies plus one row per b: compare bit for bit, untouched stale data too.
    np.testing.assert_array_equal(np.asarray(kc2, np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc2, np.float64), ref_vc)
    return err


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_decode_matches_reference(rng, layout, dtype, heads):
    run_decode(rng, layout, dtype, *heads, D=64)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_decode_head_dims(rng, layout, D):
    run_decode(rng, layout, jnp.bfloat16, 32, 8, D, S=64, B=4)


@pytest.mark.parametrize("window", [1, 7, 100, 1000])
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_decode_window(rng, layout, window):
    # 7 and 100 fall inside and outside the lengths (0, 1, 127, 54, 97, rand).
    run_decode(rng, layout, jnp.float32, 8, 2, 64, window=window)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_decode_softcap_and_scale(rng, layout):
    run_decode(rng, layout, jnp.float32, 8, 2, 128, softcap=2.0, scale=0.5)
    run_decode(rng, layout, jnp.float16, 8, 2, 128, softcap=30.0, window=16)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_decode_donated_cache_keeps_pointer(rng, layout):
    B, Hq, Hkv, D, S = 2, 8, 2, 64, 32
    # jnp.asarray of a NumPy array may alias host memory XLA cannot reuse; copy it into an
    # XLA-owned buffer first, as a cache allocated by jax_kv would be.
    kc, vc = (jnp.copy(c) for c in caches(rng, layout, B, S, Hkv, D, jnp.float32))
    step = jax.jit(
        lambda q, k, v, kc, vc, n: gqa_decode(q, k, v, kc, vc, n, layout=layout),
        donate_argnums=(3, 4),
    )
    k_ptr, v_ptr = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
    lengths = jnp.zeros((B,), jnp.int32)
    ref_kc, ref_vc = np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    for _ in range(3):
        q, k, v = (
            randn(rng, (B, Hq, D), jnp.float32),
            *(randn(rng, (B, Hkv, D), jnp.float32) for _ in range(2)),
        )
        _, ref_kc, ref_vc = gqa_decode_ref(q, k, v, ref_kc, ref_vc, lengths, layout=int(layout))
        _, kc, vc = step(q, k, v, kc, vc, lengths)
        assert kc.unsafe_buffer_pointer() == k_ptr
        assert vc.unsafe_buffer_pointer() == v_ptr
        lengths = lengths + 1
    np.testing.assert_array_equal(np.asarray(kc, np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc, np.float64), ref_vc)


def test_attributes_are_normalised(rng):
    """A Python float and an np.float32 (and int vs np.int64) lower to the same call."""
    B, Hq, Hkv, D, S = 1, 8, 2, 64, 16
    args = (
        randn(rng, (B, Hq, D), jnp.float32),
        *(randn(rng, (B, Hkv, D), jnp.float32) for _ in range(2)),
        *caches(rng, Layout.SEQ_MAJOR, B, S, Hkv, D, jnp.float32),
        jnp.zeros((B,), jnp.int32),
    )

    def text(**kw):
        return jax.jit(lambda *a: gqa_decode(*a, layout="seq-major", **kw)).lower(*args).as_text()

    assert text(scale=0.125, window=4) == text(scale=np.float32(0.125), window=np.int64(4))
    assert text(softcap=5) == text(softcap=np.float64(5.0))


def test_decode_under_vmap(rng):
    """vmap over an extra leading axis runs the op per slice (vmap_method="sequential")."""
    N, B, Hq, Hkv, D, S = 3, 2, 8, 2, 64, 16
    layout = Layout.HEAD_MAJOR
    q = randn(rng, (N, B, Hq, D), jnp.float32)
    k, v = randn(rng, (N, B, Hkv, D), jnp.float32), randn(rng, (N, B, Hkv, D), jnp.float32)
    kc = randn(rng, (N, *layout.cache_shape(B, S, Hkv, D)), jnp.float32)
    vc = randn(rng, (N, *layout.cache_shape(B, S, Hkv, D)), jnp.float32)
    lengths = jnp.asarray(rng.integers(0, S, (N, B)), jnp.int32)
    out, _, _ = jax.vmap(lambda *a: gqa_decode(*a, layout=layout))(q, k, v, kc, vc, lengths)
    for n in range(N):
        ref, _, _ = gqa_decode_ref(q[n], k[n], v[n], kc[n], vc[n], lengths[n], layout=0)
        assert_close(out[n], ref, "float32")
