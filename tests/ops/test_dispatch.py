"""Dispatch is a function of the call (issue 20, items 1 and 2), checked on the CPU build:

- the supported head dims are spelled once per language, cuda/head_dims.h for C++ and
  jax_kv.ops._common.SUPPORTED_HEAD_DIMS for Python, and the two agree;
- the C++ check (every handler's, through FillGqaParams) names the value and the set;
- the kernel choices tests and benchmarks make (`_kernel`, `_cta_shape`, `_split_counters`,
  `_splits`) are attributes of the compiled call, refused by name when unknown, and ignored by
  the CPU handler; `_splits` defaults to the batch-invariant mode's fixed count where that mode
  is on (JAX_KV_BATCH_INVARIANT), to 0 (planned from the batch) elsewhere.

Which CUDA kernel each choice runs is checked on the GPU (tests/ops/test_gpu_ops.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import caches, randn

from jax_kv import Layout, _ffi, _ffi_cpu, gqa_decode, gqa_prefill
from jax_kv.config import runtime_config
from jax_kv.ops import _common
from jax_kv.ops.gqa_decode import BATCH_INVARIANT_SPLITS

B, Hq, Hkv, D, S, T = 2, 8, 2, 64, 32, 3
LAYOUT = Layout.SEQ_MAJOR


def test_python_and_cpp_head_dims_agree():
    assert tuple(_ffi_cpu.supported_head_dims()) == _common.SUPPORTED_HEAD_DIMS


def test_handler_refuses_an_unsupported_head_dim_naming_the_set(rng):
    # Past the Python check (a direct FFI call): the C++ message comes from the same list.
    _ffi.register()
    d = 48
    q = randn(rng, (B, Hq, d), jnp.float32)
    k, v = randn(rng, (B, Hkv, d), jnp.float32), randn(rng, (B, Hkv, d), jnp.float32)
    kc, vc = caches(rng, LAYOUT, B, S, Hkv, d, jnp.float32)
    n = jnp.zeros((B,), jnp.int32)
    attrs = _common.attention_attrs(LAYOUT, d, None, None, None)
    attrs.update(
        kernel=np.int32(0), cta_shape=np.int32(0), split_counters=np.int32(0), splits=np.int32(0)
    )
    with pytest.raises(Exception, match=r"q: head_dim must be one of 64, 80, 96, 128, 256, got 48"):
        out = _common.call_attention("decode", (q, k, v, kc, vc, n, n + S), attrs, (0,), False)
        jax.block_until_ready(out)


@pytest.fixture
def decode_args(rng):
    q = randn(rng, (B, Hq, D), jnp.bfloat16)
    k, v = randn(rng, (B, Hkv, D), jnp.bfloat16), randn(rng, (B, Hkv, D), jnp.bfloat16)
    kc, vc = caches(rng, LAYOUT, B, S, Hkv, D, jnp.bfloat16)
    return q, k, v, kc, vc, jnp.asarray([0, 7], jnp.int32)


@pytest.mark.parametrize(
    "hook, value, choices",
    [
        ("_kernel", "v2", _common.DECODE_KERNELS),
        ("_kernel", 3, _common.DECODE_KERNELS),
        ("_cta_shape", "medium", _common.CTA_SHAPES),
        ("_split_counters", "global", _common.SPLIT_COUNTERS),
    ],
)
def test_decode_hooks_refuse_unknown_values_by_name(decode_args, hook, value, choices):
    with pytest.raises(ValueError, match=re.escape(f"{hook}: expected one of {choices}")):
        gqa_decode(*decode_args, layout=LAYOUT, **{hook: value})


@pytest.mark.parametrize("value", [-1, 257, 2.5, True, "16"])
def test_decode_splits_hook_refuses_what_is_not_a_split_count(decode_args, value):
    with pytest.raises(
        ValueError,
        match=r"_splits: expected (0 \(planned from the batch\) to|an int from 0 to) 256",
    ):
        gqa_decode(*decode_args, layout=LAYOUT, _splits=value)


def test_prefill_hook_refuses_unknown_values_by_name(rng):
    q = randn(rng, (B, T, Hq, D), jnp.float32)
    k, v = randn(rng, (B, T, Hkv, D), jnp.float32), randn(rng, (B, T, Hkv, D), jnp.float32)
    kc, vc = caches(rng, LAYOUT, B, S, Hkv, D, jnp.float32)
    with pytest.raises(
        ValueError, match=r"_kernel: expected one of \('auto', 'mma'\), got 'wgmma'"
    ):
        gqa_prefill(q, k, v, kc, vc, jnp.zeros((B,), jnp.int32), layout=LAYOUT, _kernel="wgmma")


def test_decode_choices_are_attributes_of_the_compiled_call(decode_args):
    # A different choice is a different program (so a new executable and a new CUDA graph):
    # switching kernels needs no jax.clear_caches() and cannot reach a graph recorded before.
    def lowered(**hooks):
        fn = jax.jit(lambda *a: gqa_decode(*a, layout=LAYOUT, **hooks))
        return fn.lower(*decode_args).as_text()

    default = lowered()
    splits = BATCH_INVARIANT_SPLITS if runtime_config().batch_invariant else 0
    for attr in ("kernel = 0 : i32", "cta_shape = 0 : i32", "split_counters = 0 : i32",
                 f"splits = {splits} : i32"):  # fmt: skip
        assert attr in default, attr
    forced = lowered(_kernel="simt", _cta_shape="wide", _split_counters="workspace", _splits=16)
    for attr in ("kernel = 1 : i32", "cta_shape = 2 : i32", "split_counters = 1 : i32",
                 "splits = 16 : i32"):  # fmt: skip
        assert attr in forced, attr
    assert "kernel = 2 : i32" in lowered(_kernel="mma")


def test_cpu_handler_ignores_the_choices(decode_args):
    def run(**hooks):
        return jax.jit(lambda *a: gqa_decode(*a, layout=LAYOUT, **hooks))(*decode_args)

    want = [np.asarray(x) for x in run()]
    for hooks in (
        dict(_kernel="simt", _cta_shape="narrow"),
        dict(_split_counters="workspace"),
        dict(_splits=16),
    ):
        got = run(**hooks)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w)
