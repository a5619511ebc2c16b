"""float64 NumPy references of the ops' contracts (DESIGN.md, Ops): explicit loops over b and
heads, readable rather than fast. No jax_kv code is used here, so a kernel is never its own
oracle."""

from __future__ import annotations

import ml_dtypes  # installed with jax: numpy's bfloat16
import numpy as np

# Tolerances by out dtype name; scores and softmax are f32 in the kernels, the output is
# rounded to its dtype (bf16 carries 8 bits of mantissa: 2^-8 ~ 3.9e-3 relative).
TOL = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}

# Memory order of (B, S, Hkv, D) per layout value, mirroring jax_kv.Layout without importing it.
_AXES = {0: "BHSD", 1: "BSHD"}


def _to_bshd(cache: np.ndarray, layout: int) -> np.ndarray:
    axes = _AXES[int(layout)]
    return np.transpose(np.asarray(cache, np.float64), [axes.index(a) for a in "BSHD"]).copy()


def _from_bshd(cache: np.ndarray, layout: int) -> np.ndarray:
    axes = _AXES[int(layout)]
    return np.transpose(cache, ["BSHD".index(a) for a in axes]).copy()


def gqa_attention_ref(
    q,
    k,
    v,
    k_cache,
    v_cache,
    lengths,
    new_lengths=None,
    *,
    layout,
    scale=None,
    softcap=None,
    window=None,
):
    """Append then attend, in float64.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; caches in `layout`; lengths, new_lengths: [B].
    Returns (out [B, T, Hq, D], k_cache, v_cache) as float64 arrays (caches in `layout`).
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    B, T, Hq, D = q.shape
    kc, vc = _to_bshd(k_cache, layout), _to_bshd(v_cache, layout)
    Hkv = kc.shape[2]
    group = Hq // Hkv
    lengths = np.asarray(lengths, np.int64)
    new = np.full(B, T) if new_lengths is None else np.asarray(new_lengths, np.int64)
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    for b in range(B):
        for t in range(new[b]):
            kc[b, lengths[b] + t] = k[b, t]
            vc[b, lengths[b] + t] = v[b, t]
    out = np.zeros((B, T, Hq, D), np.float64)
    for b in range(B):
        for qh in range(Hq):
            h = qh // group
            for t in range(new[b]):
                hi = lengths[b] + t
                lo = max(0, hi + 1 - window) if window else 0
                s = kc[b, lo : hi + 1, h] @ q[b, t, qh] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[b, t, qh] = (p / p.sum()) @ vc[b, lo : hi + 1, h]
    return out, _from_bshd(kc, layout), _from_bshd(vc, layout)


def gqa_decode_ref(q, k, v, k_cache, v_cache, lengths, **kw):
    """Decode is prefill of one token: q [B, Hq, D], k, v [B, Hkv, D]."""
    out, kc, vc = gqa_attention_ref(
        np.asarray(q, np.float64)[:, None],
        np.asarray(k, np.float64)[:, None],
        np.asarray(v, np.float64)[:, None],
        k_cache,
        v_cache,
        lengths,
        **kw,
    )
    return out[:, 0], kc, vc


def unpack_rows(x, cu_seqlens, T: int) -> np.ndarray:
    """Packed rows [N, ...] -> padded [B, T, ...] (float64, zeros past each sequence's rows):
    sequence b's rows are cu_seqlens[b] .. cu_seqlens[b + 1] - 1."""
    x, cu = np.asarray(x, np.float64), np.asarray(cu_seqlens, np.int64)
    out = np.zeros((len(cu) - 1, T) + x.shape[1:], np.float64)
    for b in range(len(cu) - 1):
        out[b, : cu[b + 1] - cu[b]] = x[cu[b] : cu[b + 1]]
    return out


def pack_rows(x, cu_seqlens, N: int) -> np.ndarray:
    """Padded [B, T, ...] -> packed [N, ...] (float64): the inverse of unpack_rows, zeros in
    the padding rows [cu_seqlens[B], N)."""
    x, cu = np.asarray(x, np.float64), np.asarray(cu_seqlens, np.int64)
    out = np.zeros((N,) + x.shape[2:], np.float64)
    for b in range(len(cu) - 1):
        out[cu[b] : cu[b + 1]] = x[b, : cu[b + 1] - cu[b]]
    return out


def gqa_packed_ref(q, k, v, k_cache, v_cache, lengths, cu_seqlens, **kw):
    """The packed form's contract through gqa_attention_ref: q [N, Hq, D], k, v [N, Hkv, D]
    unpacked to [B, T] by cu_seqlens, attended, packed back. Returns (out [N, Hq, D],
    k_cache, v_cache) as float64 arrays; padding rows of out are zeros."""
    cu = np.asarray(cu_seqlens, np.int64)
    new = np.diff(cu)
    T, N = max(1, int(new.max(initial=0))), np.shape(q)[0]
    out, kc, vc = gqa_attention_ref(
        *(unpack_rows(x, cu, T) for x in (q, k, v)), k_cache, v_cache, lengths, new, **kw
    )
    return pack_rows(out, cu, N), kc, vc


def grow_cache_ref(cache, lengths, new_capacity, *, layout):
    """The live prefix copied into a zero cache of capacity new_capacity (float64)."""
    c = _to_bshd(cache, layout)
    B, _, Hkv, D = c.shape
    grown = np.zeros((B, new_capacity, Hkv, D), np.float64)
    for b, n in enumerate(np.asarray(lengths)):
        grown[b, :n] = c[b, :n]
    return _from_bshd(grown, layout)


def round_to(v, dtype_name: str) -> np.ndarray:
    """v rounded to dtype_name (to nearest even), back in float64."""
    dt = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    return np.asarray(v, np.float64).astype(dt).astype(np.float64)


def assert_close(actual, expected, dtype_name: str, what: str = "out") -> float:
    """Tolerance by dtype; NaN never passes. Returns max |error| for reports."""
    a = np.asarray(actual, np.float64)
    assert np.isfinite(a).all(), f"{what}: non-finite values"
    np.testing.assert_allclose(a, expected, err_msg=what, **TOL[dtype_name])
    return float(np.max(np.abs(a - expected))) if a.size else 0.0
