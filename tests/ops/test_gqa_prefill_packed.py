"""gqa_prefill_packed (issue 30, item 1): the new tokens of B sequences packed on one token axis
of N rows, sequence b's at rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1, against the float64
reference over ragged mixes (0 and 1 tokens, both sides of the 64- and 128-row tiles, past and
none, many short beside one long, padding rows, B = 1), both layouts, every dtype, window and
softcap; equal to gqa_prefill on the same data padded to [B, T]; bad input refused by name in
Python, latched per sequence on the device under jit.

Every check reads out at the packed rows and the caches at each sequence's own positions, with
sequences of different lengths side by side: an op that addressed sequence b at b * T (or
ignored cu_seqlens any other way) would put rows in the wrong place and fail them.

CPU cases run everywhere; the same cases on the CUDA handler (both prefill kernels: "auto",
wgmma for bf16/f16 at D 64 and 128 on an H200, and "mma") are marked gpu.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import DTYPES, HEAD_DIMS, HEADS, caches, randn
from reference import assert_close, gqa_packed_ref, unpack_rows

from jax_kv import Layout, _ffi, gqa_prefill, gqa_prefill_packed
from jax_kv.ops import _common

LAYOUTS = list(Layout)
layout_ids = lambda x: x.name  # noqa: E731
dtype_ids = lambda d: jnp.dtype(d).name  # noqa: E731

# Where a call runs: the CPU handler, or the CUDA handler with one of gqa_prefill's kernel
# choices (its `_kernel` hook).
PLATFORMS = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("cuda", "auto"), id="cuda-auto", marks=pytest.mark.gpu),
    pytest.param(("cuda", "mma"), id="cuda-mma", marks=pytest.mark.gpu),
]

# Ragged mixes: (new tokens per sequence, tokens cached before), padding rows after them.
MIXES = {
    # 0 and 1 token, both sides of the mma.sync kernel's 64-row tiles and the wgmma kernel's
    # 128-row ones; sequences with a past beside sequences without.
    "edges": ([0, 1, 63, 64, 65, 127, 128, 129], [5, 0, 0, 17, 0, 3, 0, 40]),
    # Many short sequences beside one long one (an engine step: decode-sized chunks and one
    # prompt chunk), the long one in the middle.
    "short-long": ([2, 1, 3, 0, 1, 200, 2, 1, 1, 3, 2, 1], [9, 30, 0, 4, 1, 60, 0, 7, 2, 0, 5, 80]),
    "one": ([37], [11]),  # B = 1
    "none": ([0, 0, 0], [4, 0, 9]),  # every row of out is padding
}
mix_ids = list(MIXES)


def put(platform, *xs):
    return jax.device_put(xs, jax.devices(platform)[0])


def cu_of(news) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(news)]).astype(np.int32)


def packed_inputs(rng, layout, dtype, news, pasts, *, Hq=8, Hkv=2, D=64, pad=7, room=5):
    """(q, k, v, k_cache, v_cache, lengths, cu_seqlens) for one mix: N = the mix's tokens +
    pad, S = the longest sequence + room (a stale tail the call must leave alone)."""
    news, pasts = np.asarray(news, np.int32), np.asarray(pasts, np.int32)
    cu = cu_of(news)
    N, S = int(cu[-1]) + pad, int((pasts + news).max()) + room
    q = randn(rng, (N, Hq, D), dtype)
    k, v = randn(rng, (N, Hkv, D), dtype), randn(rng, (N, Hkv, D), dtype)
    kc, vc = caches(rng, layout, len(news), S, Hkv, D, dtype)
    return q, k, v, kc, vc, jnp.asarray(pasts), jnp.asarray(cu)


def check_packed(platform, rng, layout, dtype, news, pasts, *, heads=(8, 2), D=64, pad=7, **kw):
    """One jitted call against the reference: out at the real rows within the dtype's
    tolerance (NaN never passes), padding rows exactly zero, status 0, the caches bit-exact
    (each sequence's new K/V at lengths[b] ..., everything else as it was)."""
    device, kernel = platform
    args = packed_inputs(rng, layout, dtype, news, pasts, Hq=heads[0], Hkv=heads[1], D=D, pad=pad)
    q, k, v, kc, vc, lengths, cu = args
    fn = jax.jit(
        lambda *a: gqa_prefill_packed(*a, layout=layout, return_status=True, _kernel=kernel, **kw)
    )
    out, kc2, vc2, status = fn(*put(device, *args))
    ref_out, ref_kc, ref_vc = gqa_packed_ref(
        q, k, v, kc, vc, np.asarray(lengths), np.asarray(cu), layout=int(layout), **kw
    )
    total = int(cu[-1])
    assert out.dtype == dtype and out.shape == q.shape
    assert np.asarray(status).tolist() == [0] * len(news)
    assert_close(out[:total], ref_out[:total], jnp.dtype(dtype).name, "out at the packed rows")
    assert not np.asarray(out[total:], np.float64).any(), "padding rows are not zero"
    np.testing.assert_array_equal(np.asarray(kc2, np.float64), ref_kc, err_msg="k_cache")
    np.testing.assert_array_equal(np.asarray(vc2, np.float64), ref_vc, err_msg="v_cache")


@pytest.mark.parametrize("mix", mix_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_packed_matches_reference(platform, rng, layout, dtype, mix):
    check_packed(platform, rng, layout, dtype, *MIXES[mix])


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_packed_heads(platform, rng, layout, heads):
    check_packed(platform, rng, layout, jnp.bfloat16, *MIXES["short-long"], heads=heads, D=128)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_packed_head_dims(platform, rng, dtype, D):
    news, pasts = [5, 0, 70, 1], [0, 3, 9, 130]
    check_packed(platform, rng, Layout.SEQ_MAJOR, dtype, news, pasts, D=D)


@pytest.mark.parametrize("window", [1, 7, 100])
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_packed_window_softcap(platform, rng, layout, window):
    mix = MIXES["edges"]
    check_packed(platform, rng, layout, jnp.bfloat16, *mix, window=window)
    check_packed(platform, rng, layout, jnp.float32, *mix, window=window, softcap=1.5, scale=0.3)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_packed_many_slots_few_tokens(platform, rng):
    # An engine-sized call: 64 slots, most with no token, one 300-token prompt chunk, N a
    # bucket well past the real tokens (every tile of the idle slots leaves early); the last
    # slot, which owns the padding rows, has none of its own.
    news = np.zeros(64, np.int32)
    news[[3, 17, 40, 62]] = [1, 300, 2, 1]
    pasts = rng.integers(0, 200, 64).astype(np.int32)
    check_packed(platform, rng, Layout.SEQ_MAJOR, jnp.bfloat16, news, pasts, heads=(32, 8), pad=212)


@pytest.mark.parametrize("mix", ["edges", "short-long", "one"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_packed_equals_padded(platform, rng, layout, dtype, mix):
    """The packed op and gqa_prefill on the same tokens laid out [B, T] (new_lengths = each
    sequence's count) give the same out rows and caches, bit for bit: one implementation."""
    device, kernel = platform
    news, pasts = MIXES[mix]
    q, k, v, kc, vc, lengths, cu = packed_inputs(rng, layout, dtype, news, pasts)
    T = max(news)
    padded = [jnp.asarray(unpack_rows(x, cu, T), dtype) for x in (q, k, v)]
    hooks = dict(layout=layout, _kernel=kernel, window=50)
    # Eager, with concrete values: the Python checks pass valid input through.
    out, kc_p, vc_p = gqa_prefill_packed(*put(device, q, k, v, kc, vc, lengths, cu), **hooks)
    ref, kc_r, vc_r = gqa_prefill(
        *put(device, *padded, kc, vc, lengths),
        new_lengths=jax.device_put(jnp.asarray(np.diff(cu)), jax.devices(device)[0]),
        **hooks,
    )
    for b in range(len(news)):
        np.testing.assert_array_equal(
            np.asarray(out[cu[b] : cu[b + 1]]), np.asarray(ref[b, : news[b]]), err_msg=f"b={b}"
        )
    assert not np.asarray(out[int(cu[-1]) :], np.float32).any()
    np.testing.assert_array_equal(np.asarray(kc_p), np.asarray(kc_r))
    np.testing.assert_array_equal(np.asarray(vc_p), np.asarray(vc_r))


def test_compiled_once_for_any_mix(rng):
    """cu_seqlens and lengths are data: one compiled call serves every mix of one (N, B)."""
    layout, traces = Layout.SEQ_MAJOR, []

    def step(*a):
        traces.append(1)
        return gqa_prefill_packed(*a, layout=layout)

    step = jax.jit(step, donate_argnums=(3, 4))
    q, k, v, kc, vc, _, _ = packed_inputs(
        rng, layout, jnp.float32, [20, 10, 0], [0, 0, 0], pad=0, room=20
    )
    for news, pasts in [
        ([20, 10, 0], [0, 0, 0]),
        ([1, 0, 29], [20, 10, 0]),
        ([0, 0, 0], [1, 2, 3]),
    ]:
        cu = cu_of(news)
        ref, ref_kc, _ = gqa_packed_ref(q, k, v, kc, vc, pasts, cu, layout=int(layout))
        out, kc, vc = step(q, k, v, kc, vc, jnp.asarray(pasts, jnp.int32), jnp.asarray(cu))
        assert_close(out, ref, "float32")
        np.testing.assert_array_equal(np.asarray(kc, np.float64), ref_kc)
    assert len(traces) == 1


# --- bad input: refused in Python by name, or latched on the device --------------------------

B, N, Hq, Hkv, D, S = 3, 12, 8, 2, 64, 16
LAYOUT = Layout.HEAD_MAJOR


@pytest.fixture
def args(rng):
    """A valid call: 3 sequences of 4, 0 and 5 new tokens over 2, 16 and 3 past, 3 padding
    rows."""
    q, k, v, kc, vc, _, _ = packed_inputs(
        rng, LAYOUT, jnp.float32, [4, 0, 5], [2, 16, 3], pad=3, room=0
    )
    assert q.shape == (N, Hq, D) and kc.shape == LAYOUT.cache_shape(B, S, Hkv, D)
    return dict(
        q=q,
        k=k,
        v=v,
        k_cache=kc,
        v_cache=vc,
        lengths=jnp.array([2, 16, 3], jnp.int32),
        cu_seqlens=jnp.array([0, 4, 4, 9], jnp.int32),
    )


def call_packed(a, **kw):
    names = ("q", "k", "v", "k_cache", "v_cache", "lengths", "cu_seqlens")
    return gqa_prefill_packed(*(a[n] for n in names), **{"layout": LAYOUT, **kw})


BAD = {
    "cu_seqlens shape [B]": (
        dict(cu_seqlens=jnp.array([0, 4, 4], jnp.int32)),
        r"cu_seqlens: expected int32 \[B\+1=4\], got int32 \[3\]",
    ),
    "cu_seqlens shape 2-d": (
        dict(cu_seqlens=jnp.array([[0, 4, 4, 9]], jnp.int32)),
        r"cu_seqlens: expected int32 \[B\+1=4\], got int32 \[1, 4\]",
    ),
    "cu_seqlens dtype": (
        dict(cu_seqlens=jnp.array([0, 4, 4, 9], jnp.float32)),
        r"cu_seqlens: expected int32 \[B\+1=4\], got float32 \[4\]",
    ),
    "cu_seqlens[0] != 0": (
        dict(cu_seqlens=jnp.array([1, 4, 4, 9], jnp.int32)),
        r"cu_seqlens: expected cu_seqlens\[0\] == 0, got 1",
    ),
    "cu_seqlens decreasing": (
        dict(cu_seqlens=jnp.array([0, 4, 3, 9], jnp.int32)),
        r"cu_seqlens: expected non-decreasing values, got cu_seqlens\[1\]=4 > cu_seqlens\[2\]=3",
    ),
    "cu_seqlens[B] > N": (
        dict(cu_seqlens=jnp.array([0, 4, 4, 13], jnp.int32)),
        r"cu_seqlens: expected cu_seqlens\[B=3\] <= N=12 \(the packed rows of q\), got 13",
    ),
    "lengths + new > S": (
        dict(lengths=jnp.array([2, 16, 12], jnp.int32)),
        r"lengths: expected 0 <= lengths\[b\] and lengths\[b\] \+ new tokens <= capacity S=16, "
        r"got lengths\[2\]=12 with 5 new tokens \(prefill would overflow the cache\)",
    ),
    "lengths negative": (
        dict(lengths=jnp.array([-1, 16, 3], jnp.int32)),
        r"lengths: expected 0 <= lengths\[b\] .* got lengths\[0\]=-1 with 4 new",
    ),
    "committed": (
        dict(committed=jnp.array([16, 16, 7], jnp.int32)),
        r"<= capacity S=16 and committed\[b\]=7, got lengths\[2\]=3 with 5 new tokens",
    ),
    "lengths shape": (
        dict(lengths=jnp.array([2, 16, 3, 0], jnp.int32)),
        r"lengths: expected int32 \[B=3\], got int32 \[4\]",
    ),
    "q rank": (dict(q=jnp.zeros((1, N, Hq, D))), r"q: expected rank 3 \[N, Hq, D\]"),
    "k rows": (dict(k=jnp.zeros((N + 1, Hkv, D))), r"k: expected \[N, Hkv, D\] = \[12, 2, 64\]"),
    "v per sequence": (dict(v=jnp.zeros((B, Hkv, D))), r"v: expected \[N, Hkv, D\]"),
    "cache head dim": (
        dict(v_cache=jnp.zeros(LAYOUT.cache_shape(B, S, Hkv, 128))),
        r"v_cache: expected the shape of k_cache",
    ),
    "no sequences": (
        dict(
            k_cache=jnp.zeros(LAYOUT.cache_shape(0, S, Hkv, D)),
            v_cache=jnp.zeros(LAYOUT.cache_shape(0, S, Hkv, D)),
        ),
        r"k_cache: expected B >= 1 sequences",
    ),
    "window": (dict(window=0), r"window: expected an int > 0 or None, got 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_packed_refuses(args, case):
    changes, match = BAD[case]
    before = {n: np.asarray(args[n]).copy() for n in ("k_cache", "v_cache")}
    bad = {**args, **{k: v for k, v in changes.items() if k in args}}
    kw = {k: v for k, v in changes.items() if k not in args}
    with pytest.raises(ValueError, match=match):
        jax.block_until_ready(call_packed(bad, **kw))
    for n, x in before.items():
        np.testing.assert_array_equal(np.asarray(args[n]), x, err_msg=f"{n} changed")
    jax.block_until_ready(call_packed(args))  # the valid call it was made from passes


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(cu_seqlens=jnp.array([0, 4, 4], jnp.int32)),
            r"cu_seqlens: expected int32 \[B \+ 1=4\]",
        ),
        (dict(k=jnp.zeros((N - 1, Hkv, D))), r"k: expected \[N, Hkv, D\] matching q"),
        (dict(q=jnp.zeros((N, Hq + 1, D))), r"q: expected a multiple of Hkv=2 query heads"),
    ],
    ids=["cu_seqlens shape", "k rows", "head ratio"],
)
def test_handler_refuses_by_name(args, change, match):
    """Past the Python checks (a direct FFI call), the C++ handler refuses by name too."""
    _ffi.register()
    a = {**args, **change}
    attrs = _common.attention_attrs(LAYOUT, D, None, None, None)
    attrs["kernel"] = np.int32(0)
    names = ("q", "k", "v", "k_cache", "v_cache", "lengths", "cu_seqlens")
    call = (*(a[n] for n in names), jnp.full((B,), S, jnp.int32))
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_common.call_attention("prefill_packed", call, attrs, (0,), False))


def latched_call(platform, a, lengths, cu_seqlens, committed=None):
    """The call jitted with the caches donated (values traced: no Python check), returning
    (out, k_cache, v_cache, status) as NumPy arrays."""
    device, kernel = platform
    step = jax.jit(
        lambda q, k, v, kc, vc, n, cu, c: gqa_prefill_packed(
            q, k, v, kc, vc, n, cu, committed=c, layout=LAYOUT, return_status=True,
            _kernel=kernel,
        ),
        donate_argnums=(3, 4),
    )  # fmt: skip
    committed = jnp.full((B,), S, jnp.int32) if committed is None else committed
    # Fresh device copies: the call donates the caches, and on the GPU `put` of an array already
    # there would hand over the fixture's own buffers.
    host = (np.asarray(a[n]) for n in ("q", "k", "v", "k_cache", "v_cache"))
    xs = put(device, *host)
    xs += put(device, lengths, cu_seqlens, committed)
    return tuple(np.asarray(x) for x in step(*xs))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_traced_bad_rows_latched(platform, args):
    """Sequence 0 overflows S, sequence 2 its commit: both latch status 1, their rows of out
    are NaN, their caches untouched; sequence 1 (full, no new token) and the padding rows are
    as for a valid call; the same sequences in a valid call are computed as the reference."""
    kc, vc = np.asarray(args["k_cache"]), np.asarray(args["v_cache"])
    lengths = jnp.array([13, 16, 3], jnp.int32)
    committed = jnp.array([16, 16, 7], jnp.int32)
    out, kc2, vc2, status = latched_call(platform, args, lengths, args["cu_seqlens"], committed)
    assert status.tolist() == [1, 0, 1]
    assert np.isnan(out[:9]).all(), "refused sequences' rows (0..3 and 4..8) must be NaN"
    assert not out[9:].any(), "padding rows are not zero"
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)
    # The same call with room: sequences 0 and 2 computed, at their own rows and positions.
    out, kc2, vc2, status = latched_call(platform, args, args["lengths"], args["cu_seqlens"])
    assert status.tolist() == [0, 0, 0]
    ref, ref_kc, ref_vc = gqa_packed_ref(
        args["q"], args["k"], args["v"], kc, vc, [2, 16, 3], [0, 4, 4, 9], layout=int(LAYOUT)
    )
    assert_close(out[:9], ref[:9], "float32")
    assert not out[9:].any()
    np.testing.assert_array_equal(kc2, ref_kc)
    np.testing.assert_array_equal(vc2, ref_vc)


@pytest.mark.parametrize(
    "cu",
    [[1, 4, 4, 9], [0, 4, 3, 9], [0, 4, 4, 13], [0, -2, 4, 9], [0, 9, 4, 9], [0, 4, 4, -1]],
    ids=["cu0-not-0", "decreasing", "past-N", "negative", "overlap", "last-negative"],
)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_traced_malformed_cu_seqlens_latched(platform, args, cu):
    """A malformed cu_seqlens gives no sequence a row range: every sequence latches status 3,
    all of out is NaN and no cache is written (nothing is read or written out of bounds)."""
    kc, vc = np.asarray(args["k_cache"]), np.asarray(args["v_cache"])
    out, kc2, vc2, status = latched_call(
        platform, args, args["lengths"], jnp.asarray(cu, jnp.int32)
    )
    assert status.tolist() == [3, 3, 3]
    assert np.isnan(out).all()
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)
