"""Checks and attribute normalisation shared by the ops: one place turns Python values into
the fixed C++ types the FFI handlers bind, so `scale=0.125` and `scale=np.float32(0.125)`
produce the same compiled call."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import _ffi
from jax_kv.layout import Layout

# The head dims the FFI handlers and kernels are built for; cuda/head_dims.h spells them for C++
# and tests/ops/test_dispatch.py checks the two agree.
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# Kernel choices of gqa_decode / gqa_prefill for tests and benchmarks (their `_kernel`,
# `_cta_shape` and `_split_counters` keywords). Each value's position is the int32 attribute
# the handler reads (cuda/gqa_decode.cuh DecodeKernel, DecodeCtas, SplitCounters;
# cuda/gqa_prefill.cuh PrefillKernel): the choice is part of the compiled call, so switching
# it compiles a new executable and never needs jax.clear_caches(). The CPU handlers ignore them.
DECODE_KERNELS = ("auto", "simt", "mma")  # auto: mma for bf16/f16 at D <= 128, else simt
CTA_SHAPES = ("auto", "narrow", "wide")  # auto: wide where B * Hkv * head chunks < SMs
SPLIT_COUNTERS = ("pool", "workspace")
PREFILL_KERNELS = ("auto", "mma")  # auto: wgmma for bf16/f16 at D 64, 128 on sm_90


def describe(x: Any) -> str:
    return f"{jnp.dtype(x.dtype).name} {list(x.shape)}"


def check_dtype(name: str, x: Any, dtype: Any) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise ValueError(
            f"{name}: expected dtype {jnp.dtype(dtype).name} (the dtype of q), got {describe(x)}"
        )


def check_shape(name: str, x: Any, expected: tuple[int, ...], spelled: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected {spelled} = {list(expected)}, got {describe(x)}")


def check_lengths(name: str, lengths: Any, batch: int) -> np.ndarray | None:
    """Checks dtype and shape; returns the values when they are known at trace time."""
    if jnp.dtype(lengths.dtype) != jnp.int32 or tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name}: expected int32 [B={batch}], got {describe(lengths)}")
    if isinstance(lengths, jax.core.Tracer):
        return None
    return np.asarray(lengths)


def committed_or_capacity(committed: Any, batch: int, capacity: int) -> tuple[Any, np.ndarray]:
    """The committed [B] argument of gqa_decode / gqa_prefill: the positions of each sequence
    whose memory is committed (a VMM view reserved at max_len is committed only up to its
    live prefix; the tail reads as zeros and must never be written). None means all S.

    Returns (the int32 [B] array to pass, the bound per row as far as known at trace time:
    S where the values are traced).
    """
    if committed is None:
        return jnp.full((batch,), capacity, jnp.int32), np.full((batch,), capacity)
    known = check_lengths("committed", committed, batch)
    if known is None:
        return committed, np.full((batch,), capacity)
    bad = [(b, int(c)) for b, c in enumerate(known) if c < 0]
    if bad:
        b, c = bad[0]
        raise ValueError(f"committed: expected >= 0 tokens per sequence, got committed[{b}]={c}")
    return committed, np.minimum(known, capacity)


def attention_attrs(
    layout: Layout | str | int,
    head_dim: int,
    scale: float | None,
    softcap: float | None,
    window: int | None,
) -> dict[str, np.generic]:
    """FFI attributes of gqa_decode / gqa_prefill as the exact C++ types (int32, float32)."""
    layout = Layout.parse(layout)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    if softcap is not None and not (math.isfinite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"softcap: expected a finite float > 0 or None, got {softcap!r}")
    if window is not None:
        if isinstance(window, bool) or int(window) != window or int(window) <= 0:
            raise ValueError(f"window: expected an int > 0 or None, got {window!r}")
        if int(window) > np.iinfo(np.int32).max:
            raise ValueError(f"window: expected <= {np.iinfo(np.int32).max}, got {window!r}")
    return dict(
        layout=np.int32(int(layout)),
        scale=np.float32(scale),
        softcap=np.float32(0.0 if softcap is None else softcap),
        window=np.int32(0 if window is None else int(window)),
    )


def check_attention_inputs(
    q: Any,
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    layout: Layout,
    token_axis: bool,
    packed: bool = False,
) -> tuple[int, int, int, int, int, int]:
    """Shape/dtype contract shared by decode (q [B, Hq, D]), prefill (q [B, T, Hq, D]) and
    packed prefill (`packed`: q [N, Hq, D], B from the cache).

    Returns (B, T, Hq, Hkv, D, S), T = N for the packed form.
    """
    rank = 4 if token_axis else 3
    q_spelled = "[B, T, Hq, D]" if token_axis else "[N, Hq, D]" if packed else "[B, Hq, D]"
    if q.ndim != rank:
        raise ValueError(f"q: expected rank {rank} {q_spelled}, got {describe(q)}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q: expected dtype bfloat16, float16 or float32, got {describe(q)}")
    B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    T = q.shape[1] if token_axis else q.shape[0] if packed else 1
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head_dim D must be one of {SUPPORTED_HEAD_DIMS}, got {describe(q)}")
    cache_spelled = {Layout.HEAD_MAJOR: "[B, Hkv, S, D]", Layout.SEQ_MAJOR: "[B, S, Hkv, D]"}
    if k_cache.ndim != 4:
        raise ValueError(
            f"k_cache: expected rank 4 {cache_spelled[layout]} ({layout.name}), "
            f"got {describe(k_cache)}"
        )
    Bc, S, Hkv, Dc = layout.dims_of(k_cache.shape)
    if packed:
        B = Bc  # q's leading axis is the N packed tokens
    if Bc != B or Dc != D:
        raise ValueError(
            f"k_cache: expected {cache_spelled[layout]} ({layout.name}) with "
            + ("" if packed else f"B={B} and ")
            + f"D={D} from q, got {describe(k_cache)}"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"q: expected Hq to be a multiple of Hkv={Hkv} (from k_cache), got Hq={Hq}"
        )
    check_shape("v_cache", v_cache, k_cache.shape, "the shape of k_cache")
    if token_axis:
        kv_shape, kv_spelled = (B, T, Hkv, D), "[B, T, Hkv, D]"
    elif packed:
        kv_shape, kv_spelled = (T, Hkv, D), "[N, Hkv, D]"
    else:
        kv_shape, kv_spelled = (B, Hkv, D), "[B, Hkv, D]"
    check_shape("k", k, kv_shape, kv_spelled)
    check_shape("v", v, kv_shape, kv_spelled)
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, x, q.dtype)
    return B, T, Hq, Hkv, D, S


def choice_attr(name: str, value: str, choices: tuple[str, ...]) -> np.int32:
    """The int32 attribute of a kernel choice (`choices` is one of the tuples above)."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return np.int32(choices.index(value))


# The most splits a decode call's plan may fix (cuda/gqa_decode.cuh kDecodeMaxSplits).
MAX_DECODE_SPLITS = 256


def splits_attr(name: str, value: int | None, default: int) -> np.int32:
    """The int32 `splits` attribute of a decode call: `value`, or `default` where it is None."""
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int from 0 to {MAX_DECODE_SPLITS}, got {value!r}")
    if not 0 <= value <= MAX_DECODE_SPLITS:
        raise ValueError(
            f"{name}: expected 0 (planned from the batch) to {MAX_DECODE_SPLITS}, got {value}"
        )
    return np.int32(value)


def decode_workspace_shape(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    kernel: np.int32,
    cta_shape: np.int32,
    splits: np.int32,
) -> tuple[int]:
    """Float32 scratch of one gqa_decode call (split-K partials and counters), sized for the
    kernel, CTA shape and split plan that call runs. Sized here, never allocated by a handler,
    so the handlers stay command-buffer compatible. Zero on CPU."""
    cuda = _ffi.cuda_module()
    if cuda is None or jax.default_backend() != "gpu" or batch == 0:
        return (0,)  # (B = 0: the launcher returns before launching anything)
    itemsize = jnp.dtype(dtype).itemsize
    args = (
        batch, num_q_heads, num_kv_heads, head_dim, itemsize, int(kernel), int(cta_shape),
        int(splits),
    )  # fmt: skip
    return (int(cuda.decode_plan(*args)["workspace_floats"]),)


def call_attention(
    op: str,
    args: tuple,
    attrs: dict[str, np.generic],
    workspace: tuple[int],
    return_status: bool,
) -> tuple[jax.Array, ...]:
    """The FFI call of gqa_decode / gqa_prefill / gqa_prefill_packed (op "decode" /
    "prefill" / "prefill_packed").

    args: (q, k, v, k_cache, v_cache, lengths[, new_lengths or cu_seqlens], committed). The
    caches come back aliased to the inputs (updated in place when donated); the status [B]
    (the shape of lengths) is returned on request and the handler's float32 workspace (of
    shape `workspace`) is dropped.
    """
    q, k_cache, v_cache, lengths = args[0], args[3], args[4], args[5]
    call = jax.ffi.ffi_call(
        f"jax_kv_gqa_{op}",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
            jax.ShapeDtypeStruct(lengths.shape, jnp.int32),
            jax.ShapeDtypeStruct(workspace, jnp.float32),
        ),
        input_output_aliases={3: 1, 4: 2},
        vmap_method="sequential",
    )
    out, k_cache, v_cache, status, _ = call(*args, **attrs)
    return (out, k_cache, v_cache, status) if return_status else (out, k_cache, v_cache)
