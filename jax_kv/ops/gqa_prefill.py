"""gqa_prefill: causal GQA attention of T new tokens over past + new K/V, appending the new
K/V to the cache (XLA FFI target jax_kv_gqa_prefill); gqa_prefill_packed: the same over the new
tokens of all sequences packed on one token axis (jax_kv_gqa_prefill_packed)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import _ffi
from jax_kv.layout import Layout
from jax_kv.ops import _common


def gqa_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    new_lengths: jax.Array | None = None,
    layout: Layout | str | int,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    committed: jax.Array | None = None,
    return_status: bool = False,
    _kernel: str = "auto",
) -> tuple[jax.Array, ...]:
    """Causal GQA prefill of T tokens per sequence into a growing KV cache.

    Writes new_lengths[b] tokens' K/V at positions lengths[b] ...; query t attends to
    positions [max(0, P + 1 - window), P] with P = lengths[b] + t. Rows t >= new_lengths[b]
    (ragged prompts) return zeros and write nothing.

    Args:
        q: [B, T, Hq, D] queries of the new tokens, already rotated.
        k, v: [B, T, Hkv, D] keys and values of the new tokens.
        k_cache, v_cache: [B, Hkv, S, D] (HEAD_MAJOR) or [B, S, Hkv, D] (SEQ_MAJOR); donate
            them, they are updated in place.
        lengths: int32 [B], tokens cached before this call.
        new_lengths: int32 [B], tokens of this call per sequence, 0 <= new_lengths <= T
            (default T); lengths + new_lengths <= S.
        layout, scale, softcap, window, committed, return_status: as in gqa_decode
            (here lengths[b] + new_lengths[b] <= min(S, committed[b]); an idle row,
            committed[b] == 0, is skipped whatever new tokens it is given: zeros out).
        _kernel: a test and benchmark hook, not API: "auto" (the wgmma kernel for bf16/f16 at
            D 64 and 128 on a compute-capability 9.0 GPU, mma.sync otherwise) or "mma"
            (mma.sync always). An attribute of the compiled call; the CPU handler ignores it.

    Returns:
        (out [B, T, Hq, D], k_cache, v_cache), plus status [B] if return_status.
    """
    _ffi.register()
    layout = Layout.parse(layout)
    B, T, _, _, D, S = _common.check_attention_inputs(
        q, k, v, k_cache, v_cache, layout, token_axis=True
    )
    attrs = _common.attention_attrs(layout, D, scale, softcap, window)
    attrs["kernel"] = _common.choice_attr("_kernel", _kernel, _common.PREFILL_KERNELS)
    known = _common.check_lengths("lengths", lengths, B)
    committed, bound = _common.committed_or_capacity(committed, B, S)
    if new_lengths is None:
        new_lengths = jnp.full((B,), T, jnp.int32)
        known_new = [T] * B
    else:
        known_new = _common.check_lengths("new_lengths", new_lengths, B)
    if known_new is not None:
        for b, n in enumerate(known_new):
            if not 0 <= n <= T:
                raise ValueError(
                    f"new_lengths: expected 0 <= new_lengths[b] <= T={T}, "
                    f"got new_lengths[{b}]={int(n)}"
                )
    # Traced new_lengths: T is the most any sequence can write.
    _check_room(known, [T] * B if known_new is None else known_new, bound, S)
    args = (q, k, v, k_cache, v_cache, lengths, new_lengths, committed)
    return _common.call_attention("prefill", args, attrs, (0,), return_status)


def gqa_prefill_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    cu_seqlens: jax.Array,
    *,
    layout: Layout | str | int,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    committed: jax.Array | None = None,
    return_status: bool = False,
    _kernel: str = "auto",
) -> tuple[jax.Array, ...]:
    """Causal GQA prefill of the new tokens of B sequences packed on one token axis (varlen
    attention: a call computes only real tokens, up to its bucket N).

    Sequence b's new tokens are the packed rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1; their
    K/V are written at cache positions lengths[b] ..., and packed row j = cu_seqlens[b] + t
    attends to positions [max(0, P + 1 - window), P] with P = lengths[b] + t, over past + new.
    A sequence with no new tokens (cu_seqlens[b] == cu_seqlens[b + 1]) is left as it is. The
    padding rows [cu_seqlens[B], N) of out are zeros.

    Args:
        q: [N, Hq, D] queries of the new tokens, already rotated; N is a static bucket.
        k, v: [N, Hkv, D] keys and values of the new tokens.
        k_cache, v_cache: [B, Hkv, S, D] (HEAD_MAJOR) or [B, S, Hkv, D] (SEQ_MAJOR); donate
            them, they are updated in place. B is their batch (every slot, most with 0 tokens).
        lengths: int32 [B], tokens cached before this call.
        cu_seqlens: int32 [B + 1], cu_seqlens[0] == 0, non-decreasing, cu_seqlens[B] <= N;
            lengths[b] + (cu_seqlens[b + 1] - cu_seqlens[b]) <= S.
        layout, scale, softcap, window, committed, return_status, _kernel: as in gqa_prefill.
            A sequence with lengths[b] + its new tokens > min(S, committed[b]) latches status
            1: its rows of out NaN, its cache untouched. A malformed cu_seqlens (values only
            known on the device) latches status 3 for every b: out all NaN, no cache written.

    Returns:
        (out [N, Hq, D], k_cache, v_cache), plus status int32 [B] if return_status.
    """
    _ffi.register()
    layout = Layout.parse(layout)
    B, N, _, _, D, S = _common.check_attention_inputs(
        q, k, v, k_cache, v_cache, layout, token_axis=False, packed=True
    )
    if B < 1:
        raise ValueError(
            f"k_cache: expected B >= 1 sequences (the last owns the padding rows), "
            f"got {_common.describe(k_cache)}"
        )
    attrs = _common.attention_attrs(layout, D, scale, softcap, window)
    attrs["kernel"] = _common.choice_attr("_kernel", _kernel, _common.PREFILL_KERNELS)
    known = _common.check_lengths("lengths", lengths, B)
    committed, bound = _common.committed_or_capacity(committed, B, S)
    known_cu = _check_cu_seqlens(cu_seqlens, B, N)
    if known_cu is not None:  # traced cu_seqlens: the device latches status 1 per sequence
        _check_room(known, np.diff(known_cu), bound, S)
    args = (q, k, v, k_cache, v_cache, lengths, cu_seqlens, committed)
    return _common.call_attention("prefill_packed", args, attrs, (0,), return_status)


def _check_cu_seqlens(cu_seqlens: Any, batch: int, num_tokens: int) -> np.ndarray | None:
    """Checks dtype and shape [B + 1]; where the values are known at trace time, the packed
    form's contract too. Returns them then, else None."""
    if jnp.dtype(cu_seqlens.dtype) != jnp.int32 or tuple(cu_seqlens.shape) != (batch + 1,):
        raise ValueError(
            f"cu_seqlens: expected int32 [B+1={batch + 1}], got {_common.describe(cu_seqlens)}"
        )
    if isinstance(cu_seqlens, jax.core.Tracer):
        return None
    cu = np.asarray(cu_seqlens)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(cu[0])}")
    drops = np.flatnonzero(np.diff(cu) < 0)
    if drops.size:
        b = int(drops[0])
        raise ValueError(
            f"cu_seqlens: expected non-decreasing values, got cu_seqlens[{b}]={int(cu[b])} > "
            f"cu_seqlens[{b + 1}]={int(cu[b + 1])}"
        )
    if cu[-1] > num_tokens:
        raise ValueError(
            f"cu_seqlens: expected cu_seqlens[B={batch}] <= N={num_tokens} (the packed rows of "
            f"q), got {int(cu[-1])}"
        )
    return cu


def _check_room(
    known: np.ndarray | None, new_tokens: Any, bound: np.ndarray, capacity: int
) -> None:
    """Where lengths are known: lengths[b] + new_tokens[b] must fit min(S, committed[b])."""
    if known is None:
        return
    for b, x in enumerate(known):
        n = int(new_tokens[b])
        if bound[b] > 0 and not (0 <= x and x + n <= bound[b]):  # bound 0: an idle row
            limit = f"capacity S={capacity}" + (
                f" and committed[b]={int(bound[b])}" if bound[b] < capacity else ""
            )
            raise ValueError(
                f"lengths: expected 0 <= lengths[b] and lengths[b] + new tokens "
                f"<= {limit}, got lengths[{b}]={int(x)} with {n} new "
                f"tokens (prefill would overflow the cache)"
            )
