"""The CUDA handlers against the CPU handlers and the float64 reference: both layouts, every
dtype, GQA ratios 1..8 and 7, head dims, lengths at split-chunk edges, ragged prefill, window,
softcap; the device-side status path; the host-call counter as the CUDA-graph replay signal.
Every decode test runs once per decode kernel choice and CTA shape (the `decode_kernel`
fixture: "auto", which runs the tensor-core kernel mma for bf16/f16 at D <= 128 and the
CUDA-core kernel simt elsewhere, and "simt" forced everywhere, each with narrow and with wide
CTAs, which the auto rule picks for only some of the shapes; and both kernels with the
batch-invariant mode's fixed split count). The choices are gqa_decode's and
gqa_prefill's test hooks: attributes of the compiled call, so no test clears jax's caches.

Run twice, with command buffers forced on (XLA_FLAGS=--xla_gpu_graph_min_graph_size=1) and
off (--xla_gpu_enable_command_buffer=); the counter test starts its own processes for both.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import DTYPES, HEAD_DIMS, HEADS, caches, cuda_module, randn
from reference import (
    TOL,
    assert_close,
    gqa_attention_ref,
    gqa_decode_ref,
    grow_cache_ref,
)

from jax_kv import Layout, gqa_decode, gqa_prefill, grow_cache
from jax_kv.ops._common import CTA_SHAPES, DECODE_KERNELS, PREFILL_KERNELS
from jax_kv.ops.gqa_decode import BATCH_INVARIANT_SPLITS

pytestmark = pytest.mark.gpu
LAYOUTS = list(Layout)
layout_ids = lambda x: x.name  # noqa: E731
dtype_ids = lambda d: jnp.dtype(d).name  # noqa: E731


@pytest.fixture(
    params=[
        ("auto", "narrow", "pool", 0),
        ("auto", "wide", "pool", 0),
        ("simt", "narrow", "pool", 0),
        ("simt", "wide", "pool", 0),
        ("simt", "narrow", "workspace", 0),
        ("auto", "wide", "workspace", 0),
        ("auto", "auto", "pool", BATCH_INVARIANT_SPLITS),
        ("simt", "auto", "pool", BATCH_INVARIANT_SPLITS),
    ],
    ids=lambda k: (
        f"{k[0]}-{k[1]}"
        + ("-ws" if k[2] == "workspace" else "")
        + (f"-splits{k[3]}" if k[3] else "")
    ),
)
def decode_kernel(request):
    """gqa_decode's kernel hooks for one test: the kernel choice, the CTA shape, where the
    split counters live (the pool, or the workspace zeroed per launch) and the split count
    (0: planned from the batch; the batch-invariant mode's fixed count)."""
    kernel, shape, counters, splits = request.param
    return dict(_kernel=kernel, _cta_shape=shape, _split_counters=counters, _splits=splits)


@pytest.fixture(params=PREFILL_KERNELS, ids=lambda k: f"prefill-{k}")
def prefill_kernel(request):
    """gqa_prefill's kernel hook for one test ('auto': wgmma for bf16/f16 at head dims 64 and
    128 on this H200, asserted; 'mma': the mma.sync kernel)."""
    mod = cuda_module()
    if request.param == "auto" and jax.devices("cuda")[0].compute_capability == "9.0":
        assert mod.prefill_uses_wgmma(128, 2, 0) and mod.prefill_uses_wgmma(64, 2, 0)
        assert not mod.prefill_uses_wgmma(96, 2, 0) and not mod.prefill_uses_wgmma(128, 4, 0)
        assert not mod.prefill_uses_wgmma(128, 2, 1)
    return dict(_kernel=request.param)


def decode_plan(B, Hq, Hkv, D, dtype, hooks=None):
    """The plan of the decode call with these hooks on this GPU: {"kernel": "mma" or "simt",
    "num_splits", "chunk_multiple", "min_chunk", "workspace_floats"}."""
    hooks = hooks or {}
    kernel = DECODE_KERNELS.index(hooks.get("_kernel", "auto"))
    shape = CTA_SHAPES.index(hooks.get("_cta_shape", "auto"))
    splits = hooks.get("_splits") or 0
    return cuda_module().decode_plan(
        B, Hq, Hkv, D, jnp.dtype(dtype).itemsize, kernel, shape, splits
    )


def on_cpu(fn, *args, **kw):
    """The same jitted function on the CPU handlers (inputs committed to the CPU device)."""
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*jax.device_put(args, cpu), **jax.device_put(kw, cpu))


def on_gpu(fn, *args, **kw):
    gpu = jax.devices("cuda")[0]
    return jax.jit(fn)(*jax.device_put(args, gpu), **jax.device_put(kw, gpu))


def decode_lengths(rng, B, S, plan):
    """0, 1, S - 1, both sides of the minimum split chunk (L = min_chunk leaves the new token
    alone in split 1), both sides of the chunk the splits give at S - 1, random. `plan` is
    the call's decode_plan()."""
    num_splits, multiple, min_chunk = (
        plan[k] for k in ("num_splits", "chunk_multiple", "min_chunk")
    )
    chunk = -(-S // max(1, num_splits))
    chunk = max(min_chunk, -(-chunk // multiple) * multiple)
    fixed = [0, 1, S - 1, min_chunk - 1, min_chunk, chunk - 1, chunk, 2 * chunk]
    vals = [fixed[i] if i < len(fixed) else int(rng.integers(0, S)) for i in range(B)]
    return np.minimum(np.asarray(vals, np.int32), S - 1)


def check_decode(rng, layout, dtype, Hq, Hkv, D, *, S=1024, B=8, hooks=None, **kw):
    plan = decode_plan(B, Hq, Hkv, D, dtype, hooks)
    q = randn(rng, (B, Hq, D), dtype)
    k, v = randn(rng, (B, Hkv, D), dtype), randn(rng, (B, Hkv, D), dtype)
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
    lengths = jnp.asarray(decode_lengths(rng, B, S, plan))

    def fn(*a):
        return gqa_decode(*a, layout=layout, **kw, **(hooks or {}))

    out, kc2, vc2 = on_gpu(fn, q, k, v, kc, vc, lengths)
    cpu_out, _, _ = on_cpu(fn, q, k, v, kc, vc, lengths)
    ref_out, ref_kc, ref_vc = gqa_decode_ref(
        q, k, v, kc, vc, np.asarray(lengths), layout=int(layout), **kw
    )
    name = jnp.dtype(dtype).name
    assert out.dtype == dtype and out.shape == (B, Hq, D)
    err = assert_close(out, ref_out, name, "out vs float64 reference")
    assert_close(out, np.asarray(cpu_out, np.float64), name, "out vs CPU handler")
    np.testing.assert_array_equal(np.asarray(kc2, np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc2, np.float64), ref_vc)
    return err


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_decode_matches_cpu_and_reference(decode_kernel, rng, layout, dtype, heads):
    check_decode(rng, layout, dtype, *heads, D=128, hooks=decode_kernel)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_decode_head_dims(decode_kernel, rng, layout, dtype, D):
    check_decode(rng, layout, dtype, 28, 4, D, S=512, B=6, hooks=decode_kernel)


@pytest.mark.parametrize("heads", [(64, 4), (8, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_decode_large_groups(decode_kernel, rng, heads):
    # 16 query heads per KV head take two head chunks of 8; MQA with 8.
    check_decode(rng, Layout.SEQ_MAJOR, jnp.bfloat16, *heads, D=64, S=256, B=3, hooks=decode_kernel)


@pytest.mark.parametrize("window", [1, 7, 100, 1000])
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_decode_window(decode_kernel, rng, layout, window):
    check_decode(rng, layout, jnp.bfloat16, 32, 8, 128, window=window, hooks=decode_kernel)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_decode_softcap_and_scale(decode_kernel, rng, layout):
    check_decode(rng, layout, jnp.float32, 8, 2, 128, softcap=2.0, scale=0.5, hooks=decode_kernel)
    check_decode(rng, layout, jnp.float16, 8, 2, 128, softcap=30.0, window=16, hooks=decode_kernel)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_decode_many_splits(decode_kernel, rng, layout):
    # S - 1 live tokens spread over every split the plan has (over 16: the merge reads 16
    # splits per round, so this takes its remainder path too).
    B, Hq, Hkv, D = 3, 32, 8, 128  # lengths 0, 1 and S - 1 (decode_lengths)
    plan = decode_plan(B, Hq, Hkv, D, jnp.bfloat16, decode_kernel)
    splits, multiple, min_chunk = plan["num_splits"], plan["chunk_multiple"], plan["min_chunk"]
    if splits <= 16:
        pytest.skip(f"this GPU plans {splits} splits at B={B}")
    S = splits * max(min_chunk, multiple) + 1
    check_decode(rng, layout, jnp.bfloat16, Hq, Hkv, D, S=S, B=B, hooks=decode_kernel)


def test_decode_large_capacity_few_live(decode_kernel, rng):
    # 131072 slots, 1024 live: the grid follows lengths, never S.
    B, Hq, Hkv, D, S = 1, 32, 8, 128, 131072
    q = randn(rng, (B, Hq, D), jnp.bfloat16)
    k, v = randn(rng, (B, Hkv, D), jnp.bfloat16), randn(rng, (B, Hkv, D), jnp.bfloat16)
    kc, vc = caches(rng, Layout.SEQ_MAJOR, B, S, Hkv, D, jnp.bfloat16)
    lengths = jnp.asarray([1023], jnp.int32)
    out, kc2, _ = on_gpu(
        lambda *a: gqa_decode(*a, layout=Layout.SEQ_MAJOR, **decode_kernel),
        q,
        k,
        v,
        kc,
        vc,
        lengths,
    )
    live = slice(0, 1024)
    ref_out, ref_kc, _ = gqa_decode_ref(
        q, k, v, kc[:, live], vc[:, live], np.asarray(lengths), layout=1
    )
    assert_close(out, ref_out, "bfloat16")
    np.testing.assert_array_equal(np.asarray(kc2[:, live], np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(kc2[:, 1024:]), np.asarray(kc[:, 1024:]))


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_decode_split_counters_stay_zero(rng, kernel):
    # The pool's counters are zero at every launch only if the last CTA of each split group
    # resets its word. Two lengths that merge different numbers of splits, alternated over
    # more calls than the pool has regions of this size: with command buffers off every call
    # takes the next region and the pool comes round again (kCounterPoolWords / 32 = 8192
    # calls); with them on, each recorded graph replays its own region. Any word left non-zero
    # makes a later launch pick the wrong last CTA: its output would differ from the first.
    hooks = dict(_kernel=kernel, _split_counters="pool")
    B, Hq, Hkv, D, S = 1, 8, 1, 128, 4096
    plan = decode_plan(B, Hq, Hkv, D, jnp.bfloat16, hooks)
    splits, multiple, min_chunk = plan["num_splits"], plan["chunk_multiple"], plan["min_chunk"]
    assert plan["kernel"] == kernel
    assert splits > 2, f"expected a split plan at B*Hkv=1, got {splits} splits"
    gpu = jax.devices("cuda")[0]
    q = jax.device_put(randn(rng, (B, Hq, D), jnp.bfloat16), gpu)
    k, v = (jax.device_put(randn(rng, (B, Hkv, D), jnp.bfloat16), gpu) for _ in range(2))
    kc, vc = jax.device_put(caches(rng, Layout.SEQ_MAJOR, B, S, Hkv, D, jnp.bfloat16), gpu)
    chunk = max(min_chunk, multiple)
    lens = [jax.device_put(jnp.asarray([n], jnp.int32), gpu) for n in (S - 1, 2 * chunk)]
    args = (q, k, v, kc, vc)  # the same buffers every call: a recorded graph replays
    step = jax.jit(lambda *a: gqa_decode(*a, layout=Layout.SEQ_MAJOR, **hooks)[0])
    first = [np.asarray(step(*args, n)) for n in lens]
    for i, n in enumerate(lens):
        ref, _, _ = gqa_decode_ref(q, k, v, kc, vc, np.asarray(n), layout=1)
        assert_close(first[i], ref, "bfloat16", f"lengths {int(n[0])}")
    kept = []
    for i in range(8400):
        out = step(*args, lens[i % 2])
        if i % 700 < 2 or i >= 8396:
            kept.append((i % 2, out))
    for which, out in kept:
        np.testing.assert_array_equal(np.asarray(out), first[which])


def test_split_counter_regions_are_disjoint():
    # Regions handed out in turn never overlap until the pool comes round, never leave the pool,
    # and a too-large call gets -1 (the workspace path). Mixed sizes make regions
    # meet the pool's end: there the tail is skipped (an earlier version restarted at 0 and
    # gave two consecutive launches the same words).
    mod = cuda_module()
    pool = mod.split_counter_pool_words
    sizes = [1, 33, pool // 64, 100, 2000, 65, 31, 4000]
    got = []
    for i in range(40_000):
        n = sizes[i % len(sizes)]
        start, words = mod._take_counter_region(n), -(-n // 32) * 32
        assert 0 <= start and start + words <= pool and start % 32 == 0, (n, start)
        got.append((start, words))
    for i, (a, wa) in enumerate(got):
        total = 0
        for b, wb in got[i + 1 :]:
            total += wb
            if total > pool // 2:
                break
            assert b + wb <= a or a + wa <= b, f"call {i}: [{a}, +{wa}) meets [{b}, +{wb})"
    assert mod._take_counter_region(pool // 64 + 1) == -1


def check_prefill(rng, layout, dtype, Hq, Hkv, D, *, T=70, S=200, hooks=None, **kw):
    # Sequences: no past + full prompt, past + empty prompt, past up to S - T, one token,
    # ragged random.
    past = np.array([0, 5, S - T, 1, int(rng.integers(0, S - T + 1))], np.int32)
    new = np.array([T, 0, T, 1, int(rng.integers(0, T + 1))], np.int32)
    B = len(past)
    q = randn(rng, (B, T, Hq, D), dtype)
    k, v = randn(rng, (B, T, Hkv, D), dtype), randn(rng, (B, T, Hkv, D), dtype)
    kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)

    def fn(q, k, v, kc, vc, past, new):
        return gqa_prefill(
            q, k, v, kc, vc, past, new_lengths=new, layout=layout, **kw, **(hooks or {})
        )

    args = (q, k, v, kc, vc, jnp.asarray(past), jnp.asarray(new))
    out, kc2, vc2 = on_gpu(fn, *args)
    cpu_out, _, _ = on_cpu(fn, *args)
    ref_out, ref_kc, ref_vc = gqa_attention_ref(
        q, k, v, kc, vc, past, new, layout=int(layout), **kw
    )
    name = jnp.dtype(dtype).name
    assert out.dtype == dtype and out.shape == (B, T, Hq, D)
    err = assert_close(out, ref_out, name, "out vs float64 reference")
    assert_close(out, np.asarray(cpu_out, np.float64), name, "out vs CPU handler")
    for b in range(B):  # rows past new_lengths[b] are exactly zero
        assert not np.asarray(out[b, new[b] :], np.float64).any()
    np.testing.assert_array_equal(np.asarray(kc2, np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc2, np.float64), ref_vc)
    return err


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_prefill_matches_cpu_and_reference(prefill_kernel, rng, layout, dtype, heads):
    check_prefill(rng, layout, dtype, *heads, D=128, hooks=prefill_kernel)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_prefill_head_dims(prefill_kernel, rng, layout, dtype, D):
    check_prefill(rng, layout, dtype, 8, 2, D, T=33, S=120, hooks=prefill_kernel)


@pytest.mark.parametrize("window", [1, 7, 100])
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_prefill_window(prefill_kernel, rng, layout, window):
    check_prefill(
        rng, layout, jnp.bfloat16, 32, 8, 128, T=130, S=400, window=window, hooks=prefill_kernel
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_prefill_softcap_and_scale(prefill_kernel, rng, layout):
    check_prefill(
        rng, layout, jnp.bfloat16, 8, 2, 128, softcap=2.0, scale=0.5, hooks=prefill_kernel
    )
    check_prefill(rng, layout, jnp.float32, 8, 2, 64, softcap=30.0, window=16, hooks=prefill_kernel)


def test_prefill_long_past(prefill_kernel, rng):
    # Many key blocks from the cache, then the diagonal blocks from k/v.
    check_prefill(
        rng, Layout.HEAD_MAJOR, jnp.float16, 32, 8, 128, T=150, S=1400, hooks=prefill_kernel
    )


@pytest.mark.parametrize("window", [None, 77], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_prefill_many_query_blocks(prefill_kernel, rng, layout, window):
    # Three 128-row query blocks (both of the wgmma kernel's warpgroups live, then one idle), a
    # window that ends inside a warpgroup, keys from the cache and from k/v in one block.
    check_prefill(
        rng, layout, jnp.bfloat16, 16, 2, 64, T=300, S=900, window=window, hooks=prefill_kernel
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_ids)
def test_grow_cache_matches_cpu_and_reference(rng, layout, dtype):
    B, Hkv, D, S, S_new = 4, 2, 80, 64, 200
    cache = randn(rng, layout.cache_shape(B, S, Hkv, D), dtype)
    lengths = jnp.asarray([0, 1, S, 37], jnp.int32)

    def fn(c, n):
        return grow_cache(c, n, S_new, layout=layout)

    grown = on_gpu(fn, cache, lengths)
    np.testing.assert_array_equal(
        np.asarray(grown, np.float64),
        grow_cache_ref(cache, np.asarray(lengths), S_new, layout=int(layout)),
    )
    np.testing.assert_array_equal(np.asarray(grown), np.asarray(on_cpu(fn, cache, lengths)))


# --- device-side bounds: status latched, cache untouched, out NaN --------------------------


def test_decode_status_out_of_range(decode_kernel, rng):
    layout, B, Hq, Hkv, D, S = Layout.HEAD_MAJOR, 3, 8, 2, 64, 96
    q = randn(rng, (B, Hq, D), jnp.bfloat16)
    k, v = randn(rng, (B, Hkv, D), jnp.bfloat16), randn(rng, (B, Hkv, D), jnp.bfloat16)
    kc, vc = caches(rng, layout, B, S, Hkv, D, jnp.bfloat16)
    lengths = jnp.asarray([-1, S, 40], jnp.int32)  # traced under jit: no Python check
    out, kc2, vc2, status = on_gpu(
        lambda *a: gqa_decode(*a, layout=layout, return_status=True, **decode_kernel),
        *(q, k, v, kc, vc, lengths),
    )
    assert np.asarray(status).tolist() == [1, 1, 0]
    assert np.isnan(np.asarray(out[:2], np.float32)).all()
    ref_out, ref_kc, _ = gqa_decode_ref(q[2:], k[2:], v[2:], kc[2:], vc[2:], [40], layout=0)
    assert_close(out[2:], ref_out, "bfloat16")
    np.testing.assert_array_equal(np.asarray(kc2[:2]), np.asarray(kc[:2]))
    np.testing.assert_array_equal(np.asarray(vc2[:2]), np.asarray(vc[:2]))
    np.testing.assert_array_equal(np.asarray(kc2[2:], np.float64), ref_kc)


def test_prefill_status_out_of_range(prefill_kernel, rng):
    layout, B, T, Hq, Hkv, D, S = Layout.SEQ_MAJOR, 3, 8, 8, 2, 64, 40
    q = randn(rng, (B, T, Hq, D), jnp.float16)
    k, v = randn(rng, (B, T, Hkv, D), jnp.float16), randn(rng, (B, T, Hkv, D), jnp.float16)
    kc, vc = caches(rng, layout, B, S, Hkv, D, jnp.float16)
    past = jnp.asarray([0, S - 2, 3], jnp.int32)
    new = jnp.asarray([T + 1, 3, 5], jnp.int32)  # new_lengths > T; S - 2 + 3 > S; ok
    out, kc2, vc2, status = on_gpu(
        lambda q, k, v, kc, vc, p, n: gqa_prefill(
            q, k, v, kc, vc, p, new_lengths=n, layout=layout, return_status=True, **prefill_kernel
        ),
        q,
        k,
        v,
        kc,
        vc,
        past,
        new,
    )
    assert np.asarray(status).tolist() == [2, 1, 0]
    assert np.isnan(np.asarray(out[:2], np.float32)).all()
    np.testing.assert_array_equal(np.asarray(kc2[:2]), np.asarray(kc[:2]))
    np.testing.assert_array_equal(np.asarray(vc2[:2]), np.asarray(vc[:2]))
    ref_out, ref_kc, _ = gqa_attention_ref(q[2:], k[2:], v[2:], kc[2:], vc[2:], [3], [5], layout=1)
    assert_close(out[2:], ref_out, "float16")
    np.testing.assert_array_equal(np.asarray(kc2[2:], np.float64), ref_kc)


def test_grow_status_out_of_range(rng):
    layout, B, Hkv, D, S, S_new = Layout.HEAD_MAJOR, 3, 2, 64, 16, 32
    cache = randn(rng, layout.cache_shape(B, S, Hkv, D), jnp.float32)
    cuda_module()
    call = jax.ffi.ffi_call(
        "jax_kv_grow_cache",
        (
            jax.ShapeDtypeStruct(layout.cache_shape(B, S_new, Hkv, D), jnp.float32),
            jax.ShapeDtypeStruct((B,), jnp.int32),
        ),
        vmap_method="sequential",
    )
    grown, status = on_gpu(
        lambda c, n: call(c, n, layout=np.int32(int(layout))),
        cache,
        jnp.asarray([-1, S + 1, 5], jnp.int32),
    )
    assert np.asarray(status).tolist() == [1, 1, 0]
    assert not np.asarray(grown[:2]).any()
    np.testing.assert_array_equal(
        np.asarray(grown[2:], np.float64),
        grow_cache_ref(cache[2:], [5], S_new, layout=int(layout)),
    )


def test_decode_kernel_is_a_function_of_dtype_and_head_dim():
    mod = cuda_module()

    def plan(B, D, dtype, kernel="auto", shape="auto", Hq=32, Hkv=8):
        return decode_plan(B, Hq, Hkv, D, dtype, dict(_kernel=kernel, _cta_shape=shape))

    bf16, f32 = jnp.bfloat16, jnp.float32
    # auto: mma for bf16/f16 at head dims 64-128, simt for f32 and D=256; simt when forced.
    for D in HEAD_DIMS:
        assert plan(1, D, bf16)["kernel"] == ("mma" if D <= 128 else "simt"), D
        assert plan(1, D, jnp.float16)["kernel"] == ("mma" if D <= 128 else "simt"), D
        assert plan(1, D, f32)["kernel"] == "simt", D
        assert plan(1, D, bf16, kernel="simt")["kernel"] == "simt", D
    assert plan(1, 128, bf16, kernel="mma") == plan(1, 128, bf16)
    with pytest.raises(ValueError, match="kernel: mma takes bf16/f16 at head dims 64, 80, 96"):
        plan(1, 128, f32, kernel="mma")
    with pytest.raises(ValueError, match="kernel: mma takes .* got itemsize 2 and head_dim 256"):
        plan(1, 256, bf16, kernel="mma")
    with pytest.raises(ValueError, match=r"kernel: expected 0 \(auto\), 1 \(simt\) or 2"):
        mod.decode_plan(1, 32, 8, 128, 2, 3, 0)
    with pytest.raises(ValueError, match=r"cta_shape: expected 0 \(auto\)"):
        mod.decode_plan(1, 32, 8, 128, 2, 0, 3)
    with pytest.raises(ValueError, match="head_dim must be one of 64, 80, 96, 128, 256, got 48"):
        mod.decode_plan(1, 32, 8, 48, 2, 0, 0)
    # simt: auto takes wide CTAs at B * Hkv = 8 CTAs, under the SM count (rows per tile 4x the
    # narrow ones': 16 warps, fewer splits), narrow at B * Hkv = 1024.
    simt = plan(1, 128, bf16, kernel="simt")
    assert simt["num_splits"] > 1 and simt["chunk_multiple"] % 8 == 0
    assert simt["min_chunk"] % simt["chunk_multiple"] == 0
    narrow_small = plan(1, 128, bf16, kernel="simt", shape="narrow")
    narrow_large = plan(128, 128, bf16, kernel="simt", shape="narrow")
    wide_small = plan(1, 128, bf16, kernel="simt", shape="wide")
    assert wide_small["chunk_multiple"] == 4 * narrow_small["chunk_multiple"]
    assert wide_small["num_splits"] < narrow_small["num_splits"]
    assert simt == wide_small
    assert plan(128, 128, bf16, kernel="simt") == narrow_large
    # mma: 16-row warp tiles, 4 warps (narrow) and 8 (wide).
    assert plan(128, 128, bf16)["chunk_multiple"] == 64
    assert plan(1, 128, bf16, shape="narrow")["chunk_multiple"] == 64
    assert plan(1, 128, bf16)["chunk_multiple"] == 128


def test_fixed_splits_plan_alike_at_every_batch():
    # The batch-invariant mode's plan: the same split count, chunk multiple and minimum chunk
    # at every batch, so a row's chunks follow its length alone; 0 plans from the batch.
    mod = cuda_module()
    for dtype, D, kernel in ((jnp.bfloat16, 128, "auto"), (jnp.float32, 128, "auto"),
                             (jnp.bfloat16, 64, "simt"), (jnp.bfloat16, 256, "auto")):  # fmt: skip
        hooks = dict(_kernel=kernel, _splits=BATCH_INVARIANT_SPLITS)
        plans = [decode_plan(B, 32, 8, D, dtype, hooks) for B in (1, 2, 16, 64, 256)]
        keys = ("kernel", "num_splits", "chunk_multiple", "min_chunk")
        assert all({k: p[k] for k in keys} == {k: plans[0][k] for k in keys} for p in plans)
        assert plans[0]["num_splits"] == BATCH_INVARIANT_SPLITS
        # and it is the narrow CTAs' plan (auto would pick wide ones for small grids)
        narrow = decode_plan(256, 32, 8, D, dtype, dict(_kernel=kernel, _cta_shape="narrow"))
        assert plans[0]["chunk_multiple"] == narrow["chunk_multiple"]
    assert (
        decode_plan(1, 32, 8, 128, jnp.bfloat16)["num_splits"]
        != decode_plan(256, 32, 8, 128, jnp.bfloat16)["num_splits"]
    )
    with pytest.raises(ValueError, match=r"splits: expected 0 \(planned from the batch\) to 256"):
        mod.decode_plan(1, 32, 8, 128, 2, 0, 0, 257)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=dtype_ids)
@pytest.mark.parametrize("heads", [(32, 8), (9, 3)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_fixed_splits_give_a_row_the_same_bits_in_any_batch(dtype, heads):
    # The same row (q, new K/V, cache, length) decoded alone and at rows 0 and 5 of batches of
    # 16 and 48 whose other rows are random: bit-identical outputs with the fixed plan, at
    # lengths that take 1, a few and all 16 splits. Without it the plan, and so the sums, change
    # with the batch (counted and printed, not asserted: which bits move is the hardware's).
    Hq, Hkv = heads
    D, S, layout = 128, 4096, Layout.SEQ_MAJOR
    rng = np.random.default_rng(7)
    q1 = randn(rng, (1, Hq, D), dtype)
    k1, v1 = randn(rng, (1, Hkv, D), dtype), randn(rng, (1, Hkv, D), dtype)
    kc1, vc1 = caches(rng, layout, 1, S, Hkv, D, dtype)
    batches = {(1, 0): ((q1, k1, v1, kc1, vc1), jnp.zeros((1,), jnp.int32))}
    for B, at in ((16, 0), (16, 5), (48, 5)):
        kc, vc = caches(rng, layout, B, S, Hkv, D, dtype)
        row_of = lambda x, x1, at=at: x.at[at].set(x1[0])  # noqa: E731
        args = (
            row_of(randn(rng, (B, Hq, D), dtype), q1),
            row_of(randn(rng, (B, Hkv, D), dtype), k1),
            row_of(randn(rng, (B, Hkv, D), dtype), v1),
            row_of(kc, kc1),
            row_of(vc, vc1),
        )
        batches[B, at] = (args, jnp.asarray(rng.integers(0, S, B), jnp.int32))

    moved = {}
    for L in (100, 700, 2500, S - 1):
        for splits in (BATCH_INVARIANT_SPLITS, 0):
            rows = []
            for (_, at), (args, lengths) in batches.items():
                fn = lambda *a, splits=splits: gqa_decode(*a, layout=layout, _splits=splits)  # noqa: E731
                out = on_gpu(fn, *args, lengths.at[at].set(L))[0]
                rows.append(np.asarray(out[at], np.float32))
            alone, others = rows[0], rows[1:]
            assert not np.isnan(alone).any()
            if splits:
                for got in others:
                    np.testing.assert_array_equal(got, alone, err_msg=f"L={L}")
            else:
                moved[L] = sum(int((got != alone).sum()) for got in others)
    print(f"\nvalues moved, plan from the batch ({jnp.dtype(dtype).name}, Hq{Hq}): {moved}")


@pytest.mark.parametrize("kernel", DECODE_KERNELS[:2])
@pytest.mark.parametrize("shape", CTA_SHAPES)
@pytest.mark.parametrize("splits", [0, BATCH_INVARIANT_SPLITS], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize(
    "B, Hq, Hkv, D", [(1, 32, 8, 128), (4, 28, 4, 96), (64, 32, 8, 128), (1, 64, 4, 64)]
)
def test_workspace_is_sized_for_the_kernel_the_call_runs(kernel, shape, splits, B, Hq, Hkv, D):
    # Partials of the call's own split plan and one counter per (b, KV head, head chunk): not
    # the larger of two kernels' needs, and never a function of the capacity S.
    hooks = dict(_kernel=kernel, _cta_shape=shape, _splits=splits)
    plan = decode_plan(B, Hq, Hkv, D, jnp.bfloat16, hooks)
    splits, floats = plan["num_splits"], plan["workspace_floats"]
    chunks = -(-(Hq // Hkv) // 8)
    assert floats == (0 if splits <= 1 else B * Hq * splits * (D + 2) + B * Hkv * chunks)
    # ... and it is what gqa_decode gives the handler, whatever the capacity.
    q = jnp.zeros((B, Hq, D), jnp.bfloat16)
    k = jnp.zeros((B, Hkv, D), jnp.bfloat16)
    for S in (256, 4096):
        kc = jnp.zeros(Layout.SEQ_MAJOR.cache_shape(B, S, Hkv, D), jnp.bfloat16)
        text = (
            jax.jit(lambda *a: gqa_decode(*a, layout=Layout.SEQ_MAJOR, **hooks))
            .lower(q, k, k, kc, kc, jnp.zeros((B,), jnp.int32))
            .as_text()
        )
        assert f"tensor<{floats}xf32>" in text


def test_tolerance_table_covers_dtypes():
    assert set(TOL) == {jnp.dtype(d).name for d in DTYPES}


# --- the CUDA-graph replay signal ------------------------------------------------------------

_COUNTER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax_kv import Layout, gqa_decode, _ffi
    _ffi.register()
    cuda = _ffi.cuda_module()
    kernel = sys.argv[1]  # gqa_decode's _kernel hook
    B, Hq, Hkv, D, S = 2, 8, 2, 64, 256
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
    q, k, v = r(B, Hq, D), r(B, Hkv, D), r(B, Hkv, D)
    kc, vc = jnp.copy(r(B, S, Hkv, D)), jnp.copy(r(B, S, Hkv, D))
    lengths = jnp.asarray([3, 100], jnp.int32)
    step = jax.jit(lambda q, k, v, kc, vc, n: gqa_decode(q, k, v, kc, vc, n,
                   layout=Layout.SEQ_MAJOR, _kernel=kernel), donate_argnums=(3, 4))
    for _ in range(5):  # warm-up: compile, record
        out, kc, vc = step(q, k, v, kc, vc, lengths)
        out.block_until_ready()
        del out
    cuda.reset_host_calls()
    steps = 20
    for _ in range(steps):
        out, kc, vc = step(q, k, v, kc, vc, lengths)
        out.block_until_ready()
        del out
    print(json.dumps({"steps": steps, "kernel": kernel, **cuda.host_calls()}))
    """
)


@pytest.mark.parametrize("kernel", ["simt", "mma"])
@pytest.mark.parametrize("command_buffers", [True, False], ids=["graphs_on", "graphs_off"])
def test_host_calls_show_graph_replay(command_buffers, kernel):
    flags = (
        "--xla_gpu_graph_min_graph_size=1"
        if command_buffers
        else "--xla_gpu_enable_command_buffer="
    )
    env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = subprocess.run(
        [sys.executable, "-c", _COUNTER_SCRIPT, kernel],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert counts["kernel"] == kernel, counts
    calls = counts["jax_kv_gqa_decode"]
    if command_buffers:
        assert calls == 0, f"replayed steps ran the handler's host code: {counts}"
    else:
        assert calls == counts["steps"], counts
