"""gqa_prefill: causal GQA attention of T new tokens over past + new K/V, appending the new
K/V to the cache (XLA FFI target jax_kv_gqa_prefill)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
            (here lengths[b] + new_lengths[b] <= min(S, committed[b])).
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
    if known is not None:
        for b, x in enumerate(known):
            n = T if known_new is None else int(known_new[b])
            if not (0 <= x and x + n <= bound[b]):
                limit = f"capacity S={S}" + (
                    f" and committed[b]={int(bound[b])}" if bound[b] < S else ""
                )
                raise ValueError(
                    f"lengths: expected 0 <= lengths[b] and lengths[b] + new tokens "
                    f"<= {limit}, got lengths[{b}]={int(x)} with {n} new "
                    f"tokens (prefill would overflow the cache)"
                )
    args = (q, k, v, k_cache, v_cache, lengths, new_lengths, committed)
    return _common.call_attention("prefill", args, attrs, (0,), return_status)
