"""On-device token sampling: greedy, temperature, top-k, top-p, with a seeded key.

Runs inside the jitted decode step, so choosing a token never costs a host round trip; the
sampling parameters are static (part of the compiled step's key), the key is a device value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy. Why: `sample` divides float32 logits by the
# temperature. At 1e-38 a logit of 4 already overflows float32 (max 3.4e38) to inf, and below
# 1e-45 the temperature itself rounds to 0 (x / 0 = inf or NaN): the first +inf logit wins, so
# categorical returned index 0 (or the first positive logit), not the most likely token. Above
# 1e-5, logits up to 3.4e33 stay finite; below it, a runner-up 1e-3 under the top logit is
# drawn with odds exp(-1e-3 / 1e-5) = exp(-100): sampling there is greedy in all but name.
GREEDY_BELOW = 1e-5

# jax.random.key takes a signed 64-bit seed (2**63 raises OverflowError); with jax_enable_x64
# off it keys on the low 32 bits, so seeds 2**32 apart give the same tokens.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _real(name: str, value: Any, expectation: str) -> float:
    """`value` as a float if it is a finite real number (bool, str, NaN, inf refused)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected {expectation}, got {type(value).__name__} {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        as_float = math.inf
    if not math.isfinite(as_float):
        raise ValueError(f"{name}: expected {expectation}, got {value!r}")
    return as_float


def _int(name: str, value: Any, expectation: str) -> int:
    """`value` as an int if it is an integer (bool and integral floats such as 2.0 refused)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: expected {expectation}, got {type(value).__name__} {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick the next token. Greedy (argmax; top_k / top_p ignored) when
    `temperature < GREEDY_BELOW` (1e-5), 0 included.

    temperature: finite, >= 0; logits are divided by it before sampling.
    top_k: int >= 0; keep the k most likely tokens (0 = all).
    top_p: in (0, 1]; keep the smallest set of tokens whose probability reaches top_p
        (1.0 = all).
    seed: int in [-2**63, 2**63); seeds the jax.random key, the same seed gives the same
        tokens (JAX keys on its low 32 bits unless jax_enable_x64 is on).

    Values are checked and stored as Python float / int (a NumPy scalar is converted), so
    equal settings make equal, equally hashed step keys. Bad values raise a ValueError that
    names the field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature, "a finite number >= 0")
        if temperature < 0.0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
        top_k = _int("top_k", self.top_k, "an int >= 0")
        if top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0, got {top_k!r}")
        top_p = _real("top_p", self.top_p, "a finite number in (0, 1]")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: expected a finite number in (0, 1], got {top_p!r}")
        seed = _int("seed", self.seed, "an int in [-2**63, 2**63)")
        if not SEED_MIN <= seed <= SEED_MAX:
            raise ValueError(f"seed: expected an int in [-2**63, 2**63), got {seed!r}")
        for name, value in (
            ("temperature", temperature),
            ("top_k", top_k),
            ("top_p", top_p),
            ("seed", seed),
        ):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
        cutoff = _top_p_cutoff(sorted_logits, jnp.float32(sampling.top_p))
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _top_p_cutoff(sorted_logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """sorted_logits [B, V] descending, top_p scalar or [B, 1] -> the smallest logit kept
    [B, 1]: a token stays while the mass before it is below top_p (the top token always)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    return jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)


def sample_rows(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """Next tokens from logits [B, V] with each row's own sampling -> int32 [B].

    The parameters are device arrays, not part of a compiled step's key, so one step serves
    any mix of requests (the engine's rows): keys [B] (typed jax.random keys), temperature
    float32 [B] (a row below GREEDY_BELOW is greedy), top_k int32 [B] (0 = all), top_p
    float32 [B] in (0, 1]. Row b equals `sample(logits[b:b+1], keys[b], Sampling(...))`.

    Every call sorts the rows' logits, greedy rows included (they then take the argmax). A
    caller that knows on the host that every row is greedy calls `argmax_rows` instead, as
    the Engine does: choosing inside the compiled step (a `lax.cond` on a device predicate)
    makes XLA copy the predicate to the host and block the dispatching thread until the
    device reaches it."""
    greedy = temperature < GREEDY_BELOW
    V = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, GREEDY_BELOW)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)[:, None]
    kth = jnp.take_along_axis(ordered, k - 1, axis=-1)
    ordered = jnp.where(jnp.arange(V)[None, :] < k, ordered, -jnp.inf)  # top-k, then top-p
    cutoff = jnp.maximum(kth, _top_p_cutoff(ordered, top_p[:, None]))
    kept = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row[None])[0])(keys, kept)
    return jnp.where(greedy, argmax_rows(logits), drawn.astype(jnp.int32))
