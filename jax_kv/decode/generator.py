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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import _ffi
from jax_kv.cache import KvCache
from jax_kv.decode.sampling import GREEDY, Sampling, sample
from jax_kv.layout import Layout
from jax_kv.models import llama

PREFILL_MIN_TOKENS = 16  # prompt lengths are padded to powers of two from here: few compiles


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
    prefill_tokens: int = 0
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
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new token ids per prompt (a stop token, if hit, is kept)
    texts: list[str] | None  # decoded new tokens, where the model has a tokenizer
    stats: GenerationStats


def _host_calls() -> int | None:
    cuda = _ffi.cuda_module()
    if cuda is None or not hasattr(cuda, "host_calls"):
        return None
    return int(sum(cuda.host_calls().values()))


def _bucket(n: int, floor: int) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


class Generator:
    """Generates with one jitted, donated decode step per call on a growing KvCache.

    Args:
        model: a jax_kv.models.Model (config, params, tokenizer).
        layout: the cache Layout (seq-major keeps its compiled step across VMM growth).
        max_len: hard cap on tokens per sequence (default: the model's
            max_position_embeddings).
        min_bucket: capacity floor and bucket base of the cache.
        arena: a VmmArena or EagerArena (default: VMM on CUDA, eager elsewhere).
        tokens_per_call: decode steps per jitted call when no growth can happen inside it.
        unroll_tokens: trace those steps straight-line instead of as a loop (lax.scan with
            unroll): XLA then launches one graph per call instead of one per step, at a compile
            time that grows with tokens_per_call. Slower on the H200 (bench/NOTES.md: the
            launch cost of a graph grows with its nodes); kept for the comparison.
        fuse_projections: rewrite the model's params in place to one q/k/v and one gate/up
            matmul per layer (Model.fuse_projections: same outputs, fewer and larger kernels).
    """

    def __init__(
        self,
        model: Any,
        *,
        layout: Layout | str | int = Layout.SEQ_MAJOR,
        max_len: int | None = None,
        min_bucket: int = 256,
        arena: Any = None,
        tokens_per_call: int = 1,
        unroll_tokens: bool = False,
        fuse_projections: bool = True,
    ) -> None:
        if int(tokens_per_call) < 1:
            raise ValueError(f"tokens_per_call: expected >= 1, got {tokens_per_call}")
        if fuse_projections and hasattr(model, "fuse_projections"):
            model.fuse_projections()
        self.model = model
        self.layout = Layout.parse(layout)
        self.max_len = max_len
        self.min_bucket = int(min_bucket)
        self.arena = arena
        self.tokens_per_call = int(tokens_per_call)
        self.unroll_tokens = bool(unroll_tokens)
        self._steps: dict[StepKey, Any] = {}
        self._traces = 0

    # -- compiled steps -----------------------------------------------------------------------

    def _prefill_fn(self, key: StepKey) -> Callable[..., Any]:
        config, layout, sampling = self.model.config, key.layout, key.sampling

        def run(params, tokens, new_lengths, caches, lengths, rng):
            logits, caches = llama.prefill(
                params,
                config,
                tokens,
                new_lengths,
                caches,
                lengths,
                layout=layout,
                last_only=True,
            )
            rng, sub = jax.random.split(rng)
            return sample(logits, sub, sampling), caches, lengths + new_lengths, rng

        return run

    def _decode_fn(self, key: StepKey) -> Callable[..., Any]:
        config, layout, sampling = self.model.config, key.layout, key.sampling

        def one(params, tokens, caches, lengths, rng):
            logits, caches = llama.decode_step(
                params, config, tokens, caches, lengths, layout=layout
            )
            rng, sub = jax.random.split(rng)
            return sample(logits, sub, sampling), caches, lengths + 1, rng

        def run(params, tokens, caches, lengths, rng):
            if key.num_tokens == 1:
                tokens, caches, lengths, rng = one(params, tokens, caches, lengths, rng)
                return tokens[None], tokens, caches, lengths, rng

            def body(carry, _):
                tokens, caches, lengths, rng = one(params, *carry)
                return (tokens, caches, lengths, rng), tokens

            (tokens, caches, lengths, rng), new = jax.lax.scan(
                body,
                (tokens, caches, lengths, rng),
                None,
                length=key.num_tokens,
                unroll=self.unroll_tokens,
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
            donate = (3, 4, 5) if key.kind == "prefill" else (1, 2, 3, 4)
            step = jax.jit(counted, donate_argnums=donate)
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

    def make_cache(self, batch: int, initial_tokens: int) -> KvCache:
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
        )

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        stop_tokens: Sequence[int] | None = None,
        on_tokens: Callable[[list[int | None]], None] | None = None,
    ) -> GenerationResult:
        """New tokens for a batch of prompts of different lengths.

        Args:
            prompts: texts (needs a tokenizer) or token-id lists; one string is a batch of 1.
            max_new_tokens: tokens to generate per prompt, at most.
            sampling: greedy when omitted.
            stop_tokens: a row stops after emitting one of these (default: the model's EOS).
            on_tokens: called after each new token with one id per row (None for finished
                rows): streaming.
        """
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        sampling = GREEDY if sampling is None else sampling
        ids = self._encode(prompts)
        stop = set(self.model.config.eos_token_ids if stop_tokens is None else stop_tokens)
        B = len(ids)
        lens = np.array([len(p) for p in ids], np.int32)
        T = _bucket(int(lens.max()), PREFILL_MIN_TOKENS)
        stats = GenerationStats(layout=self.layout.name)
        cache = self.make_cache(B, int(lens.max()))
        try:
            result = self._run(
                cache, ids, lens, T, int(max_new_tokens), sampling, stop, on_tokens, stats
            )
        finally:
            cs = cache.stats()
            stats.growth_events, stats.growth_keeps = cs["growth_events"], cs["growth_keeps"]
            stats.kv_bytes_moved = cs["kv_bytes_moved"]
            stats.committed_bytes, stats.reserved_bytes = (
                cs["committed_bytes"],
                cs["reserved_bytes"],
            )
            stats.arena, stats.capacity = cs["arena"], cs["capacity"]
            cache.close()
        return result

    def _run(self, cache, ids, lens, T, max_new, sampling, stop, on_tokens, stats):
        B = len(ids)
        params = self.model.params
        dtype = jnp.dtype(self.model.dtype).name
        tokens = np.zeros((B, T), np.int32)
        for b, p in enumerate(ids):
            tokens[b, : len(p)] = p
        rng = jax.random.key(sampling.seed)
        sampling = dataclasses.replace(sampling, seed=0)  # for the step keys
        caches = list(zip(cache.k, cache.v, strict=True))
        lengths = jnp.asarray(cache.lengths)
        args = (params, jnp.asarray(tokens), jnp.asarray(lens), caches, lengths, rng)
        key = StepKey("prefill", self.layout, cache.array_capacity, B, dtype, T, sampling)
        t0, compile0 = time.perf_counter(), stats.compile_seconds
        (next_tok, caches, lengths, rng), _ = self._call(key, args, stats)
        first = np.asarray(next_tok)
        stats.prefill_seconds = time.perf_counter() - t0 - (stats.compile_seconds - compile0)
        stats.prefill_tokens = int(lens.sum())
        self._accept(cache, caches, lens, verify=True)

        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        self._record(first[None], out, done, stop, on_tokens, max_new)
        generated = 1
        overheads = []
        host_calls = [] if _host_calls() is not None else None
        # One call in flight: call i+1 is dispatched before call i's tokens are read, so the
        # host's work overlaps the device's. Sampled tokens feed the next call on the device;
        # only streaming and stop checks read them, one call late (a row that stopped costs
        # at most one extra call, whose tokens are dropped).
        pending = None

        def drain() -> float:
            nonlocal pending
            t0 = time.perf_counter()
            if pending is not None:
                self._record(np.asarray(pending), out, done, stop, on_tokens, max_new)
                pending = None
            return time.perf_counter() - t0

        t_decode, compile0 = time.perf_counter(), stats.compile_seconds
        while generated < max_new and not all(done):
            remaining = max_new - generated
            n = self.tokens_per_call
            # A last call longer than needed reuses the compiled step (its extra tokens are
            # dropped) instead of compiling a one-token step for the tail; only a cache whose
            # hard max cannot take the overshoot falls back to one token per call.
            if n > remaining and cache.max_len is not None:
                if int(cache.lengths.max()) + n > cache.max_len:
                    n = 1
            t_iter = time.perf_counter()
            waited = 0.0
            need = int(cache.lengths.max()) + n
            grew = need > cache.capacity
            if grew:
                waited += drain()  # growth (commit, re-stride) with no step in flight
                if all(done):
                    break
                before = (cache.array_capacity, cache.pointers())
                event = cache.ensure_capacity(need)
                self._decide(event, before, cache, generated, stats)
            caches = list(zip(cache.k, cache.v, strict=True))
            args = (params, next_tok, caches, lengths, rng)
            key = StepKey("decode", self.layout, cache.array_capacity, B, dtype, n, sampling)
            calls0 = _host_calls()
            t_call = time.perf_counter()
            (new, next_tok, caches, lengths, rng), compiled = self._call(key, args, stats)
            t_called = time.perf_counter()
            if host_calls is not None:
                host_calls.append(_host_calls() - calls0)
            self._accept(cache, caches, n, verify=compiled or grew)
            generated += n
            stats.decode_calls += 1
            stats.decode_tokens += min(n, remaining) * B
            previous, pending = pending, new
            if previous is not None:
                t0 = time.perf_counter()
                self._record(np.asarray(previous), out, done, stop, on_tokens, max_new)
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
        return GenerationResult(out, texts, stats)

    @staticmethod
    def _accept(cache: KvCache, caches, n, verify: bool) -> None:
        # Outputs are verified (shape, dtype, VMM aliasing) on a step's first call and after
        # a growth; in between the compiled step cannot change them.
        cache.accept([k for k, _ in caches], [v for _, v in caches], verify=verify)
        cache.advance(n)

    @staticmethod
    def _record(new: np.ndarray, out, done, stop, on_tokens, max_new: int) -> None:
        for row in new:  # [B] per generated position
            if all(len(o) >= max_new for o in out):
                return  # the overshoot of a last multi-token call
            emitted: list[int | None] = []
            for b, t in enumerate(row.tolist()):
                if done[b] or len(out[b]) >= max_new:
                    emitted.append(None)
                    continue
                out[b].append(t)
                done[b] = t in stop
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
                generated, kept, reason, event.old_capacity, event.new_capacity, event.bytes_moved
            )
        )
