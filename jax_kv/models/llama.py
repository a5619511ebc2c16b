"""Llama-3 and Qwen2/Qwen2.5 decoders as plain JAX functions over a params pytree; attention
goes through jax_kv.gqa_prefill / jax_kv.gqa_decode on per-layer caches the caller owns.

The two families differ only in Qwen2's q/k/v bias (config.qkv_bias) and their presets.
Numerics follow transformers' LlamaForCausalLM / Qwen2ForCausalLM: RMSNorm in float32 then
cast back, RoPE in the rotate-half convention with float32 cos/sin, SwiGLU MLP.

Params pytree (weights in Hugging Face orientation [out, in], so loading never transposes;
`x @ w.T` lowers to one dot_general with no transpose materialized):

    {"embed": [V, H],
     "layers": [{"attn_norm": [H],
                 "wq": [Hq*D, H], "wk": [Hkv*D, H], "wv": [Hkv*D, H],
                 "bq": [Hq*D], "bk": [Hkv*D], "bv": [Hkv*D],      # qkv_bias only
                 "wo": [H, Hq*D],
                 "mlp_norm": [H],
                 "w_gate": [I, H], "w_up": [I, H], "w_down": [H, I]}, ...],  # num_layers
     "norm": [H],
     "lm_head": [V, H]}                                           # untied only

`fuse_projections` rewrites each layer to "wqkv" [(Hq+2Hkv)*D, H] (+ "bqkv") and "w_gate_up"
[2I, H]: the same model with 2 matmuls where there were 5. Measured on an H200 (Qwen2.5-0.5B
shape, B=1): 1 kernel fewer per layer (XLA had merged some sibling projections already) and
11% less device time per token. The functions here accept either form.

Caches: a list with one (k_cache, v_cache) per layer, each [B, Hkv, S, D] (HEAD_MAJOR) or
[B, S, Hkv, D] (SEQ_MAJOR), plus one int32 [B] `lengths` shared by all layers. Layers are
unrolled in Python: DESIGN.md measured a lax.fori_loop over layers 20-40% slower.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.layout import Layout
from jax_kv.models.config import ModelConfig
from jax_kv.models.projection import matmul_rows, project
from jax_kv.ops import gqa_decode, gqa_prefill, gqa_prefill_packed
from jax_kv.ops.norm import rms_norm

Params = dict[str, Any]
Caches = list[tuple[jax.Array, jax.Array]]


def param_shapes(config: ModelConfig) -> Params:
    """The params pytree with shape tuples as leaves (what a loader must produce)."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size  # noqa: E741
    q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = {"attn_norm": (H,), "wq": (q, H), "wk": (kv, H), "wv": (kv, H)}
    if config.qkv_bias:
        layer |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    layer |= {"wo": (H, q), "mlp_norm": (H,), "w_gate": (I, H), "w_up": (I, H), "w_down": (H, I)}
    params: Params = {
        "embed": (V, H),
        "layers": [dict(layer) for _ in range(config.num_layers)],
        "norm": (H,),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = (V, H)
    return params


@functools.lru_cache(maxsize=64)
def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 [D/2] inverse frequencies, scaled as config.rope_scaling says (transformers'
    `_compute_default_rope_parameters` / `_compute_llama3_parameters`). Read-only."""
    inv_freq = _inv_freq(config)
    inv_freq.setflags(write=False)
    return inv_freq


def _inv_freq(config: ModelConfig) -> np.ndarray:
    D = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D)
    )
    inv_freq = inv_freq.astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "factors":
        return (inv_freq / np.asarray(s.factors, np.float32)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, rotated_heads: int | None = None
) -> jax.Array:
    """Rotates x [B, T, H, D] at int32 positions [B, T] (rotate-half convention); with
    rotated_heads, only heads [0, rotated_heads) turn and the rest pass through unchanged."""
    freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
    cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if rotated_heads is None or rotated_heads >= x.shape[2]:
        return out
    turn = (jnp.arange(x.shape[2]) < rotated_heads)[None, None, :, None]
    return jnp.where(turn, out, x)


def _qkv(
    p: Params, config: ModelConfig, x: jax.Array, positions: jax.Array, projection: Callable
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, H] (the residual stream: attn_norm is applied here) -> rotated q [B, T, Hq, D],
    rotated k and v [B, T, Hkv, D]."""
    B, T, _ = x.shape
    norm, eps = p["attn_norm"], config.rms_norm_eps
    D, Hq, Hkv = config.head_dim, config.num_q_heads, config.num_kv_heads
    inv_freq = rope_inv_freq(config)
    if "wqkv" in p:
        # One elementwise pass over all heads (bias, q and k rotated, v copied) instead of a
        # bias kernel and one rotation kernel each for q and k: on the GPU, XLA then hands
        # slices of that one result to the attention op (2 fewer kernels per layer).
        qkv = projection(x, p["wqkv"], p.get("bqkv"), norm=norm, eps=eps)
        qkv = qkv.reshape(B, T, Hq + 2 * Hkv, D)
        qkv = apply_rope(qkv, positions, inv_freq, rotated_heads=Hq + Hkv)
        q, k, v = jnp.split(qkv, [Hq, Hq + Hkv], axis=2)
        return q, k, v
    x = rms_norm(x, norm, eps)
    q, k, v = (projection(x, p[w], p.get(b)) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    q = q.reshape(B, T, Hq, D)
    k = k.reshape(B, T, Hkv, D)
    v = v.reshape(B, T, Hkv, D)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _mlp(p: Params, config: ModelConfig, x: jax.Array, projection: Callable) -> jax.Array:
    """x + down(silu(gate(h)) * up(h)) with h = rms_norm(x, mlp_norm): with fused gate/up
    weights the norm, the SwiGLU and the residual add ride in the two projections."""
    norm, eps = p["mlp_norm"], config.rms_norm_eps
    if "w_gate_up" in p:
        h = projection(x, p["w_gate_up"], norm=norm, eps=eps, activation="swiglu")
    else:
        h = rms_norm(x, norm, eps)
        h = jax.nn.silu(projection(h, p["w_gate"])) * projection(h, p["w_up"])
    return projection(h, p["w_down"], residual=x)


_FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(params: Params, *, delete_unfused: bool = False) -> Params:
    """The same params with each layer's q/k/v (and their biases) and gate/up weights
    concatenated along the output axis (module docstring). Layers already fused pass through.
    delete_unfused frees each layer's separate weights as soon as its fused copy exists, so
    the peak is one layer over the model's size."""
    layers = []
    for p in params["layers"]:
        fused = {k: v for k, v in p.items() if not any(k in parts for parts in _FUSED.values())}
        for name, parts in _FUSED.items():
            if all(part in p for part in parts):
                fused[name] = jnp.concatenate([p[part] for part in parts])
        if delete_unfused:
            jax.block_until_ready(fused)
            for parts in _FUSED.values():
                for part in parts:
                    if part in p:
                        p[part].delete()
        layers.append(fused)
    return params | {"layers": layers}


def _logits(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """x [..., H] -> float32 logits [..., V] (float32 accumulation)."""
    x = rms_norm(x, params["norm"], config.rms_norm_eps)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    return matmul_rows(x, head, preferred_element_type=jnp.float32)


def _check_caches(config: ModelConfig, caches: Caches) -> None:
    if len(caches) != config.num_layers:
        raise ValueError(
            f"caches: expected {config.num_layers} (k_cache, v_cache) pairs "
            f"(one per layer), got {len(caches)}"
        )


def _decoder(
    params: Params,
    config: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    caches: Caches,
    attend: Callable[..., tuple],
    projection: Callable[..., Any],
) -> tuple[jax.Array, Caches]:
    """The layers over x [b, t, H] at positions [b, t]; attend(q [b, t, Hq, D], k, v [b, t,
    Hkv, D], k_cache, v_cache) -> (attn [b, t, Hq, D], k_cache, v_cache) is the form's
    attention call (padded prefill, packed prefill or decode). -> (x [b, t, H], caches)."""
    b, t, _ = x.shape
    out_caches: Caches = []
    for p, (k_cache, v_cache) in zip(params["layers"], caches, strict=True):
        q, k, v = _qkv(p, config, x, positions, projection)
        attn, k_cache, v_cache = attend(q, k, v, k_cache, v_cache)
        x = projection(attn.reshape(b, t, -1), p["wo"], residual=x)
        x = _mlp(p, config, x, projection)
        out_caches.append((k_cache, v_cache))
    return x, out_caches


def prefill(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    new_lengths: jax.Array | None,
    caches: Caches,
    lengths: jax.Array,
    *,
    layout: Layout | str | int,
    last_only: bool = False,
    attention: Callable[..., Any] = gqa_prefill,
    projection: Callable[..., Any] | None = None,
    committed: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Runs T new tokens per sequence through the decoder, appending their K/V to the caches.

    The padded form: every row computes T positions. `prefill_packed` computes only the real
    tokens (what the Generator runs).

    Args:
        params: the params pytree (module docstring).
        config: the model's ModelConfig (static under jit).
        tokens: int32 [B, T]; row b holds new_lengths[b] real tokens, then padding.
        new_lengths: int32 [B], real tokens per row (None: all T).
        caches: per layer (k_cache, v_cache), [B, Hkv, S, D] or [B, S, Hkv, D] as `layout`
            says; donate them, they are updated in place.
        lengths: int32 [B], tokens already cached; token t of row b sits at position
            lengths[b] + t (its RoPE position and its cache slot).
        layout: the caches' Layout.
        last_only: return only the logits of each row's last real token.
        attention: gqa_prefill, or a function of the same contract (the benchmarks' plain-JAX
            comparator, jax_kv.ops.xla_attention.xla_gqa_prefill).
        projection: a function of jax_kv.models.projection.project's contract (None: project,
            XLA's dots and elementwise ops).
        committed: int32 [B], positions backed by committed cache memory (gqa_prefill's
            `committed`). When given, the status path is on: the attention calls return
            their status and the result carries its per-row maximum over layers.

    Returns:
        (logits, caches), plus status int32 [B] (0 = ok) when `committed` is given: float32
        logits [B, T, V] (rows t >= new_lengths[b] are meaningless) or [B, V] if last_only;
        caches with the new K/V written. The caller advances lengths by new_lengths.
    """
    B, T = tokens.shape
    _check_caches(config, caches)
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    x = jnp.take(params["embed"], tokens, axis=0)  # [B, T, H]
    checked = _StatusPath(committed, B)

    def attend(q, k, v, k_cache, v_cache):
        return checked(
            attention(
                q, k, v, k_cache, v_cache, lengths, new_lengths=new_lengths, layout=layout,
                **checked.kwargs,
            )
        )  # fmt: skip

    x, out_caches = _decoder(params, config, x, positions, caches, attend, projection or project)
    if last_only:
        last = jnp.full((B,), T - 1, jnp.int32) if new_lengths is None else new_lengths - 1
        x = x[jnp.arange(B), jnp.maximum(last, 0)]  # [B, H]
    return checked.result(_logits(params, config, x), out_caches)


def packed_positions(cu_seqlens: jax.Array, lengths: jax.Array, num_tokens: int) -> jax.Array:
    """int32 [N] cache position of each packed token: row b's tokens cu_seqlens[b] ...
    cu_seqlens[b+1]-1 sit at lengths[b], lengths[b]+1, ...; padding tokens (>= cu_seqlens[B])
    get the last row's next positions (their attention output is zeros and nothing is
    written for them; their position only has to be a valid RoPE angle)."""
    j = jnp.arange(num_tokens, dtype=jnp.int32)
    # Unrolled: the default method is a while loop, which XLA runs outside the step's CUDA
    # graph (one host launch per iteration, and the graph cut in two around it).
    row = jnp.searchsorted(cu_seqlens[1:-1], j, side="right", method="scan_unrolled")
    row = row.astype(jnp.int32)  # [N], in [0, B)
    return lengths[row] + j - cu_seqlens[row]


def prefill_packed(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    cu_seqlens: jax.Array,
    caches: Caches,
    lengths: jax.Array,
    *,
    layout: Layout | str | int,
    attention: Callable[..., Any] = gqa_prefill_packed,
    projection: Callable[..., Any] | None = None,
    committed: jax.Array | None = None,
    decode_tokens: jax.Array | None = None,
    decode_bound: jax.Array | None = None,
    decode_attention: Callable[..., Any] = gqa_decode,
) -> tuple[jax.Array, ...]:
    """Runs the real new tokens of B cache rows, packed on one token axis, through the decoder:
    projections, norms, MLP and attention see [N, H] activations, so padding costs only the
    rounding of N (jax_kv.gqa_prefill_packed's contract).

    With `decode_tokens`, the same call also advances other rows by one token each, as
    `decode_step` would (the Engine's step: one pass over the weights for a prefill chunk and
    the running requests' next tokens): their B tokens join the N on the token axis for the
    projections and the MLP, and attend through `decode_attention` (gqa_decode's contract,
    the decode kernel) with `decode_bound` as its write bound.

    Args:
        tokens: int32 [N]; row b's new tokens are tokens[cu_seqlens[b]:cu_seqlens[b+1]], the
            rest (>= cu_seqlens[B]) padding.
        cu_seqlens: int32 [B+1], 0 = cu_seqlens[0] <= ... <= cu_seqlens[B] <= N. A row with no
            new tokens has cu_seqlens[b] == cu_seqlens[b+1] (its logits are meaningless).
        caches, lengths, layout, projection, committed: as in `prefill` (B rows).
        attention: gqa_prefill_packed or a function of its contract.
        decode_tokens: int32 [B], the token each decoding row writes at lengths[b]; needs
            `decode_bound` and `committed`.
        decode_bound: int32 [B], gqa_decode's `committed` for the decoding rows: 0 for every
            other row (idle: the decode op neither reads nor writes it). A row is a prefill
            row or a decoding row or neither, never both.
        decode_attention: gqa_decode or a function of its contract.

    Returns:
        (float32 logits [B, V] of each row's last new token, caches), plus status int32 [B]
        when `committed` is given. With decode rows, a row with no packed tokens gets its
        decode token's logits. The caller advances lengths[b] by cu_seqlens[b+1] -
        cu_seqlens[b], and each decoding row's by 1.
    """
    (N,) = tokens.shape
    B = lengths.shape[0]
    _check_caches(config, caches)
    decoding = decode_tokens is not None
    if decoding and (decode_bound is None or committed is None):
        raise ValueError("decode_tokens: needs decode_bound and committed (the status path)")
    positions = packed_positions(cu_seqlens, lengths, N)
    x = jnp.take(params["embed"], tokens, axis=0)  # [N, H]
    if decoding:
        positions = jnp.concatenate([positions, lengths])
        x = jnp.concatenate([x, jnp.take(params["embed"], decode_tokens, axis=0)])
    checked = _StatusPath(committed, B)
    checked_decode = _StatusPath(decode_bound, B)

    def attend(q, k, v, k_cache, v_cache):
        attn, k_cache, v_cache = checked(
            attention(
                q[0, :N], k[0, :N], v[0, :N], k_cache, v_cache, lengths, cu_seqlens,
                layout=layout, **checked.kwargs,
            )
        )  # fmt: skip
        if decoding:
            rows, k_cache, v_cache = checked_decode(
                decode_attention(
                    q[0, N:], k[0, N:], v[0, N:], k_cache, v_cache, lengths, layout=layout,
                    **checked_decode.kwargs,
                )
            )  # fmt: skip
            attn = jnp.concatenate([attn, rows])
        return attn[None], k_cache, v_cache

    x, out_caches = _decoder(
        params, config, x[None], positions[None], caches, attend, projection or project
    )
    last = x[0, jnp.clip(cu_seqlens[1:] - 1, 0, N - 1)]  # [B, H]
    if decoding:
        packed = cu_seqlens[1:] > cu_seqlens[:-1]
        last = jnp.where(packed[:, None], last, x[0, N:])
        checked.status = jnp.maximum(checked.status, checked_decode.status)
    return checked.result(_logits(params, config, last), out_caches)


def decode_step(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    caches: Caches,
    lengths: jax.Array,
    *,
    layout: Layout | str | int,
    attention: Callable[..., Any] = gqa_decode,
    projection: Callable[..., Any] | None = None,
    committed: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """One token per sequence: tokens int32 [B] at positions lengths [B] (< S).

    `attention` is gqa_decode or a function of the same contract (the benchmarks' plain-JAX
    comparator, jax_kv.ops.xla_attention.xla_gqa_decode); `projection` is one of
    jax_kv.models.projection.project's contract (None: project).

    `committed` (int32 [B]) bounds the cache writes and turns the status path on, as in
    `prefill`. Returns (float32 logits [B, V], caches), plus status int32 [B] when `committed`
    is given; the caller advances lengths by 1.

    `rows` (int32 [n], n <= B; the Engine's decode row buckets): the cache rows this step
    advances, then B (padding) to fill n. The embedding, projections, norms, MLP and logits
    then run on n rows, not B: the attention op still sees B rows (the listed rows' q, k, v
    scattered to their cache rows, zeros elsewhere), so `committed` must be given and 0 for
    every row not listed (idle: no reads, no writes). The logits are then [n, V], row i the
    next token's of cache row rows[i] (a padding row's meaningless); status stays [B].
    """
    (B,) = tokens.shape
    _check_caches(config, caches)
    if rows is not None:
        if rows.ndim != 1 or rows.shape[0] > B or rows.dtype != jnp.int32:
            raise ValueError(f"rows: expected int32 [n <= B={B}], got {rows.dtype} {rows.shape}")
        if committed is None:
            raise ValueError("rows: needs committed (0 for every row not listed: idle)")
    # Padding rows read row B-1 (clip) and are dropped when scattered (index B).
    gather = (lambda a: a) if rows is None else (lambda a: jnp.take(a, rows, 0, mode="clip"))
    scatter = (
        (lambda a: a)
        if rows is None
        else (lambda a: jnp.zeros((B, *a.shape[1:]), a.dtype).at[rows].set(a, mode="drop"))
    )
    x = jnp.take(params["embed"], gather(tokens), axis=0)[:, None, :]  # [n, 1, H]
    checked = _StatusPath(committed, B)

    def attend(q, k, v, k_cache, v_cache):
        attn, *rest = checked(
            attention(
                scatter(q[:, 0]), scatter(k[:, 0]), scatter(v[:, 0]), k_cache, v_cache, lengths,
                layout=layout, **checked.kwargs,
            )
        )  # fmt: skip
        return (gather(attn)[:, None], *rest)

    positions = gather(lengths)[:, None]  # [n, 1]
    x, out_caches = _decoder(params, config, x, positions, caches, attend, projection or project)
    return checked.result(_logits(params, config, x[:, 0]), out_caches)


class _StatusPath:
    """The attention calls' status, on when `committed` is given: each call passes it and
    asks for its status; the step's status is the per-row maximum over the layers (any
    nonzero code means the row was refused somewhere and its output is NaN)."""

    def __init__(self, committed: jax.Array | None, batch: int) -> None:
        self.on = committed is not None
        self.kwargs = dict(committed=committed, return_status=True) if self.on else {}
        self.status = jnp.zeros((batch,), jnp.int32)

    def __call__(self, outputs: tuple) -> tuple:
        if not self.on:
            return outputs
        self.status = jnp.maximum(self.status, outputs[3])
        return outputs[:3]

    def result(self, logits: jax.Array, caches: Caches) -> tuple:
        return (logits, caches, self.status) if self.on else (logits, caches)


# The steps jitted with the caches donated: XLA writes the new K/V in place.
prefill_jit = jax.jit(
    prefill, static_argnames=("config", "layout", "last_only"), donate_argnames=("caches",)
)
decode_step_jit = jax.jit(
    decode_step, static_argnames=("config", "layout"), donate_argnames=("caches",)
)


def init_caches(
    config: ModelConfig,
    batch: int,
    capacity: int,
    *,
    layout: Layout | str | int,
    dtype: Any = jnp.float32,
) -> Caches:
    """Zeroed per-layer (k_cache, v_cache), each layout.cache_shape(B, S, Hkv, D).

    A plain static cache for tests and the reference loop; jax_kv.cache's KvCache is the
    growing one.
    """
    shape = Layout.parse(layout).cache_shape(batch, capacity, config.num_kv_heads, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]


# Megatron-style tensor parallelism over a mesh axis: q/k/v, gate and up are column-parallel
# (their output rows split, whole heads and hidden units per shard), wo and w_down row-parallel
# (their input columns split: each shard's partial sum, then one all-reduce XLA inserts).
_COLUMN_PARALLEL = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")
_ROW_PARALLEL = ("wo", "w_down")


def partition_specs(params: Params, axis: str = "tp") -> Any:
    """The PartitionSpec of each param for tensor parallelism over `axis` (a pytree like
    params): column-parallel q/k/v/gate/up, row-parallel wo/down, the rest replicated.

    Fused weights (`fuse_projections`) are refused: their concatenated rows (q, k, v; gate,
    up) would split across the wrong boundary. Shard the unfused params, then run the step.
    """
    P = jax.sharding.PartitionSpec

    def layer_spec(name: str, w: Any) -> Any:
        if name in _FUSED:
            raise ValueError(
                f"params: layer weight {name!r} is fused; tensor parallelism shards the "
                f"unfused {', '.join(_FUSED[name])} (load without fuse_projections)"
            )
        if name in _COLUMN_PARALLEL:
            return P(axis, *([None] * (len(w.shape) - 1)))
        if name in _ROW_PARALLEL:
            return P(None, axis)
        return P()

    specs: dict[str, Any] = {k: P() for k in params if k != "layers"}
    specs["layers"] = [{n: layer_spec(n, w) for n, w in p.items()} for p in params["layers"]]
    return specs


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any, scale: float) -> jax.Array:
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_params(config: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> Params:
    """Seeded random params, generated on the device tensor by tensor.

    Matrices ~ N(0, 1/fan_in) so activations stay O(1) through the layers; norm weights
    1 + N(0, 0.1); biases N(0, 0.1): every weight matters to the logits, which makes these
    models useful in comparison tests (transformers' N(0, 0.02) init leaves logits flat).
    """
    key = jax.random.key(seed)
    counter = iter(range(1 << 30))

    def make(path: str, shape: tuple[int, ...]) -> jax.Array:
        k = jax.random.fold_in(key, next(counter))
        if path.endswith("norm"):
            return 1 + _normal(k, shape, dtype, 0.1)
        if len(shape) == 1:
            return _normal(k, shape, dtype, 0.1)
        return _normal(k, shape, dtype, 1.0 if path == "embed" else 1 / math.sqrt(shape[1]))

    shapes = param_shapes(config)
    params: Params = {"embed": make("embed", shapes["embed"])}
    params["layers"] = [
        {name: make(name, s) for name, s in layer.items()} for layer in shapes["layers"]
    ]
    params["norm"] = make("norm", shapes["norm"])
    if "lm_head" in shapes:
        params["lm_head"] = make("lm_head", shapes["lm_head"])
    return params


__all__ = [
    "Caches",
    "Params",
    "apply_rope",
    "decode_step",
    "decode_step_jit",
    "init_caches",
    "param_shapes",
    "partition_specs",
    "prefill",
    "prefill_jit",
    "random_params",
    "rms_norm",
    "rope_inv_freq",
]
