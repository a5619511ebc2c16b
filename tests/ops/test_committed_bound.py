"""Writes are bounded by committed memory, not by the array's shape (issue 19, item 3).

A seq-major VMM view is exported at max_len with only its live prefix committed; while a
compiled step is kept across growth, the committed capacity is per-step data (`committed`,
int32 [B]). A row whose lengths would write at or past committed[b] latches status 1: output
NaN, cache untouched, other rows computed. A row with committed[b] == 0 is idle (an engine's
free slot): never read or written, output zeros, status 0. The CPU handler and the CUDA
kernels agree.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import caches, randn
from reference import assert_close, gqa_attention_ref, gqa_decode_ref

from jax_kv import Layout, gqa_decode, gqa_prefill

B, Hq, Hkv, D, S, T = 4, 8, 2, 64, 64, 8


def platforms():
    out = [pytest.param("cpu", id="cpu")]
    out.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
    return out


def put(platform, *xs):
    return jax.device_put(xs, jax.devices(platform)[0])


@pytest.mark.parametrize("platform", platforms())
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_decode_bounded_by_committed(rng, platform, layout, dtype):
    q = randn(rng, (B, Hq, D), dtype)
    k, v = randn(rng, (B, Hkv, D), dtype), randn(rng, (B, Hkv, D), dtype)
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    # Row 0: one below its commit (ok); row 1: at it (refused); row 2: past it; row 3: idle.
    committed = np.array([16, 16, 32, 0], np.int32)
    lengths = np.array([15, 16, 40, 0], np.int32)
    step = jax.jit(
        lambda *a: gqa_decode(*a[:6], committed=a[6], layout=layout, return_status=True),
        donate_argnums=(3, 4),
    )
    before = np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    args = put(platform, q, k, v, kc, vc, jnp.asarray(lengths), jnp.asarray(committed))
    out, kc2, vc2, status = step(*args)
    assert np.asarray(status).tolist() == [0, 1, 1, 0]
    out = np.asarray(out, np.float32)
    assert np.isnan(out[1:3]).all() and np.isfinite(out[0]).all() and (out[3] == 0).all()
    ref_out, ref_kc, ref_vc = gqa_decode_ref(
        q[:1], k[:1], v[:1], before[0][:1], before[1][:1], [15], layout=int(layout)
    )
    assert_close(out[:1], ref_out, jnp.dtype(dtype).name)
    np.testing.assert_array_equal(np.asarray(kc2[:1], np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc2[:1], np.float64), ref_vc)
    np.testing.assert_array_equal(np.asarray(kc2[1:], np.float64), before[0][1:])
    np.testing.assert_array_equal(np.asarray(vc2[1:], np.float64), before[1][1:])


@pytest.mark.parametrize("platform", platforms())
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_prefill_bounded_by_committed(rng, platform, layout):
    dtype = jnp.bfloat16
    q = randn(rng, (B, T, Hq, D), dtype)
    k, v = randn(rng, (B, T, Hkv, D), dtype), randn(rng, (B, T, Hkv, D), dtype)
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    # Row 0 fills its commit exactly (ok); row 1 passes it by one; row 2 writes nothing past
    # a full commit (ok: 0 new tokens); row 3 is idle (committed 0): its token is not written.
    past = np.array([8, 9, 16, 0], np.int32)
    new = np.array([8, 8, 0, 1], np.int32)
    committed = np.array([16, 16, 16, 0], np.int32)
    step = jax.jit(
        lambda *a: gqa_prefill(
            *a[:6], new_lengths=a[6], committed=a[7], layout=layout, return_status=True
        )
    )
    args = put(platform, q, k, v, kc, vc, *map(jnp.asarray, (past, new, committed)))
    out, kc2, vc2, status = step(*args)
    assert np.asarray(status).tolist() == [0, 1, 0, 0]
    out = np.asarray(out, np.float32)
    assert np.isnan(out[1]).all()
    assert (out[2:] == 0).all()
    ref_out, ref_kc, _ = gqa_attention_ref(
        q[:1], k[:1], v[:1], kc[:1], vc[:1], [8], [8], layout=int(layout)
    )
    assert_close(out[:1], ref_out, "bfloat16")
    np.testing.assert_array_equal(np.asarray(kc2[:1], np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(kc2[1:]), np.asarray(kc[1:]))
    np.testing.assert_array_equal(np.asarray(vc2[1:]), np.asarray(vc[1:]))


@pytest.mark.parametrize("platform", platforms())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", ["decode", "prefill_packed"])
def test_idle_rows_are_not_read_or_written(rng, platform, dtype, op):
    """committed[b] == 0: row b is idle whatever its lengths (garbage here: -7 and 10**6) or
    its new tokens. Its cache is NaN, so a read of it would reach its own output (zeros are
    asserted) and a write would change it; the live rows match the reference."""
    layout = Layout.SEQ_MAJOR
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    idle = [1, 3]
    kc, vc = kc.at[jnp.array(idle)].set(jnp.nan), vc.at[jnp.array(idle)].set(jnp.nan)
    lengths = np.array([5, -7, 0, 10**6], np.int32)
    committed = np.array([16, 0, S, 0], np.int32)
    before = np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    if op == "decode":
        q = randn(rng, (B, Hq, D), dtype)
        k, v = randn(rng, (B, Hkv, D), dtype), randn(rng, (B, Hkv, D), dtype)
        fn = lambda *a: gqa_decode(*a[:6], committed=a[6], layout=layout, return_status=True)  # noqa: E731
        extra = ()
        new = np.ones((B,), np.int32)
    else:
        from jax_kv.ops import gqa_prefill_packed

        new = np.array([3, 2, 4, 1], np.int32)  # the idle rows are given tokens too
        N = int(new.sum()) + 2  # two padding rows
        q = randn(rng, (N, Hq, D), dtype)
        k, v = randn(rng, (N, Hkv, D), dtype), randn(rng, (N, Hkv, D), dtype)
        cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)

        def fn(*a):
            return gqa_prefill_packed(
                *a[:6], a[7], committed=a[6], layout=layout, return_status=True
            )

        extra = (jnp.asarray(cu),)
    step = jax.jit(fn, donate_argnums=(3, 4))
    args = put(platform, q, k, v, kc, vc, jnp.asarray(lengths), jnp.asarray(committed), *extra)
    out, kc2, vc2, status = step(*args)
    assert np.asarray(status).tolist() == [0, 0, 0, 0]
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any()
    kc2, vc2 = np.asarray(kc2, np.float64), np.asarray(vc2, np.float64)
    np.testing.assert_array_equal(kc2[idle], before[0][idle])  # NaN == NaN here: untouched
    np.testing.assert_array_equal(vc2[idle], before[1][idle])
    for b in (0, 2):
        if op == "decode":
            rows = out[b : b + 1]
            ref = gqa_decode_ref(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], before[0][b : b + 1],
                before[1][b : b + 1], [int(lengths[b])], layout=int(layout),
            )  # fmt: skip
        else:
            r0, r1 = int(cu[b]), int(cu[b + 1])
            rows = out[r0:r1][None]
            ref = gqa_attention_ref(
                q[None, r0:r1], k[None, r0:r1], v[None, r0:r1], before[0][b : b + 1],
                before[1][b : b + 1], [int(lengths[b])], [int(new[b])], layout=int(layout),
            )  # fmt: skip
        assert_close(rows, ref[0], jnp.dtype(dtype).name)
        np.testing.assert_array_equal(kc2[b : b + 1], ref[1])
        np.testing.assert_array_equal(vc2[b : b + 1], ref[2])
    if op == "decode":
        assert (out[idle] == 0).all()
    else:
        for b in idle:
            assert (out[int(cu[b]) : int(cu[b + 1])] == 0).all()


def test_concrete_values_refused_in_python(rng):
    layout = Layout.SEQ_MAJOR
    q = randn(rng, (B, Hq, D), jnp.float32)
    k = randn(rng, (B, Hkv, D), jnp.float32)
    kc, vc = caches(rng, layout, B, S, Hkv, D, jnp.float32)
    before = np.asarray(kc).copy()
    lengths = jnp.array([0, 1, 2, 3], jnp.int32)
    with pytest.raises(
        ValueError,
        match=r"lengths: expected 0 <= lengths\[b\] < capacity S=64 and committed\[b\]=2, "
        r"got lengths\[2\]=2",
    ):
        gqa_decode(
            q, k, k, kc, vc, lengths, committed=jnp.array([4, 4, 2, 4], jnp.int32), layout=layout
        )
    with pytest.raises(ValueError, match=r"committed: expected >= 0 tokens .* committed\[0\]=-1"):
        gqa_decode(
            q, k, k, kc, vc, lengths, committed=jnp.array([-1, 4, 4, 4], jnp.int32), layout=layout
        )
    with pytest.raises(ValueError, match=r"committed: expected int32 \[B=4\], got int32 \[3\]"):
        gqa_decode(q, k, k, kc, vc, lengths, committed=jnp.zeros((3,), jnp.int32), layout=layout)
    with pytest.raises(ValueError, match=r"committed: expected int32 \[B=4\], got float32"):
        gqa_decode(q, k, k, kc, vc, lengths, committed=jnp.zeros((4,), jnp.float32), layout=layout)
    qp = randn(rng, (B, T, Hq, D), jnp.float32)
    kp = randn(rng, (B, T, Hkv, D), jnp.float32)
    with pytest.raises(
        ValueError, match=r"<= capacity S=64 and committed\[b\]=8, got lengths\[0\]"
    ):
        gqa_prefill(
            qp, kp, kp, kc, vc, jnp.array([1, 0, 0, 0], jnp.int32),
            committed=jnp.full((B,), 8, jnp.int32), layout=layout,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(kc), before)
