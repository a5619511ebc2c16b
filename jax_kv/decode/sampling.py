"""On-device token sampling: greedy, temperature, top-k, top-p, with a seeded key.

Runs inside the jitted decode step, so choosing a token never costs a host round trip; the
sampling parameters are static (part of the compiled step's key), the key is a device value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick the next token. `temperature == 0` is greedy (top_k / top_p ignored).

    temperature: logits are divided by it before sampling.
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = all).
    seed: seeds the jax.random key; the same seed gives the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature: expected >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: expected 0 < top_p <= 1, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()

# Vocabulary chunk of the two-stage argmax: enough rows for the first stage to fill the GPU
# (151936 / 1024 = 149 rows per sequence), short enough that each row is one block's work.
_ARGMAX_CHUNK = 1024


def argmax_rows(logits: jax.Array) -> jax.Array:
    """argmax over the last axis of [B, V] -> int32 [B], equal to jnp.argmax (first maximum,
    NaN counts as the maximum).

    Why not jnp.argmax: XLA lowers it to one row reduction per sequence, and a row of 152k
    logits on one block took 141 us per token on the H200 at B=1, 16% of a Qwen2.5-0.5B step
    (bench/results/step_profile_h200_after.log). Here the first stage reduces [B, V/C, C]
    chunks in parallel and the second picks among V/C chunk maxima; the first chunk holding
    the maximum holds its first occurrence, so ties and NaN resolve as jnp.argmax does.
    """
    B, V = logits.shape
    if V <= _ARGMAX_CHUNK:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    n = -(-V // _ARGMAX_CHUNK)
    padded = jnp.pad(logits, ((0, 0), (0, n * _ARGMAX_CHUNK - V)), constant_values=-jnp.inf)
    chunks = padded.reshape(B, n, _ARGMAX_CHUNK)
    within = jnp.argmax(chunks, axis=-1)  # [B, n]
    best = jnp.max(chunks, axis=-1)  # [B, n]; NaN propagates, as argmax ranks it
    chunk = jnp.argmax(best, axis=-1)  # [B]
    offset = jnp.take_along_axis(within, chunk[:, None], axis=-1)[:, 0]
    return (chunk * _ARGMAX_CHUNK + offset).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens from logits [B, V] (any float dtype) -> int32 [B]."""
    if sampling.greedy:
        return argmax_rows(logits)
    logits = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
    V = logits.shape[-1]
    if sampling.top_k and sampling.top_k < V:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token while the mass before it is below top_p: the top token always stays.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < jnp.float32(sampling.top_p)
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
