"""The reference generation loop the Generator is checked against: greedy, static cache."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jax_kv.layout import Layout
from jax_kv.models import llama


def greedy_static(
    params,
    config,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    layout: Layout | str | int = Layout.SEQ_MAJOR,
    capacity: int | None = None,
    stop_tokens: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy decoding of a batch of (ragged) prompts: one prefill, then decode steps.

    The test oracle of the Generator (moved here from jax_kv.models.llama): a static cache of
    `capacity` slots, the model's own prefill and decode_step, one host sync per token, no
    growth, no VMM, no multi-token calls. A row stops after
    emitting a token in `stop_tokens` (that token is kept).

    Returns the new tokens of each prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected one or more non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    layout = Layout.parse(layout)
    B, T = len(prompts), max(len(p) for p in prompts)
    needed = T + max_new_tokens
    capacity = needed if capacity is None else capacity
    if capacity < needed:
        raise ValueError(
            f"capacity: expected >= longest prompt + max_new_tokens = {needed}, got {capacity}"
        )
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    new_lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    dtype = params["embed"].dtype
    caches = llama.init_caches(config, B, capacity, layout=layout, dtype=dtype)
    lengths = jnp.zeros((B,), jnp.int32)
    logits, caches = llama.prefill_jit(
        params,
        config,
        jnp.asarray(tokens),
        new_lengths,
        caches,
        lengths,
        layout=layout,
        last_only=True,
    )
    lengths = lengths + new_lengths
    next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    stop = set(stop_tokens)
    for step in range(max_new_tokens):
        for b, t in enumerate(np.asarray(next_tokens).tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t in stop
        if all(done) or step == max_new_tokens - 1:
            break
        logits, caches = llama.decode_step_jit(
            params, config, next_tokens, caches, lengths, layout=layout
        )
        lengths = lengths + 1
        next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return out
