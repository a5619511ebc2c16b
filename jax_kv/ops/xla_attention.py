"""Plain-JAX (XLA) attention with the contracts of gqa_decode / gqa_prefill: append the new
K/V with a scatter, then masked attention over every slot of the static cache.

This is what a JAX user writes today, and the comparator of the benchmarks: it reads all S
slots however few are live. DESIGN.md measured it at 17 us for a 4096-slot bf16 cache at B=1,
Hq=32, Hkv=8, D=128 on an H200.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_kv.layout import Layout


def _append(
    cache: jax.Array, new: jax.Array, lengths: jax.Array, new_lengths: jax.Array, layout: Layout
) -> jax.Array:
    """Writes new [B, T, Hkv, D] at positions lengths[b] + t for t < new_lengths[b]."""
    B, T = new.shape[:2]
    S = layout.capacity_of(cache.shape)
    pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    # Rows past new_lengths go to an out-of-range slot and are dropped by the scatter.
    pos = jnp.where(jnp.arange(T)[None] < new_lengths[:, None], pos, S)
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    if layout == Layout.SEQ_MAJOR:
        return cache.at[b, pos].set(new, mode="drop")
    return cache.at[b, :, pos].set(new, mode="drop")  # [B, T] x Hkv x D rows


def xla_gqa_prefill(
    q,
    k,
    v,
    k_cache,
    v_cache,
    lengths,
    *,
    new_lengths=None,
    layout,
    scale=None,
    softcap=None,
    window=None,
):
    """gqa_prefill's contract in plain JAX: q [B, T, Hq, D], k, v [B, T, Hkv, D]."""
    layout = Layout.parse(layout)
    B, T, Hq, D = q.shape
    _, S, Hkv, _ = layout.dims_of(k_cache.shape)
    G = Hq // Hkv
    new_lengths = jnp.full((B,), T, jnp.int32) if new_lengths is None else new_lengths
    k_cache = _append(k_cache, k, lengths, new_lengths, layout)
    v_cache = _append(v_cache, v, lengths, new_lengths, layout)
    cache_spec = "bshd" if layout == Layout.SEQ_MAJOR else "bhsd"
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum(f"bthgd,{cache_spec}->bhgts", qg, k_cache, preferred_element_type=jnp.float32)
    s = s * jnp.float32(1.0 / math.sqrt(D) if scale is None else scale)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    qpos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    kpos = jnp.arange(S, dtype=jnp.int32)
    mask = kpos[None, None, :] <= qpos[:, :, None]  # [B, T, S]
    if window:
        mask &= kpos[None, None, :] > qpos[:, :, None] - window
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jnp.einsum(
        f"bhgts,{cache_spec}->bthgd", p, v_cache, preferred_element_type=jnp.float32
    ).astype(q.dtype)
    valid = jnp.arange(T)[None, :] < new_lengths[:, None]  # [B, T]
    out = jnp.where(valid[:, :, None, None, None], out, 0).reshape(B, T, Hq, D)
    return out, k_cache, v_cache


def xla_gqa_decode(
    q, k, v, k_cache, v_cache, lengths, *, layout, scale=None, softcap=None, window=None
):
    """gqa_decode's contract in plain JAX: q [B, Hq, D], k, v [B, Hkv, D]."""
    out, k_cache, v_cache = xla_gqa_prefill(
        q[:, None],
        k[:, None],
        v[:, None],
        k_cache,
        v_cache,
        lengths,
        layout=layout,
        scale=scale,
        softcap=softcap,
        window=window,
    )
    return out[:, 0], k_cache, v_cache
