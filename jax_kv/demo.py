"""A small demo of the ops: prefill a ragged batch and decode a few tokens through one
attention layer, in both cache layouts, and print how closely they agree with each other and
with plain-JAX attention over the full sequences."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import Layout, gqa_decode, gqa_prefill


def _plain_attention(q, k, v):
    """Causal GQA attention in plain JAX, f32: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(D))
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s, -jnp.inf)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v)


def run(
    batch: int = 2,
    prompt: tuple[int, ...] = (7, 4),
    steps: int = 8,
    capacity: int = 64,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
) -> None:
    rng = np.random.default_rng(seed)
    T = max(prompt)
    total = T + steps

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    # One sequence of q/k/v per batch row: the prompt's tokens, then one per decode step.
    q_all, k_all, v_all = (
        rand(batch, total, h, head_dim) for h in (num_q_heads, num_kv_heads, num_kv_heads)
    )
    new_lengths = jnp.asarray(prompt, jnp.int32)
    outs = {}
    for layout in Layout:
        t0 = time.perf_counter()
        shape = layout.cache_shape(batch, capacity, num_kv_heads, head_dim)
        k_cache, v_cache = jnp.zeros(shape), jnp.zeros(shape)
        prefill = jax.jit(
            lambda q, k, v, kc, vc, n, nl, layout=layout: gqa_prefill(
                q, k, v, kc, vc, n, new_lengths=nl, layout=layout
            ),
            donate_argnums=(3, 4),
        )
        decode = jax.jit(
            lambda q, k, v, kc, vc, n, layout=layout: gqa_decode(q, k, v, kc, vc, n, layout=layout),
            donate_argnums=(3, 4),
        )
        # Row b's prompt is tokens [0, prompt[b]); its decode tokens follow from prompt[b] on.
        out, k_cache, v_cache = prefill(
            q_all[:, :T],
            k_all[:, :T],
            v_all[:, :T],
            k_cache,
            v_cache,
            jnp.zeros((batch,), jnp.int32),
            new_lengths,
        )
        rows = [[out[b, t] for t in range(prompt[b])] for b in range(batch)]
        lengths = new_lengths
        for _ in range(steps):
            idx = lengths[:, None, None, None]
            pick = [jnp.take_along_axis(x, idx, axis=1)[:, 0] for x in (q_all, k_all, v_all)]
            out, k_cache, v_cache = decode(*pick, k_cache, v_cache, lengths)
            for b in range(batch):
                rows[b].append(out[b])
            lengths = lengths + 1
        outs[layout] = [jnp.stack(r) for r in rows]
        print(
            f"{layout.name:>10}: cache {list(shape)}, prefill {list(prompt)} tokens + "
            f"{steps} decode steps in {time.perf_counter() - t0:.2f} s (incl. compile)"
        )
    for b in range(batch):
        n = prompt[b] + steps
        ref = _plain_attention(q_all[b, :n], k_all[b, :n], v_all[b, :n])
        hm, sm = outs[Layout.HEAD_MAJOR][b], outs[Layout.SEQ_MAJOR][b]
        print(
            f"  row {b}: {n} tokens; max |head-major - seq-major| = "
            f"{float(jnp.max(jnp.abs(hm - sm))):.2e}; max |jax_kv - plain JAX| = "
            f"{float(jnp.max(jnp.abs(sm - ref))):.2e}"
        )
