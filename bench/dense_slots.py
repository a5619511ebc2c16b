"""The comparator of bench/serve.py: a slot engine written the way JetStream writes one, in
plain JAX (issue 21, comparator b).

A dense cache [slots, max_len] per layer and K/V, allocated up front. A request is prefilled
alone, padded to a power-of-two bucket, into a fresh [1, bucket] cache; that cache is inserted
into its slot with dynamic_update_slice; one generate step decodes every slot with attention
over the whole max_len, masked by the lengths. The attention is the best plain JAX has:
`jax.nn.dot_product_attention` with sequence lengths, cuDNN on a GPU (XLA elsewhere). The
model code, the projections and the greedy argmax are the ones jax_kv runs, so the cache, the
attention and the scheduling are what differ.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.cache import bucket_for
from jax_kv.decode.sampling import argmax_rows
from jax_kv.layout import Layout
from jax_kv.models import llama

MIN_BUCKET = 64


def _attention_impl() -> str | None:
    return "cudnn" if jax.default_backend() == "gpu" else None


def prefill_attention(q, k, v, k_cache, v_cache, lengths, *, new_lengths, layout, impl):
    """A fresh [1, T] cache: the new K/V are the cache; causal attention over the real rows."""
    del k_cache, v_cache, lengths, layout
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=new_lengths,
        key_value_seq_lengths=new_lengths, implementation=impl,
    )  # fmt: skip
    return out, k, v


def decode_attention(q, k, v, k_cache, v_cache, lengths, *, layout, impl):
    """Appends the new token at lengths[b] (a scatter), then attends over every slot of the
    dense cache with key_value_seq_lengths = lengths + 1."""
    del layout
    B = q.shape[0]
    rows = jnp.arange(B)
    k_cache = k_cache.at[rows, lengths].set(k)
    v_cache = v_cache.at[rows, lengths].set(v)
    out = jax.nn.dot_product_attention(
        q[:, None], k_cache, v_cache, key_value_seq_lengths=lengths + 1, implementation=impl
    )
    return out[:, 0], k_cache, v_cache


class DenseSlotEngine:
    """slots dense rows of max_len tokens; greedy. `run(arrivals, prompts, news, clock)` serves
    requests as they arrive and returns per-request token times."""

    def __init__(self, model: Any, slots: int, max_len: int) -> None:
        self.model, self.slots, self.max_len = model, slots, max_len
        config, layout, impl = model.config, Layout.SEQ_MAJOR, _attention_impl()
        self.params = model.fused_params()
        self.caches = llama.init_caches(config, slots, max_len, layout=layout, dtype=model.dtype)
        self.cache_bytes = sum(k.nbytes + v.nbytes for k, v in self.caches)

        @jax.jit
        def prefill(params, tokens, n):
            T = tokens.shape[1]
            fresh = llama.init_caches(config, 1, T, layout=layout, dtype=model.dtype)
            logits, caches = llama.prefill(
                params, config, tokens, n, fresh, jnp.zeros((1,), jnp.int32), layout=layout,
                last_only=True, attention=functools.partial(prefill_attention, impl=impl),
            )  # fmt: skip
            return argmax_rows(logits)[0], caches

        @functools.partial(jax.jit, donate_argnums=(0,))
        def insert(caches, fresh, slot):
            return [
                tuple(
                    jax.lax.dynamic_update_slice(c, f, (slot, 0, 0, 0))
                    for c, f in zip(cs, fs, strict=True)
                )
                for cs, fs in zip(caches, fresh, strict=True)
            ]

        @functools.partial(jax.jit, donate_argnums=(2,))
        def generate(params, tokens, caches, lengths):
            logits, caches = llama.decode_step(
                params, config, tokens, caches, lengths, layout=layout,
                attention=functools.partial(decode_attention, impl=impl),
            )  # fmt: skip
            return argmax_rows(logits), caches

        self._prefill, self._insert, self._generate = prefill, insert, generate

    def buckets(self, longest: int) -> list[int]:
        out, b = [], MIN_BUCKET
        while True:
            out.append(min(b, self.max_len))
            if b >= longest or b >= self.max_len:
                return out
            b *= 2

    def warm_up(self, longest_prompt: int) -> None:
        """Compiles every prefill and insert bucket and the generate step."""
        for T in self.buckets(longest_prompt):
            tok, fresh = self._prefill(
                self.params, jnp.zeros((1, T), jnp.int32), jnp.ones(1, jnp.int32)
            )
            self.caches = self._insert(self.caches, fresh, 0)
        z = jnp.zeros((self.slots,), jnp.int32)
        out, self.caches = self._generate(self.params, z, self.caches, z)
        np.asarray(out)

    def run(self, arrivals, prompts, news, clock) -> list[list[float]]:
        """Serves request i from time arrivals[i] (clock() seconds): returns the times of
        each request's tokens."""
        n = len(prompts)
        times: list[list[float]] = [[] for _ in range(n)]
        order = np.argsort(arrivals, kind="stable")
        nxt = 0
        slot_req = [-1] * self.slots
        lengths = np.zeros((self.slots,), np.int32)
        tokens = np.zeros((self.slots,), np.int32)
        left = np.zeros((self.slots,), np.int64)
        done = 0
        while done < n:
            now = clock()
            # Prefill every arrived request a free slot can take, then insert it.
            while nxt < n and arrivals[order[nxt]] <= now and -1 in slot_req:
                i = int(order[nxt])
                nxt += 1
                b = slot_req.index(-1)
                p = prompts[i]
                T = bucket_for(len(p), MIN_BUCKET, self.max_len)
                padded = np.zeros((1, T), np.int32)
                padded[0, : len(p)] = p
                tok, fresh = self._prefill(
                    self.params, jnp.asarray(padded), jnp.asarray([len(p)], jnp.int32)
                )
                self.caches = self._insert(self.caches, fresh, b)
                tokens[b] = int(tok)
                times[i].append(clock())
                lengths[b] = len(p)
                left[b] = news[i] - 1
                slot_req[b] = i
                if left[b] == 0:
                    slot_req[b], lengths[b] = -1, 0
                    done += 1
            if all(r == -1 for r in slot_req):
                if nxt < n:
                    time.sleep(max(0.0, min(0.01, arrivals[order[nxt]] - clock())))
                continue
            out, self.caches = self._generate(
                self.params, jnp.asarray(tokens), self.caches, jnp.asarray(lengths)
            )
            out = np.asarray(out)
            t = clock()
            for b, i in enumerate(slot_req):
                if i < 0:
                    continue
                times[i].append(t)
                tokens[b] = out[b]
                lengths[b] += 1
                left[b] -= 1
                if left[b] == 0:
                    slot_req[b], lengths[b] = -1, 0
                    done += 1
        return times
