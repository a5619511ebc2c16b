"""Generator: the jit-compiled generation loop over a growing KvCache.

Per token, in Python and outside jit: `cache.ensure_capacity(L + n)`; the GrowthEvent decides,
with a named reason, whether the compiled step is kept (pointers and shapes unchanged:
seq-major under VMM) or invalidated (a shape or a pointer changed: head-major re-stride, any
growth without VMM). Then one jitted step runs with the cache donated: n decode steps and
on-device sampling. Every decision is counted; the counters are the evidence.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import _ffi
from jax_kv.cache import KvCache, bucket_for
from jax_kv.config import runtime_config, step_compiler_options
from jax_kv.decode.protocol import DecoderModel
from jax_kv.decode.sampling import GREEDY, Sampling, sample
from jax_kv.layout import Layout
from jax_kv.parallel import params_and_attention

PREFILL_MIN_TOKENS = 16  # a prefill call's tokens are padded to powers of two from here
# The most real tokens one prefill call computes: its temporaries do not depend on the prompts.
PREFILL_CHUNK_TOKENS = 4096

# The arguments each step kind donates (see _call): prefill (params, tokens, cu_seqlens,
# caches, lengths, committed, ends, next_tok, status, rng), decode (params, tokens, caches,
# lengths, committed, last, rng).
_DONATED = {"prefill": (3, 4, 7, 8, 9), "decode": (1, 2, 3, 6)}

# GenerationStats fields copied from KvCache.stats() at the end of a run.
_CACHE_STATS = (
    "growth_events",
    "growth_keeps",
    "kv_bytes_moved",
    "committed_bytes",
    "reserved_bytes",
    "arena",
    "capacity",
)

# Why a row stopped (GenerationResult.finish_reasons).
FINISH_STOP = "stop"  # it emitted a stop token (kept as its last token)
FINISH_MAX_NEW_TOKENS = "max_new_tokens"  # it generated max_new_tokens
FINISH_LENGTH = "length"  # prompt + new tokens reached max_len (or the model's maximum) first

# What a latched status code of the attention ops means (cuda/gqa_params.h, JKV_STATUS_*).
STATUS_CAUSES = {
    1: "a cache position at or past the committed capacity (lengths out of range)",
    2: "new_lengths outside [0, T]",
    3: "cu_seqlens malformed (not starting at 0, decreasing, or past the packed tokens)",
}


class StepStatusError(ValueError):
    """A compiled step refused a row (its attention status latched): the row's output was
    NaN and its cache untouched; raised by the host one call late, naming the row."""


def _with_status(tokens: jax.Array, status: jax.Array) -> jax.Array:
    """The emitted ids [B]: a refused row's status code as a negative id. The status then
    needs no output buffer of its own (a fresh output per call would be one more address for
    XLA's recorded CUDA graph to follow) and reaches the host with the tokens, one call late."""
    return jnp.where(status > 0, -status, tokens)


def _check_status(emitted: np.ndarray, where: str) -> None:
    """emitted: int32 [B] or [n, B] ids from _with_status."""
    status = np.maximum(-np.atleast_2d(emitted), 0).max(axis=0)  # [B], the worst code per row
    bad = np.flatnonzero(status)
    if bad.size:
        b, code = int(bad[0]), int(status[bad[0]])
        cause = STATUS_CAUSES.get(code, f"unknown status {code}")
        raise StepStatusError(
            f"{where}: row {b} was refused by the attention op (status {code}: {cause}); its "
            f"output was NaN and its cache was not written"
            + (f" (rows {bad.tolist()} in all)" if bad.size > 1 else "")
        )


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What a compiled step is specialised on. A growth that changes any field invalidates."""

    kind: str  # "prefill" or "decode"
    layout: Layout
    capacity: int  # S of the cache arrays
    batch: int
    dtype: str
    num_tokens: int  # prefill: padded prompt length T; decode: tokens per call
    sampling: Sampling  # with seed 0: the seed only makes the rng key, an argument of the step


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the loop did with the compiled step at one growth event."""

    token_index: int  # new tokens generated before the growth
    kept: bool
    reason: str
    old_capacity: int
    new_capacity: int
    bytes_moved: int
    granules_committed: int = 0  # granules the growth mapped (0: the commit stayed inside)


@dataclasses.dataclass
class GenerationStats:
    """Counters of one `generate` call (deterministic, except the timings)."""

    captures: int = 0  # compiles of the decode step
    replays: int = 0  # decode calls that reused a compiled step
    prefill_captures: int = 0
    invalidations: int = 0  # compiled steps dropped because a growth changed shape/pointer
    growth_events: int = 0
    growth_keeps: int = 0
    kv_bytes_moved: int = 0
    committed_bytes: int = 0
    reserved_bytes: int = 0
    arena: str = ""
    layout: str = ""
    capacity: int = 0
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    # CUDA handlers' host code runs only when XLA records (not replays) its command buffer:
    # per decode call, the sum over targets of host calls (None without the CUDA module).
    host_calls_per_step: list[int] | None = None
    prefill_tokens: int = 0  # real prompt tokens
    prefill_tokens_computed: int = 0  # token positions the prefill calls computed (buckets)
    prefill_calls: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_calls: int = 0
    host_overhead_us: float = 0.0  # median per decode call: host time, waits on the device excluded
    dispatch_us: float = 0.0  # median per decode call: the jitted call alone (JAX + XLA launch)
    # median per decode step (token) of the same host time: per call / steps in that call
    host_overhead_us_per_step: float = 0.0
    compile_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def prefill_padding_ratio(self) -> float:
        """Token positions computed per real prompt token (1.0: no padding)."""
        return self.prefill_tokens_computed / self.prefill_tokens if self.prefill_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        d["prefill_padding_ratio"] = self.prefill_padding_ratio
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new token ids per prompt (a stop token, if hit, is kept)
    texts: list[str] | None  # decoded new tokens, where the model has a tokenizer
    stats: GenerationStats
    finish_reasons: list[str] = dataclasses.field(default_factory=list)  # FINISH_* per prompt


def _host_calls() -> int | None:
    cuda = _ffi.cuda_module()
    if cuda is None or not hasattr(cuda, "host_calls"):
        return None
    return int(sum(cuda.host_calls().values()))


def _limit_reason(budget: int, max_new: int) -> str:
    return FINISH_MAX_NEW_TOKENS if budget >= max_new else FINISH_LENGTH


def stop_token_set(config: Any, stop_tokens: Iterable[int] | None, name: str) -> set[int]:
    """The stop ids a caller gave as `name` (checked against the vocabulary), or the
    model's EOS ids when None. Shared by Generator and Engine."""
    if stop_tokens is None:
        return set(config.eos_token_ids)
    if isinstance(stop_tokens, str | bytes) or not isinstance(stop_tokens, Iterable):
        raise ValueError(f"{name}: expected an iterable of token ids, got {stop_tokens!r}")
    vocab = config.vocab_size
    out = set()
    for t in stop_tokens:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
            raise ValueError(f"{name}: expected token ids in [0, vocab={vocab}), got {t!r}")
        out.add(int(t))
    return out


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def growth_ask(need: np.ndarray, committed: np.ndarray, step: int, last: np.ndarray) -> np.ndarray:
    """What a per-row growth asks for, int64 [B]: each row's need, and for a row that does not
    need to grow yet but would within `step` more tokens, that much more. Rows of different
    lengths then grow together, about one growth event (and one drain of the call in flight)
    per commit step as when every row grew to the longest, not one per row; rows that grow
    together anyway (equal lengths) ask for their need alone, as before."""
    soon = np.minimum(need + step, last.astype(np.int64) + 1)
    pulled = (need <= committed) & (soon > committed)
    return np.where(pulled, soon, need)


class Generator:
    """Generates with one jitted, donated decode step per call on a growing KvCache.

    Args:
        model: a DecoderModel (jax_kv.decode.protocol), e.g. a jax_kv.models.Model.
        layout: the cache Layout (seq-major keeps its compiled step across VMM growth).
        max_len: hard cap on tokens per sequence (default: the model's
            max_position_embeddings).
        min_bucket: capacity floor and bucket base of the cache (default: JAX_KV_MIN_BUCKET,
            256).
        arena: a VmmArena or EagerArena (default: VMM on CUDA, eager elsewhere).
        tokens_per_call: decode steps per jitted call when no growth can happen inside it.
        prefill_chunk_tokens: the most prompt tokens one prefill call computes (>= 16). The
            prompts' real tokens are packed on one token axis (padded to a power of two, at
            most this), a longer prompt is prefilled over several calls: the prefill's
            temporary memory depends on this, not on the prompts.
        fuse_projections: run one q/k/v and one gate/up matmul per layer (same outputs,
            fewer and larger kernels). The fused weights are the Generator's own copy: the
            caller's params are never modified or deleted (an unfused model therefore holds
            both forms; `Model.fuse_projections()` first, or a loader's fused params, avoid it).
            Default on, off under a mesh.
        mesh: a jax.sharding.Mesh with a "tp" axis (jax_kv.parallel.tp_mesh): tensor
            parallelism over KV heads, as in Engine (params sharded Megatron-style, the ops
            per shard, the KvCache's Hkv split; on VMM a seq-major cache on a MeshArena).

    Every step runs with the ops' status path on: its writes are bounded by the cache's
    committed capacity (a per-step device value, so a kept step stays kept), and a refused
    row raises StepStatusError naming it, one call late, before its tokens are used.
    """

    def __init__(
        self,
        model: Any,
        *,
        layout: Layout | str | int = Layout.SEQ_MAJOR,
        max_len: int | None = None,
        min_bucket: int | None = None,
        arena: Any = None,
        tokens_per_call: int = 1,
        fuse_projections: bool | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        mesh: Any = None,
    ) -> None:
        self.tokens_per_call = _check_int("tokens_per_call", tokens_per_call, 1)
        self.prefill_chunk_tokens = _check_int(
            "prefill_chunk_tokens", prefill_chunk_tokens, PREFILL_MIN_TOKENS
        )
        if max_len is not None:
            max_len = _check_int("max_len", max_len, 2)
        self.min_bucket = runtime_config().min_bucket if min_bucket is None else min_bucket
        self.min_bucket = _check_int("min_bucket", self.min_bucket, 1)
        if self.min_bucket & (self.min_bucket - 1):
            raise ValueError(f"min_bucket: expected a power of two >= 1, got {min_bucket!r}")
        if not isinstance(model, DecoderModel):
            raise ValueError(
                f"model: expected a jax_kv.decode.DecoderModel (a jax_kv.models.Model), got "
                f"{type(model).__name__}"
            )
        self.model = model
        self.mesh = mesh
        # The Generator's own pytree: the caller's arrays are shared, never deleted.
        self.params, self._attention = params_and_attention(model, mesh, fuse_projections)
        self.layout = Layout.parse(layout)
        self.max_len = max_len
        self.arena = arena
        self._steps: dict[StepKey, Any] = {}
        # Private, for bench/graph_replay.py only: False compiles steps without the committed
        # bound and the status (the path before issue 19), to compare their graph replay.
        self._bound_writes = True
        self._traces = 0

    # -- compiled steps -----------------------------------------------------------------------

    def _prefill_fn(self, key: StepKey) -> Callable[..., Any]:
        """One packed prefill call: the real tokens of several rows on one token axis of
        key.num_tokens (a bucket), each row's prompt piece appended at its length. Rows whose
        prompt ends in this call sample their first token; the others keep `next_tok`."""
        model, layout, sampling = self.model, key.layout, key.sampling

        def run(params, tokens, cu_seqlens, caches, lengths, committed, ends, next_tok, status,
                rng):  # fmt: skip
            committed = committed if self._bound_writes else None
            logits, caches, *latched = model.prefill_packed(
                params, tokens, cu_seqlens, caches, lengths, layout=layout, committed=committed,
                **self._attention["prefill"],
            )  # fmt: skip
            rng, sub = jax.random.split(rng)
            next_tok = jnp.where(ends, sample(logits, sub, sampling), next_tok)
            if latched:
                status = jnp.maximum(status, latched[0])
            lengths = lengths + (cu_seqlens[1:] - cu_seqlens[:-1])
            return _with_status(next_tok, status), next_tok, caches, lengths, status, rng

        return run

    def prefill_temp_bytes(self, batch: int, capacity: int, num_tokens: int) -> int:
        """XLA's temporary bytes of one prefill call (`compile().memory_analysis()`): the
        memory it needs beyond the weights and the cache, for `batch` rows of a cache of
        `capacity` tokens and `num_tokens` packed tokens (at most prefill_chunk_tokens).
        Lowered from shapes alone: no array is made and nothing runs, so a model whose params
        are jax.ShapeDtypeStructs answers too."""
        config, dtype = self.model.config, jnp.dtype(self.model.dtype)
        key = StepKey("prefill", self.layout, capacity, batch, dtype.name, num_tokens, GREEDY)

        def shaped(shape: tuple[int, ...], dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype)

        cache = shaped(
            self.layout.cache_shape(batch, capacity, config.num_kv_heads, config.head_dim), dtype
        )
        rows = shaped((batch,))
        args = (
            jax.tree_util.tree_map(lambda a: shaped(a.shape, a.dtype), self.params),
            shaped((num_tokens,)), shaped((batch + 1,)), [(cache, cache)] * config.num_layers,
            rows, rows, shaped((batch,), jnp.bool_), rows, rows,
            jax.eval_shape(lambda: jax.random.key(0)),
        )  # fmt: skip
        step = jax.jit(
            self._prefill_fn(key),
            donate_argnums=_DONATED["prefill"],
            compiler_options=step_compiler_options(),
        )
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    def _decode_fn(self, key: StepKey) -> Callable[..., Any]:
        model, layout, sampling = self.model, key.layout, key.sampling

        def one(params, tokens, caches, lengths, committed, last, rng):
            committed = committed if self._bound_writes else None
            logits, caches, *status = model.decode_step(
                params, tokens, caches, lengths, layout=layout, committed=committed,
                **self._attention["decode"],
            )  # fmt: skip
            rng, sub = jax.random.split(rng)
            tokens = sample(logits, sub, sampling)
            # A row at its last position (max_new_tokens or max_len reached) stays there: its
            # later writes repeat that slot, inside the cap, and the host drops its tokens.
            lengths = jnp.minimum(lengths + 1, last)
            emitted = _with_status(tokens, status[0]) if status else tokens
            return emitted, tokens, caches, lengths, rng

        def run(params, tokens, caches, lengths, committed, last, rng):
            if key.num_tokens == 1:
                emitted, tokens, caches, lengths, rng = one(
                    params, tokens, caches, lengths, committed, last, rng
                )
                return emitted[None], tokens, caches, lengths, rng

            def body(carry, _):
                emitted, *carry = one(params, *carry[:3], committed, last, carry[3])
                return tuple(carry), emitted

            (tokens, caches, lengths, rng), new = jax.lax.scan(
                body,
                (tokens, caches, lengths, rng),
                None,
                length=key.num_tokens,
            )
            return new, tokens, caches, lengths, rng

        return run

    def _call(self, key: StepKey, args: tuple, stats: GenerationStats) -> tuple[Any, bool]:
        """Runs the step for `key` -> (outputs, whether it was compiled for this call).

        One jax.jit object per key. A step a growth invalidated stays in the table: it no
        longer fits this run's cache, but a later generate whose cache starts at its capacity
        reuses it (XLA re-records its graph for the new arrays) instead of compiling it again.
        A new key is lowered and compiled ahead of the call (timed apart, so tok/s figures
        are steady state); the trace counter proves the call itself did not compile again.
        """
        step = self._steps.get(key)
        compiled = step is None
        if compiled:
            fn = self._prefill_fn(key) if key.kind == "prefill" else self._decode_fn(key)

            def counted(*a, fn=fn):  # runs only while tracing: counts compiles, not calls
                self._traces += 1
                return fn(*a)

            # Everything but the params is donated, and every donated input comes back as an
            # output of its shape: XLA reuses the buffers, so the addresses the recorded CUDA
            # graph holds stay the same from call to call and it is replayed, not re-recorded
            # (a fresh `lengths` buffer per step re-ran every attention handler's host code).
            # `committed` is not donated: it is the cache's, at a fixed address (KvCache).
            step = jax.jit(
                counted, donate_argnums=_DONATED[key.kind], compiler_options=step_compiler_options()
            )
            t0 = time.perf_counter()
            step.lower(*args).compile()
            stats.compile_seconds += time.perf_counter() - t0
            self._steps[key] = step
            if key.kind == "prefill":
                stats.prefill_captures += 1
            else:
                stats.captures += 1
        elif key.kind == "decode":
            stats.replays += 1
        traces = self._traces
        out = step(*args)
        if self._traces != traces:
            raise RuntimeError(f"{key}: the step traced again after it was compiled")
        return out, compiled

    # -- generation ---------------------------------------------------------------------------

    def _encode(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.model.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if not ids or any(len(p) == 0 for p in ids):
            raise ValueError("prompts: expected one or more non-empty prompts (texts or ids)")
        vocab = self.model.config.vocab_size
        for b, p in enumerate(ids):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{b}]: token id {bad[0]} outside [0, vocab={vocab})")
        return ids

    def make_cache(self, batch: int, initial_tokens: int | np.ndarray) -> KvCache:
        config = self.model.config
        return KvCache(
            num_layers=config.num_layers,
            batch=batch,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.model.dtype,
            layout=self.layout,
            arena=self.arena,
            max_len=self.max_len,
            model_max_len=config.max_position_embeddings,
            min_bucket=self.min_bucket,
            initial_tokens=initial_tokens,
            mesh=self.mesh,
        )

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        stop_tokens: Iterable[int] | None = None,
        on_tokens: Callable[[list[int | None]], None] | None = None,
    ) -> GenerationResult:
        """New tokens for a batch of prompts of different lengths.

        Args:
            prompts: texts (needs a tokenizer) or token-id lists; one string is a batch of 1.
            max_new_tokens: tokens to generate per prompt, at most (an int >= 1).
            sampling: greedy when omitted.
            stop_tokens: token ids; a row stops after emitting one (default: the model's EOS).
            on_tokens: called after each new token with one id per row (None for finished
                rows): streaming.

        A row stops at a stop token, at max_new_tokens, or where prompt + new tokens reach
        max_len (the Generator's, else the model's max_position_embeddings): its finish
        reason says which, and what it generated is returned. A prompt that leaves no room for
        one new token is refused before any compute.
        """
        max_new = _check_int("max_new_tokens", max_new_tokens, 1)
        if sampling is None:
            sampling = GREEDY
        elif not isinstance(sampling, Sampling):
            raise ValueError(f"sampling: expected a jax_kv.Sampling or None, got {sampling!r}")
        ids = self._encode(prompts)
        stop = self._stop_set(stop_tokens)
        B = len(ids)
        lens = np.array([len(p) for p in ids], np.int32)
        cap = self._length_cap()
        if cap is not None:
            for b, n in enumerate(lens.tolist()):
                if n >= cap:
                    raise ValueError(
                        f"prompts[{b}]: {n} tokens leave no room for a new token under "
                        f"max_len={cap} (prompt + new tokens <= max_len)"
                    )
        budget = (
            np.full((B,), max_new, np.int64) if cap is None else np.minimum(max_new, cap - lens)
        )
        stats = GenerationStats(layout=self.layout.name)
        # Each row's prompt: seq-major on VMM commits a row its own tokens, not the longest's.
        cache = self.make_cache(B, lens)
        try:
            result = self._run(cache, ids, lens, budget, max_new, sampling, stop, on_tokens, stats)
        except BaseException as error:
            # The steps' references to the cache's arrays live in the traceback's frames: they
            # go first (the caller keeps the error, not the arrays), so the cache can close.
            traceback.clear_frames(error.__traceback__)
            # The cause reaches the caller; a failure to release the cache rides along with it
            # instead of replacing it (an arena error used to hide an out-of-memory prefill).
            try:
                cache.close()
            except Exception as close_error:  # noqa: BLE001 - reported on the cause
                error.add_note(f"and closing the KvCache failed: {close_error}")
            raise
        cs = cache.stats()
        for name in _CACHE_STATS:  # the cache's counters of this run, under the same names
            setattr(stats, name, cs[name])
        cache.close()
        return result

    def _length_cap(self) -> int | None:
        """The most tokens (prompt + new) a sequence may hold: max_len, else the model's."""
        if self.max_len is not None:
            return self.max_len
        return self.model.config.max_position_embeddings

    def _stop_set(self, stop_tokens: Iterable[int] | None) -> set[int]:
        return stop_token_set(self.model.config, stop_tokens, "stop_tokens")

    def _prefill(self, cache, ids, lens, sampling, rng, stats):
        """The prompts, in packed calls of at most prefill_chunk_tokens real tokens (rows in
        order, a long prompt split over calls with its past) -> (first tokens [B] on the host,
        next_tok, lengths, rng on the device)."""
        B, chunk = len(ids), self.prefill_chunk_tokens
        dtype = jnp.dtype(self.model.dtype).name
        lengths = jnp.asarray(cache.lengths)
        next_tok = jnp.zeros((B,), jnp.int32)
        status = jnp.zeros((B,), jnp.int32)
        done = np.zeros((B,), np.int64)  # prompt tokens prefilled per row
        t0, compile0 = time.perf_counter(), stats.compile_seconds
        while (done < lens).any():
            counts = np.zeros((B,), np.int64)
            room = chunk
            for b in np.flatnonzero(done < lens):
                counts[b] = min(int(lens[b] - done[b]), room)
                room -= counts[b]
                if room == 0:
                    break
            real = int(counts.sum())
            N = min(bucket_for(real, PREFILL_MIN_TOKENS), chunk)
            tokens = np.zeros((N,), np.int32)
            tokens[:real] = np.concatenate(
                [ids[b][done[b] : done[b] + counts[b]] for b in range(B) if counts[b]]
            )
            cu_seqlens = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            ends = (counts > 0) & (done + counts == lens)
            caches = list(zip(cache.k, cache.v, strict=True))
            args = (
                self.params,
                jnp.asarray(tokens),
                jnp.asarray(cu_seqlens),
                caches,
                lengths,
                cache.committed,
                jnp.asarray(ends),
                next_tok,
                status,
                rng,
            )
            key = StepKey("prefill", self.layout, cache.array_capacity, B, dtype, N, sampling)
            outputs, compiled = self._call(key, args, stats)
            emitted, next_tok, caches, lengths, status, rng = outputs
            # Verified on a step's first call only: the cache cannot grow between chunks, so a
            # compiled step cannot move its outputs (and no pointer read waits on the device).
            self._accept(cache, caches, counts, verify=compiled)
            done += counts
            stats.prefill_calls += 1
            stats.prefill_tokens_computed += N
        first = np.asarray(emitted)
        stats.prefill_seconds = time.perf_counter() - t0 - (stats.compile_seconds - compile0)
        stats.prefill_tokens = int(lens.sum())
        _check_status(first, "prefill")
        return first, next_tok, lengths, rng

    def _run(self, cache, ids, lens, budget, max_new, sampling, stop, on_tokens, stats):
        B = len(ids)
        params = self.params
        dtype = jnp.dtype(self.model.dtype).name
        # The last position each row writes: prompt + budget - 1 < max_len (see _decode_fn).
        last_np = (lens + budget - 1).astype(np.int32)
        last = jnp.asarray(last_np)
        rng = jax.random.key(sampling.seed)
        sampling = dataclasses.replace(sampling, seed=0)  # for the step keys
        first, next_tok, lengths, rng = self._prefill(cache, ids, lens, sampling, rng, stats)

        out: list[list[int]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        self._record(first[None], out, reasons, stop, on_tokens, budget, max_new)
        generated = 1
        most = int(budget.max())
        overheads = []
        host_calls = [] if _host_calls() is not None else None
        # One call in flight: call i+1 is dispatched before call i's tokens are read, so the
        # host's work overlaps the device's. Sampled tokens feed the next call on the device;
        # only streaming, stop and status checks read them, one call late (a row that stopped
        # costs at most one extra call, whose tokens are dropped).
        pending, pending_taken = None, False

        def drain() -> float:
            # The drained array stays referenced until a call without growth would release
            # it: every call then sees the same buffer lifetimes, so XLA's allocator places the
            # step's temporaries where the recorded CUDA graph has them (freeing it early here
            # moved them once in a while, and the graph was re-recorded after a growth).
            nonlocal pending_taken
            t0 = time.perf_counter()
            if pending is not None and not pending_taken:
                self._take(pending, out, reasons, stop, on_tokens, budget, max_new)
                pending_taken = True
            return time.perf_counter() - t0

        t_decode, compile0 = time.perf_counter(), stats.compile_seconds
        n = self.tokens_per_call
        while generated < most and None in reasons:
            remaining = most - generated
            t_iter = time.perf_counter()
            waited = 0.0
            # Positions this call writes: lengths .. lengths + n - 1, each row capped at last.
            need = np.minimum(cache.lengths.astype(np.int64) + n, last_np + 1)
            grew = cache.would_grow(need)
            if grew:
                waited += drain()  # growth (commit, re-stride) with no step in flight
                if None not in reasons:
                    break
                before = (cache.array_capacity, cache.pointers())
                if cache.commits_per_row:
                    need = growth_ask(need, cache.committed_tokens(), cache.commit_step, last_np)
                event = cache.ensure_capacity(need)
                self._decide(event, before, cache, generated, stats)
            caches = list(zip(cache.k, cache.v, strict=True))
            args = (params, next_tok, caches, lengths, cache.committed, last, rng)
            key = StepKey("decode", self.layout, cache.array_capacity, B, dtype, n, sampling)
            calls0 = _host_calls()
            t_call = time.perf_counter()
            outputs, compiled = self._call(key, args, stats)
            new, next_tok, caches, lengths, rng = outputs
            t_called = time.perf_counter()
            if host_calls is not None:
                host_calls.append(_host_calls() - calls0)
            advance = np.minimum(cache.lengths.astype(np.int64) + n, last_np) - cache.lengths
            self._accept(cache, caches, advance, verify=compiled or grew)
            generated += n
            stats.decode_calls += 1
            stats.decode_tokens += min(n, remaining) * B
            previous, pending = pending, new
            previous_taken, pending_taken = pending_taken, False
            if previous is not None and not previous_taken:
                t0 = time.perf_counter()
                self._take(previous, out, reasons, stop, on_tokens, budget, max_new)
                waited += time.perf_counter() - t0
            if not compiled:
                total = time.perf_counter() - t_iter - waited
                overheads.append((total, t_called - t_call, total / n))
        drain()
        stats.decode_seconds = time.perf_counter() - t_decode - (stats.compile_seconds - compile0)
        if overheads:
            total, dispatch, per_step = np.median(np.asarray(overheads), axis=0) * 1e6
            stats.host_overhead_us, stats.dispatch_us = float(total), float(dispatch)
            stats.host_overhead_us_per_step = float(per_step)
        stats.host_calls_per_step = host_calls
        texts = None
        if getattr(self.model, "tokenizer", None) is not None:
            texts = [self.model.decode(t) for t in out]
        finish = [
            r if r is not None else _limit_reason(budget[b], max_new) for b, r in enumerate(reasons)
        ]
        return GenerationResult(out, texts, stats, finish)

    @staticmethod
    def _accept(cache: KvCache, caches, n, verify: bool) -> None:
        # Outputs are verified (shape, dtype, VMM aliasing) on a step's first call and after
        # a growth; in between the compiled step cannot change them.
        cache.accept([k for k, _ in caches], [v for _, v in caches], verify=verify)
        cache.advance(n)

    @classmethod
    def _take(cls, pending, out, reasons, stop, on_tokens, budget, max_new) -> None:
        """A finished call's tokens, read one call late: a refused row (a negative id, see
        _with_status) raises before any of the call's tokens is used."""
        new = np.asarray(pending)
        _check_status(new, "decode")
        cls._record(new, out, reasons, stop, on_tokens, budget, max_new)

    @staticmethod
    def _record(new: np.ndarray, out, reasons, stop, on_tokens, budget, max_new: int) -> None:
        for row in new:  # [B] per generated position
            if None not in reasons:
                return  # the overshoot of a last multi-token call
            emitted: list[int | None] = []
            for b, t in enumerate(row.tolist()):
                if reasons[b] is not None:
                    emitted.append(None)
                    continue
                out[b].append(t)
                if t in stop:
                    reasons[b] = FINISH_STOP
                elif len(out[b]) >= budget[b]:
                    reasons[b] = _limit_reason(budget[b], max_new)
                emitted.append(t)
            if on_tokens is not None:
                on_tokens(emitted)

    def _decide(
        self, event, before, cache: KvCache, generated: int, stats: GenerationStats
    ) -> None:
        """Keep the compiled step only if the event says so and nothing it bakes changed:
        the arrays' shape and pointers (checked again here, defence in depth)."""
        old_capacity, old_pointers = before
        unchanged = cache.array_capacity == old_capacity and cache.pointers() == old_pointers
        kept = bool(event.keeps_compiled_step and unchanged and event.bytes_moved == 0)
        reason = event.reason
        if event.keeps_compiled_step and not kept:
            reason = f"{event.reason}, but the arrays moved: invalidated"
        if not kept:
            stats.invalidations += 1  # the next call's key names the new capacity (see _call)
        stats.decisions.append(
            Decision(
                generated,
                kept,
                reason,
                event.old_capacity,
                event.new_capacity,
                event.bytes_moved,
                event.granules_committed,
            )
        )
