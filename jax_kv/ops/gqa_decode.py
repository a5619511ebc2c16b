"""gqa_decode: one GQA decode step over a growing KV cache (XLA FFI target jax_kv_gqa_decode)."""

from __future__ import annotations

import jax

from jax_kv import _ffi
from jax_kv.config import runtime_config
from jax_kv.layout import Layout
from jax_kv.ops import _common

# The split count of every CUDA decode call in the batch-invariant mode (jax_kv.config's
# batch_invariant): a row's positions are cut into at most this many chunks, the chunk a
# function of the row's length alone, so a row sums in one order whatever the batch beside it.
# 16 fills an H200 with narrow CTAs at one row of Llama-3-8B (8 KV heads); larger batches pay
# for it in CTAs that find no work and in partials merged where one split would do.
BATCH_INVARIANT_SPLITS = 16


def gqa_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    layout: Layout | str | int,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    committed: jax.Array | None = None,
    return_status: bool = False,
    _kernel: str = "auto",
    _cta_shape: str = "auto",
    _split_counters: str = "pool",
    _splits: int | None = None,
) -> tuple[jax.Array, ...]:
    """One GQA decode step over a growing KV cache.

    Writes the new token's K/V at position lengths[b], then attends over positions
    [max(0, L + 1 - window), L] with L = lengths[b].

    Args:
        q: [B, Hq, D] query of the new token, already rotated.
        k, v: [B, Hkv, D] key and value of the new token.
        k_cache, v_cache: [B, Hkv, S, D] (HEAD_MAJOR) or [B, S, Hkv, D] (SEQ_MAJOR); donate
            them, they are updated in place.
        lengths: int32 [B], tokens cached before this step, 0 <= lengths < S.
        layout: the cache's Layout (take it from the cache, never set it twice).
        scale: score scale, default 1/sqrt(D).
        softcap: if set, scores become softcap * tanh(score / softcap).
        window: if set, attend to the last `window` positions only (the new token included).
        committed: int32 [B], positions of each sequence backed by committed memory (default
            S). Pass it while a step compiled for a VMM view reserved at max_len is kept
            across growth: writes are bounded by it, not by the array's shape.
            committed[b] == 0 marks row b idle (an engine's free slot): it is neither read
            nor written and costs no attention work, whatever lengths[b] holds; its output
            is zeros and its status 0. One compiled step so serves any set of live rows.
        return_status: also return the int32 [B] status (0 = ok). Lengths known only on the
            device are checked there: a row with lengths[b] >= min(S, committed[b]) latches
            status 1, its output is NaN and its cache untouched (CPU and CUDA alike); the
            other rows are computed.
        _kernel, _cta_shape, _split_counters: test and benchmark hooks, not API. The CUDA
            kernel a call runs is chosen from its dtype and head dim ("auto": the tensor-core
            kernel "mma" for bf16/f16 at D <= 128, the CUDA-core kernel "simt" otherwise);
            "simt" and "mma" force one ("mma" only where it applies). The CTA shape ("auto",
            "narrow", "wide") and the split counters' home ("pool", "workspace") likewise. Each
            is an attribute of the compiled call; the CPU handler ignores them.
        _splits: the split count of the CUDA kernel's plan: 0 plans it from the batch (the
            grid's CTA count), n > 0 fixes it at n (and the auto CTA shape at narrow), so a
            row's result does not depend on the batch. None: BATCH_INVARIANT_SPLITS in the
            batch-invariant mode (JAX_KV_BATCH_INVARIANT), else 0.

    Returns:
        (out [B, Hq, D], k_cache, v_cache), plus status [B] if return_status.
    """
    _ffi.register()
    layout = Layout.parse(layout)
    B, _, Hq, Hkv, D, S = _common.check_attention_inputs(
        q, k, v, k_cache, v_cache, layout, token_axis=False
    )
    attrs = _common.attention_attrs(layout, D, scale, softcap, window)
    attrs.update(
        kernel=_common.choice_attr("_kernel", _kernel, _common.DECODE_KERNELS),
        cta_shape=_common.choice_attr("_cta_shape", _cta_shape, _common.CTA_SHAPES),
        split_counters=_common.choice_attr(
            "_split_counters", _split_counters, _common.SPLIT_COUNTERS
        ),
        splits=_common.splits_attr(
            "_splits",
            _splits,
            BATCH_INVARIANT_SPLITS if runtime_config().batch_invariant else 0,
        ),
    )
    known = _common.check_lengths("lengths", lengths, B)
    committed, bound = _common.committed_or_capacity(committed, B, S)
    if known is not None:
        # bound 0: committed[b] == 0, an idle row, whatever its length
        bad = [(b, int(x)) for b, x in enumerate(known) if bound[b] and not 0 <= x < bound[b]]
        if bad:
            b, x = bad[0]
            raise ValueError(
                f"lengths: expected 0 <= lengths[b] < capacity S={S}"
                + (f" and committed[b]={int(bound[b])}" if bound[b] < S else "")
                + f", got lengths[{b}]={x}"
            )
    workspace = _common.decode_workspace_shape(
        B, Hq, Hkv, D, q.dtype, attrs["kernel"], attrs["cta_shape"], attrs["splits"]
    )
    args = (q, k, v, k_cache, v_cache, lengths, committed)
    return _common.call_attention("decode", args, attrs, workspace, return_status)
