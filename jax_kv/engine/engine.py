"""Engine: continuous batching on a SlotCache. Requests come and go, memory follows them, the
compiled decode step never changes.

One engine step (`step()`), in Python between jitted calls:
1. cancelled requests end and return their slots;
2. the prefill pieces are planned and their memory committed: at most `prefill_chunk_tokens`
   real tokens, the next piece of every prefilling slot in admission order, then, while room
   is left, queued requests admitted FIFO into free slots when the memory of their first piece
   can be committed (admission never preempts a running request). Most of that memory was
   committed beside the previous call (step 4), so the planning finds it there;
3. each decoding slot's memory for the token it writes is committed; where it cannot be, the
   youngest slot holder is preempted (its granules released, its tokens kept, re-prefilled
   later);
4. one compiled call. With prefill pieces, the prefill step: the pieces packed on one token
   axis (padded to a power-of-two bucket: one compile per bucket) and the decoding slots'
   next tokens in the same pass over the weights (the decode kernel attends for those rows);
   a slot whose prompt ends samples its first token. Without, the decode step on the
   smallest decode bucket that holds the decoding rows (Engine.decode_buckets: `max_slots`,
   with decode_row_buckets also up to three halvings; one compile each, all in warm_up): the
   projections, the MLP, the logits and the token picker run on the bucket's rows, the
   attention op on every cache row. Either way a row that takes no part has a write bound of
   0, which the attention ops read as idle (no reads, no writes). While the call runs, the
   host prepares the next one in slots the call leaves idle: the decoding rows' next
   granules, the prefilling slots' next pieces, queued requests admitted into free slots or
   handed the slots of requests that ended in the last call (a head that would map blocks the
   call is writing waits for them), then the rest of those slots released;
5. tokens reach the requests (streamed), finished requests' slots wait for the next call.

Where the next call is decode only and its rows are known before the call in flight's tokens
are (no piece to prefill, no admission, no cancel), it is dispatched before the host reads them
(decode_ahead, the default): its lengths are one more than each row's, its tokens are the ones
the last call's picker wrote on the device, its bucket the smallest that holds its rows (some
of the last call's, so never a larger bucket). The device then goes from call to call without
waiting for the host; a row whose request stops on the last call's token is computed once for
nothing and its slot released after that call.

The per-call inputs sit at fixed device addresses and are written in stream order (StepInputs),
so XLA can replay each compiled step's recorded CUDA graph. A long prompt delays the running
requests' next token by one chunk's compute at most, and never stops them.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_kv.cache import SlotCache, bucket_for
from jax_kv.cache.kv_cache import default_arena
from jax_kv.config import step_compiler_options
from jax_kv.decode.generator import STATUS_CAUSES, StepStatusError, _check_int, stop_token_set
from jax_kv.decode.protocol import DecoderModel
from jax_kv.decode.sampling import GREEDY, GREEDY_BELOW, Sampling, argmax_rows, sample_rows
from jax_kv.engine.inputs import StepInputs
from jax_kv.engine.prefix import PrefixCache
from jax_kv.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Delta,
    Request,
    TextStream,
)
from jax_kv.layout import Layout
from jax_kv.memory import ArenaExhausted, MeshArena, VmmArena
from jax_kv.parallel import params_and_attention

PREFILL_MIN_TOKENS = 16  # the smallest prefill bucket
# Engine(decode_row_buckets=None) turns the decode row buckets on from this many slots. Chosen,
# not measured: an 8B decode GEMM of M rows is bound by the weights' read up to M ~ 295 on an
# H100 (its FLOP/byte ridge), so below ~128 rows fewer rows save little, and the buckets' gathers
# and scatters (4 small ops a layer) are pure cost. bench/engine_step.py --decode-row-buckets
# times both in one run.
DECODE_ROW_BUCKETS_MIN_SLOTS = 128
DECODE_ROW_HALVINGS = 3  # decode buckets: max_slots and up to this many halvings of it
DEFAULT_MAX_LEN = 4096  # when neither the caller nor the model bounds a sequence lower


class EngineError(RuntimeError):
    """The engine cannot take a request: it is shut down, or it failed."""


class QueueFull(EngineError):
    """submit() while `max_queue` requests wait."""


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started (deterministic, except the seconds)."""

    steps: int = 0
    decode_calls: int = 0  # calls of the decode step (no prefill piece in the step)
    prefill_calls: int = 0  # calls of the prefill step (which also advance the decoding rows)
    mixed_calls: int = 0  # prefill calls that advanced decoding rows too
    # Compiles of the decode step: one per decode bucket (Engine.decode_buckets) for the
    # engine's life (decode_steps > 1: two, its program with argmax and with the sampler);
    # warm_up compiles them all.
    decode_compiles: int = 0
    # Decode calls per decode bucket (the rows a call computed: the smallest bucket that holds
    # its decoding rows), bucket -> calls; its keys are the buckets used.
    decode_bucket_calls: dict[int, int] = dataclasses.field(default_factory=dict)
    # Compiles of the token pickers: two per decode bucket (argmax and the sampler of its
    # rows; a prefill call's are the max_slots bucket's) for the engine's life (decode_steps
    # > 1: the prefill call's two, the decode call's are in its program); warm_up compiles
    # them all.
    sampler_compiles: int = 0
    prefill_compiles: int = 0  # one per prefill bucket used
    prefill_buckets: list[int] = dataclasses.field(default_factory=list)
    prefill_tokens: int = 0  # real tokens prefilled (re-prefills included)
    prefill_tokens_computed: int = 0  # bucket positions computed
    decode_tokens: int = 0  # tokens generated for decoding rows (either step)
    submitted: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)  # per finish reason
    preemptions: int = 0
    peak_held_bytes: int = 0
    # The slots' tokens (cache.live_bytes): an ended request's slot kept for the queue's head
    # counts until it is handed over or released (Engine.live_bytes leaves it out).
    peak_live_bytes: int = 0
    host_seconds: float = 0.0  # step time outside the jitted calls' device work
    step_seconds: float = 0.0
    # Slots of requests that ended in a call, released while the next call ran (their rows
    # idle in it): the unmaps overlap the device instead of adding to the step.
    releases_beside_step: int = 0
    commits_ahead: int = 0  # next decode steps' granules committed while a call ran
    # The next call's prefill memory, committed while a call ran (Engine._plan_ahead):
    admitted_ahead: int = 0  # admissions
    pieces_ahead: int = 0  # running prefills' next pieces that needed granules
    # Slot commits that needed granules while no call was in flight: the device waited for
    # them (what _plan_ahead and the commits ahead move beside the calls).
    planning_commits: int = 0
    slots_handed_over: int = 0  # ended requests' slots given to the next with their granules
    # Ended requests' slots kept past a call for the queue's heads to be handed over (one count
    # per slot and call it waited through) instead of released and committed again.
    slots_kept_for_queue: int = 0
    # Partial blocks an ended request wrote in the granules its slot's next request takes,
    # evicted so the slot could be handed over in place (PrefixCache.evict_partials).
    hand_over_evictions: int = 0
    release_beside_step_seconds: float = 0.0  # inside the calls' time, not host_seconds
    commit_ahead_seconds: float = 0.0  # the commits ahead's time, inside the calls' time too
    beside_seconds: float = 0.0  # all the work done while calls ran (Engine._call)
    # Of it, the work before a decode call dispatched ahead (the commits its rows need, an
    # admission tried first, its inputs, its dispatch), over the calls dispatched ahead only:
    # the part that delays the next call (Engine._complete).
    before_next_seconds: float = 0.0
    # Calls whose tokens were ready before the work beside them ended: the device may have
    # waited for the host there (the work's excess over the call counts as the call's time).
    beside_overran: int = 0
    delivered_beside_call: int = 0  # tokens and endings handed to requests while a call ran
    # Decode calls dispatched while the call before them ran, before its tokens were read
    # (Engine._dispatch_next): the device went from one to the next without waiting for the
    # host. Their rows whose request ended on the call before (a stop token, an error) were
    # computed for nothing: wasted_rows counts them (their tokens are dropped).
    calls_ahead: int = 0
    wasted_rows: int = 0
    # A call's time (inside step_seconds, not host_seconds) in three: dispatching the step and
    # its picker (JAX's host work, until both are queued; for a call dispatched ahead, whose
    # dispatch ran beside the call before it, the time its step spent before the work beside
    # it), the work beside it (beside_seconds), and the wait for its tokens after that work
    # (the device's remainder, and the copy).
    dispatch_seconds: float = 0.0
    wait_seconds: float = 0.0
    # Handing tokens and endings to their requests (Engine._deliver: waiters, listeners, and
    # on_delivered), wherever it ran: beside a call (inside beside_seconds) or after it.
    deliver_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """What an observer (the server's /metrics) reads of an engine at one time: a copy, so
    that it can cross a process boundary (jax_kv.server.engine_process)."""

    stats: EngineStats
    running: int
    waiting: int  # queued, preempted ones included
    queued: int  # waiting and never admitted: what max_queue bounds
    # KV bytes: the cache's committed, held and live bytes and the prefix blocks no request
    # maps (None once the cache is closed).
    kv: dict[str, int] | None
    prefix: Any = None  # a copy of PrefixCache.stats, None without a prefix cache


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What submit() checks a request against, known once the engine is built: the same
    checks run where the engine is only reachable through a pipe (the server's process)."""

    max_len: int
    vocab_size: int
    max_request_tokens: int  # the most tokens one slot can ever hold in the engine's memory
    capacity_bytes: int  # that memory

    def check(
        self,
        model: Any,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        sampling: Sampling | None,
        stop: str | Sequence[str] | None,
        stop_token_ids: Iterable[int] | None,
    ) -> tuple[list[int], int, Sampling, list[str], frozenset[int]]:
        """-> (prompt ids, max_new_tokens, sampling, stop strings, stop ids), or ValueError
        naming the argument. `model` gives the tokenizer and the config (no weights used)."""
        ids = self._encode(model, prompt)
        max_new = _check_int("max_new_tokens", max_new_tokens, 1)
        if sampling is None:
            sampling = GREEDY
        elif not isinstance(sampling, Sampling):
            raise ValueError(f"sampling: expected a jax_kv.Sampling or None, got {sampling!r}")
        total = len(ids) + max_new
        if total > self.max_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens + max_new_tokens {max_new} = {total} exceeds "
                f"max_len={self.max_len}"
            )
        if total - 1 > self.max_request_tokens:  # the last token is returned, never cached
            raise ValueError(
                f"prompt: {len(ids)} tokens + max_new_tokens {max_new} need the KV memory of "
                f"{total - 1} tokens, more than the {self.capacity_bytes} bytes the engine can "
                f"ever give one request ({self.max_request_tokens} tokens)"
            )
        stops = _stop_strings(stop)
        if stops and getattr(model, "tokenizer", None) is None:
            raise ValueError("stop: stop strings need a tokenizer; this model has none")
        stop_ids = frozenset(stop_token_set(model.config, stop_token_ids, "stop_token_ids"))
        return ids, max_new, sampling, stops, stop_ids

    def _encode(self, model: Any, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(model.encode(prompt))
        elif isinstance(prompt, Sequence | np.ndarray):
            ids = []
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int | np.integer):
                    raise ValueError(f"prompt: expected token ids (ints), got {t!r}")
                ids.append(int(t))
        else:
            raise ValueError(f"prompt: expected a string or token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: expected at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside [0, vocab={self.vocab_size})")
        return ids


def _stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop: expected non-empty strings, got {s!r}")
    return stops


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What the last step did (Engine.last_step): the benchmark's per-step view."""

    prefill_tokens: int = 0  # real tokens of its prefill call (0: none)
    prefill_seconds: float = 0.0  # the prefill call, until its tokens were on the host
    decode_rows: int = 0  # requests its decode step advanced (0: none)
    decode_seconds: float = 0.0
    seconds: float = 0.0  # the whole step


@dataclasses.dataclass(eq=False)
class _Seq:
    """The engine's state of one request."""

    request: Request
    prompt: list[int]
    max_new: int
    sampling: Sampling
    stop_ids: frozenset[int]
    text: TextStream | None
    generated: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # tokens of prompt + generated in the slot's cache
    admitted: int = -1  # admission order: the largest is the youngest
    preemptions: int = 0
    blocks: list = dataclasses.field(default_factory=list)  # prefix blocks its slot holds

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def prefill_target(self) -> int:
        """Tokens the slot must hold before decoding: the prompt, or after a preemption all
        but the last generated token (the decode step's next input)."""
        return len(self.prompt) if not self.generated else self.context_len - 1

    def token_at(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.generated[i - n]

    def tokens(self, lo: int, hi: int) -> list[int]:
        """Tokens [lo, hi) of prompt + generated (slices: a prefill chunk is thousands)."""
        n = len(self.prompt)
        if hi <= n:
            return self.prompt[lo:hi]
        return self.prompt[lo:n] + self.generated[max(0, lo - n) : hi - n]


def _into(picked: jax.Array, tokens: jax.Array, rows: jax.Array | None) -> jax.Array:
    """picked, written over the donated `tokens` input [B] in place: at `rows` (int32 [n],
    padding B dropped) where given, else whole. Every picked token is >= 0, so the whole
    write is `picked`; the `where` keeps `tokens` an operand, which XLA would otherwise drop
    (and with it the aliasing that keeps the array's address)."""
    if rows is not None:
        return tokens.at[rows].set(picked, mode="drop")
    return jnp.where(picked >= 0, picked, tokens)


def _decode_step_takes_rows(model: Any) -> bool:
    """Whether model.decode_step accepts `rows=` (the decode row buckets): a DecoderModel of
    another library may not, and would fail at the first trace, not here."""
    try:
        params = inspect.signature(model.decode_step).parameters
    except (TypeError, ValueError):  # no signature to read (a C callable): assume it does not
        return False
    return "rows" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _gather(a: jax.Array, rows: jax.Array | None, fill: Any) -> jax.Array:
    """a [B]'s values at `rows` (int32 [n]; `fill` at a padding entry, B), or `a` itself."""
    return a if rows is None else jnp.take(a, rows, 0, mode="fill", fill_value=fill)


@dataclasses.dataclass(eq=False)
class _Pending:
    """A dispatched call whose tokens the host has not read yet."""

    rows: list[_Seq]  # its decoding rows
    counts: np.ndarray | None  # its prefill tokens per slot (None: a decode call)
    # int32 [2, B]: the picked tokens, the attention ops' status per row ([k + 1, B]: k steps'
    # tokens, then the status, for a call of decode_steps = k > 1)
    out: jax.Array
    t0: float  # when it was dispatched (time.perf_counter)
    bucket: int  # the rows its step computed (a decode bucket; max_slots for a prefill call)


def _host(x: jax.Array) -> np.ndarray:
    """A replicated step output on the host: this process's copy (under a multi-process mesh
    the array is not fully addressable)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _programs(fn: Any, traces: int) -> int:
    """How many programs jitted `fn` has compiled (jit's own cache: a new argument sharding
    or layout compiles again without a retrace), else `traces` (a stand-in for the step)."""
    size = getattr(fn, "_cache_size", None)
    return size() if size is not None else traces


def _sampled(logits: jax.Array, positions: jax.Array, temp: jax.Array, top_k: jax.Array,
             top_p: jax.Array, seeds: jax.Array, rows: jax.Array | None) -> jax.Array:  # fmt: skip
    """Each row's token sampled from logits [n, V] with its request's parameters [B] and a key
    from its seed and `positions` [B] (the position of the token it samples); with `rows` the
    logits are theirs and the parameters are gathered (a padding entry's: greedy)."""
    keys = _row_keys(_gather(seeds, rows, 0), _gather(positions, rows, 0))
    params = (_gather(temp, rows, 0), _gather(top_k, rows, 0), _gather(top_p, rows, 1))
    return sample_rows(logits, keys, *params)


def _row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One key per row from its request's seed and the position of the token it samples:
    a request's tokens do not depend on which slot or step it ran in."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


class Engine:
    """Continuous batching over one SlotCache of `max_slots` rows reserved at `max_len`.

    Args:
        model: a DecoderModel (jax_kv.models.Model).
        max_slots: requests decoded together (the decode step's fixed batch).
        max_len: the most tokens (prompt + generated) of one request; default the model's
            max_position_embeddings, at most 4096.
        prefill_chunk_tokens: the most prompt tokens one prefill call computes (>= 16).
        max_queue: requests that may wait; submit() beyond it raises QueueFull.
        arena: a VmmArena or EagerArena (default: VMM on CUDA, eager elsewhere).
        kv_budget_bytes: the most KV bytes the slots may hold (default: what the arena can
            commit; on the eager path every slot at max_len).
        granule_bytes: the eager path's accounting granule (SlotCache).
        fuse_projections: as in Generator (default: on, off with a mesh).
        mesh: a jax.sharding.Mesh with a "tp" axis (jax_kv.parallel.tp_mesh): tensor
            parallelism over KV heads. The params are sharded Megatron-style (a copy of
            model.params laid out over the mesh), the cache's KV heads are split over the
            devices, and the attention ops run per shard under shard_map; greedy tokens equal
            the unsharded engine's. The arena is then a MeshArena (VMM, one arena per device)
            or an EagerArena.
        prefix_cache: share the K/V of common prompt prefixes between requests (whole
            blocks of granules mapped into each slot, jax_kv.engine.prefix); needs a
            VmmArena; default: on where the arena is one.
        prefix_cache_bytes: the most KV bytes of blocks the prefix cache may hold: blocks no
            running request maps (finished requests' prompts and outputs), blocks running
            requests map from it (shared prefixes, held once) and the full blocks running
            requests wrote. Blocks of the first kind are evicted (PrefixCache's order: partial
            blocks first, then least recently used leaves) until all fit, or none of the first
            kind is left, whenever the store grows or blocks become evictable (a block
            written, a request's end or release). Committed KV is then at most the larger of
            this and the blocks running requests map or wrote, + their granules outside the
            store's blocks + the zero floor (so a cap of one copy of each shared prefix bounds
            it as issue 23 asks, while the running requests' own blocks fit in it). Default
            None: kept until admission needs the memory (as vLLM and SGLang keep them). 0
            keeps none: committed memory then follows the running requests alone, and
            requests share only blocks that are running.
        decode_ahead: dispatch the next decode call before reading this one's tokens, where
            the next call is decode only and its rows are known (Engine._dispatch_next): the
            device then runs call after call while the host reads, streams and plans one call
            behind. A row whose request ends on a stop token is computed once more for
            nothing. Default on; off, every call waits for the host between calls.
        decode_row_buckets: give the decode-only call a bucket of rows (decode_buckets():
            max_slots and up to three halvings, one compile each, all compiled by warm_up):
            a call with n decoding rows runs the projections, the MLP, the logits and the
            token picker on the smallest bucket >= n, not on every slot (the attention op
            still sees every cache row, the others idle). The prefill call keeps all
            max_slots rows. Needs a model whose decode_step takes `rows`
            (jax_kv.models.llama.decode_step). Default None: on where max_slots >= 128
            (DECODE_ROW_BUCKETS_MIN_SLOTS) and the model's decode_step takes `rows`; off,
            the decode step runs every slot's row. True with a model that does not: ValueError.
        decode_steps: tokens each decode-only call computes per row (>= 1): that many decode
            steps in one compiled call, each row's token picked on the device and fed to its
            next step, so the host's work per call (planning, the inputs' write, the
            dispatch, streaming) is paid once per `decode_steps` tokens: the lever where the
            host, not the device, sets the pace (small models). A row computes
            min(decode_steps, tokens it may still generate) steps (idle after them); one that
            ends on a stop token mid-call is computed to the call's end for nothing (its later
            tokens dropped) and a request's tokens arrive `decode_steps` at a time. Prefill
            calls (and the decoding rows they advance) stay one token. A decoding slot holds
            memory for its calls' tokens before they are known: up to 2 * (decode_steps - 1)
            tokens more than its live ones (the call running and the one after it, committed
            beside it; a request that stops early in the call keeps them until its slot is
            released). Default 1.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_slots: int = 8,
        max_len: int | None = None,
        prefill_chunk_tokens: int = 512,
        max_queue: int = 1024,
        arena: Any = None,
        kv_budget_bytes: int | None = None,
        granule_bytes: int | None = None,
        fuse_projections: bool | None = None,
        prefix_cache: bool | None = None,
        prefix_cache_bytes: int | None = None,
        mesh: Any = None,
        decode_ahead: bool = True,
        decode_row_buckets: bool | None = None,
        decode_steps: int = 1,
    ) -> None:
        if not isinstance(model, DecoderModel):
            raise ValueError(
                f"model: expected a jax_kv.decode.DecoderModel (a jax_kv.models.Model), got "
                f"{type(model).__name__}"
            )
        self.max_slots = _check_int("max_slots", max_slots, 1)
        self.prefill_chunk_tokens = _check_int(
            "prefill_chunk_tokens", prefill_chunk_tokens, PREFILL_MIN_TOKENS
        )
        self.max_queue = _check_int("max_queue", max_queue, 1)
        config = model.config
        model_max = config.max_position_embeddings
        if max_len is None:
            max_len = DEFAULT_MAX_LEN if model_max is None else min(model_max, DEFAULT_MAX_LEN)
        self.max_len = _check_int("max_len", max_len, 2)
        if model_max is not None and self.max_len > model_max:
            raise ValueError(
                f"max_len: expected <= the model's max_position_embeddings ({model_max}), got "
                f"{max_len}"
            )
        self.model = model
        self.mesh = mesh
        self.decode_ahead = bool(decode_ahead)
        self.decode_steps = _check_int("decode_steps", decode_steps, 1)
        takes_rows = _decode_step_takes_rows(model)
        if decode_row_buckets is None:
            decode_row_buckets = takes_rows and self.max_slots >= DECODE_ROW_BUCKETS_MIN_SLOTS
        elif decode_row_buckets and not takes_rows:
            raise ValueError(
                "decode_row_buckets: expected a model whose decode_step takes `rows` (as "
                f"jax_kv.models.llama.decode_step does); {type(model).__name__}.decode_step "
                "does not: pass decode_row_buckets=False or None"
            )
        self.decode_row_buckets = bool(decode_row_buckets)
        halvings = DECODE_ROW_HALVINGS if self.decode_row_buckets else 0
        self._decode_buckets = tuple(
            sorted({max(1, self.max_slots >> k) for k in range(halvings + 1)})
        )
        self.params, self._attention = params_and_attention(model, mesh, fuse_projections)
        # Resolved here once (the cache takes it as given): whether it is a VmmArena decides
        # the prefix cache's default.
        arena = default_arena(mesh) if arena is None else arena
        vmm = isinstance(arena, VmmArena | MeshArena)
        if prefix_cache is None:
            prefix_cache = vmm
        elif prefix_cache and not vmm:
            raise ValueError("prefix_cache: sharing granules between slots needs a VmmArena")
        if prefix_cache_bytes is not None:
            _check_int("prefix_cache_bytes", prefix_cache_bytes, 0)
        self.prefix_cache_bytes = prefix_cache_bytes
        self.cache = SlotCache(
            num_layers=config.num_layers,
            num_slots=self.max_slots,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=model.dtype,
            max_len=self.max_len,
            arena=arena,
            granule_bytes=granule_bytes,
            budget_bytes=kv_budget_bytes,
            prefix_store=bool(prefix_cache),
            mesh=mesh,
        )
        self.prefix = PrefixCache(self.cache) if prefix_cache else None
        self.stats = EngineStats()
        self.last_step = StepRecord()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[_Seq] = collections.deque()  # guarded by _lock
        self._accepting = True  # guarded by _lock
        self._cancels = self._cancels_seen = 0  # Request.cancel() calls; guarded by _lock
        self._failure: BaseException | None = None
        self._slots: list[_Seq | None] = [None] * self.max_slots  # the step's thread only
        # Slots whose request ended in the last call, released beside the next one (_retire):
        # neither running nor free until then. The step's thread only.
        self._retiring: dict[int, _Seq] = {}
        # While a call runs: its prefill tokens per slot (None: a decode call) and its
        # decoding rows (Engine._complete). The step's thread only.
        self._in_flight: tuple[np.ndarray | None, list[_Seq]] | None = None
        # A decode call dispatched before the last call's tokens were read, completed by the
        # next step (Engine._dispatch_next). The step's thread only.
        self._next: _Pending | None = None
        self._step_t0 = 0.0
        # Slot -> (its request, the tokens committed for it): the next call's prefill memory,
        # committed beside the last call (_plan_ahead); check_memory allows for it.
        self._ahead: dict[int, tuple[_Seq, int]] = {}
        # Tokens and endings not yet handed to their requests (_deliver), in order.
        self._outbox: list[tuple[Request, Delta | Completion]] = []
        # Called on the step's thread after each delivery that handed anything over: one
        # batch of tokens, where a per-token listener would send per token (engine_process).
        self.on_delivered: Any = None
        self._admissions = 0
        self._traces = {"prefill": 0, "decode": 0}
        # (compiled function, rows) of every call dispatched: "decode", "argmax" or "sampler"
        # and its bucket (a prefill call's pickers: max_slots). What warm_up has compiled.
        self._ran: set[tuple[str, int]] = set()
        # The caches are donated: XLA writes the arena's memory in place (SlotCache.writes_back:
        # the host driver's stand-in, which copies instead).
        donate = not self.cache.writes_back
        options = step_compiler_options()
        self._prefill = jax.jit(
            self._prefill_fn(), donate_argnums=(3,) if donate else (), compiler_options=options
        )
        # The decode step also takes the `status` input donated and returns the step's status
        # in it: a new status buffer per call would move the first layer's status operand
        # (XLA places it in the step's output) whenever the last call's output is still alive,
        # as it is with a call dispatched ahead, and XLA would run that layer's handler host
        # code to update the recorded graph (measured on the H100, 23423a2).
        # keep_unused: jit drops an argument the program does not read, and a dropped
        # donation aliases nothing.
        self._decode = jax.jit(
            self._decode_fn(), donate_argnums=(2, 5) if donate else (5,), keep_unused=True,
            compiler_options=options,
        )  # fmt: skip
        # A call's tokens are picked from its logits by a second, small compiled function,
        # chosen on the host: argmax when every row of the call is greedy, the sampler
        # otherwise. Why not a lax.cond inside the step: outside a CUDA graph XLA runs a
        # conditional by copying its predicate to the host and blocking the dispatching thread
        # until the device reaches it, i.e. until the whole forward pass has run, so the work
        # meant to run beside the call (Engine._complete) would wait for it. Each picker
        # also writes its tokens into the `tokens` input in place (donated): the next decode
        # call can take them there before the host has read them. It returns them with the
        # step's status in one array (one copy to the host), so that the step's own outputs
        # are all dropped once the picker is queued: one still alive when the next call is
        # dispatched ahead would make that call's output land elsewhere, and XLA re-record
        # the commands that write it.
        self._greedy = jax.jit(self._greedy_fn(), donate_argnums=(2,), compiler_options=options)
        self._sampler = jax.jit(self._sampler_fn(), donate_argnums=(7,), compiler_options=options)
        # decode_steps > 1: the decode-only call is one program of decode_steps steps with its
        # picker inside (argmax or the sampler, chosen on the host as above); it writes its
        # last tokens into the donated `tokens` input.
        self._decode_steps = {
            sample: jax.jit(
                self._decode_steps_fn(sample),
                donate_argnums=(1, 2) if donate else (1,),
                compiler_options=options,
            )
            for sample in ((False, True) if self.decode_steps > 1 else ())
        }
        # Per-slot sampling parameters, rewritten at admission.
        B = self.max_slots
        self._temperature = np.zeros((B,), np.float32)
        self._top_k = np.zeros((B,), np.int32)
        self._top_p = np.ones((B,), np.float32)
        self._seeds = np.zeros((B,), np.uint32)
        self._sampling_dirty = True
        try:
            # On the cache's device (an EagerArena may be on any): committed there, as the
            # steps' outputs are.
            device = None if mesh is not None else next(iter(self.cache.k[0].devices()))
            self._inputs = StepInputs(self._input_fields(), mesh, device)
        except BaseException:
            self.cache.close()
            raise
        self._thread: threading.Thread | None = None
        self._stop_thread = False
        # The memory any one request may hold: the budget (or the arena) with no other slot.
        capacity = self.cache.available_bytes()
        self.limits = RequestLimits(
            max_len=self.max_len,
            vocab_size=config.vocab_size,
            max_request_tokens=self.cache.tokens_within(capacity),
            capacity_bytes=capacity,
        )

    # -- compiled steps -------------------------------------------------------------------

    def prefill_buckets(self) -> list[int]:
        """The token counts a prefill call is padded to: powers of two from 16, the last one
        the chunk (one compile each)."""
        buckets, n = [], PREFILL_MIN_TOKENS
        while True:
            buckets.append(min(n, self.prefill_chunk_tokens))
            if n >= self.prefill_chunk_tokens:
                return buckets
            n *= 2

    def decode_buckets(self) -> list[int]:
        """The row counts a decode-only call computes, ascending: max_slots and, with
        decode_row_buckets, up to three halvings (32, 64, 128, 256 at 256 slots; one compile
        each, all in warm_up). A call with n decoding rows takes the smallest >= n
        (_decode_bucket): its projections, MLP, logits and token picker run on that many
        rows, not on every slot (their FLOPs grow with the rows; the weights' bytes read do
        not)."""
        return list(self._decode_buckets)

    def _decode_bucket(self, rows: int) -> int:
        """The smallest decode bucket that holds `rows` decoding rows."""
        return next(n for n in self._decode_buckets if n >= rows)

    def _input_fields(self) -> dict[str, tuple[int, Any]]:
        """The steps' per-call inputs (StepInputs, at fixed addresses). A call writes the ones
        it uses in one upload (_write_inputs)."""
        B = self.max_slots
        fields: dict[str, tuple[int, Any]] = {
            "lengths": (B, np.int32),  # tokens each slot holds before the call
            "cu_seqlens": (B + 1, np.int32),  # the prefill's packed sequence offsets
            "tokens": (B, np.int32),  # the decode's input token per row
            "bound": (B, np.int32),  # the decode's write bound (0: an idle row)
            "temperature": (B, np.float32),
            "top_k": (B, np.int32),
            "top_p": (B, np.float32),
            "seeds": (B, np.uint32),
            "status": (B, np.int32),  # the decode step's status out, in place (donated)
        }
        for n in self.prefill_buckets():
            fields[f"prefill_tokens_{n}"] = (n, np.int32)
        for n in self.decode_buckets()[:-1]:  # the last is max_slots: every row, no index
            fields[f"decode_rows_{n}"] = (n, np.int32)  # the slots it advances, then B
        if self.decode_steps > 1:
            fields["steps"] = (B, np.int32)  # steps each row computes in a decode call (0: idle)
        return fields

    def _prefill_fn(self) -> Any:
        model = self.model
        attention = dict(self._attention["prefill"])
        if "attention" in self._attention["decode"]:  # per shard under a mesh
            attention["decode_attention"] = self._attention["decode"]["attention"]
        replicated = self._replicated

        def run(params, tokens, cu_seqlens, caches, lengths, committed, decode_tokens,
                decode_bound):  # fmt: skip
            self._traces["prefill"] += 1  # runs while tracing only
            logits, caches, status = model.prefill_packed(
                params, tokens, cu_seqlens, caches, lengths, layout=Layout.SEQ_MAJOR,
                committed=committed, decode_tokens=decode_tokens, decode_bound=decode_bound,
                **attention,
            )  # fmt: skip
            # The position of the token each row samples: after its piece, or its decode token.
            new = cu_seqlens[1:] - cu_seqlens[:-1]
            positions = lengths + jnp.where(new > 0, new, 1)
            return logits, replicated(status), caches, replicated(positions)

        return run

    def _decode_fn(self) -> Any:
        model = self.model
        attention = self._attention["decode"]
        replicated = self._replicated

        def run(params, tokens, caches, lengths, committed, status, rows=None):
            # rows int32 [n] (a decode bucket below max_slots): the slots the call advances,
            # then B (padding); its logits are theirs, [n, V]. None: every row's, [B, V].
            # status int32 [B] (donated, its value unused): the buffer the step's status is
            # returned in. It is the first [B] int32 output, so jit aliases it there and not
            # to the positions after it.
            del status
            self._traces["decode"] += 1
            bucket = {} if rows is None else {"rows": rows}
            logits, caches, status = model.decode_step(
                params, tokens, caches, lengths, layout=Layout.SEQ_MAJOR, committed=committed,
                **bucket, **attention,
            )  # fmt: skip
            return logits, replicated(status), caches, replicated(lengths + 1)

        return run

    def _greedy_fn(self) -> Any:
        replicated = self._replicated

        def run(logits, status, tokens, rows=None):
            # float32 [n, V], int32 [B], int32 [B] (donated), int32 [n] or None (n = B: every
            # row) -> (tokens', int32 [2, B]: the picked tokens, at `rows` where given (the
            # others the input's), and the status)
            picked = replicated(argmax_rows(logits))
            tokens = _into(picked, tokens, rows)
            return tokens, replicated(jnp.stack([picked if rows is None else tokens, status]))

        return run

    def _sampler_fn(self) -> Any:
        replicated = self._replicated

        def run(logits, positions, temp, top_k, top_p, seeds, status, tokens, rows=None):
            # positions int32 [B]: the position of the token each row samples (its key's).
            # With `rows` the logits are theirs [n, V]: each one's parameters are gathered
            # (a padding entry's: greedy, its token dropped).
            picked = replicated(_sampled(logits, positions, temp, top_k, top_p, seeds, rows))
            tokens = _into(picked, tokens, rows)
            return tokens, replicated(jnp.stack([picked if rows is None else tokens, status]))

        return run

    def _decode_steps_fn(self, sample: bool) -> Any:
        model, k = self.model, self.decode_steps
        attention = self._attention["decode"]
        replicated = self._replicated

        def run(params, tokens, caches, lengths, committed, steps, temp, top_k, top_p, seeds,
                rows=None):  # fmt: skip
            # steps int32 [B]: the steps row b computes (0: idle); it is idle after them (its
            # bound 0: no reads, no writes), its token then kept. -> (tokens' [B], int32
            # [k + 1, B]: each step's tokens, as the picker's, then the status, caches).
            self._traces["decode"] += 1
            bucket = {} if rows is None else {"rows": rows}

            def one(carry, i):
                tokens, caches, lengths, status = carry
                live = i < steps
                logits, caches, latched = model.decode_step(
                    params, tokens, caches, lengths, layout=Layout.SEQ_MAJOR,
                    committed=jnp.where(live, committed, 0), **bucket, **attention,
                )  # fmt: skip
                if sample:  # keyed by the position of the token it samples, as _sampler_fn
                    picked = _sampled(logits, lengths + 1, temp, top_k, top_p, seeds, rows)
                    picked = replicated(picked)
                else:
                    picked = replicated(argmax_rows(logits))
                new = _into(picked, tokens, rows)
                tokens = jnp.where(live, new, tokens)
                carry = (tokens, caches, lengths + live.astype(lengths.dtype),
                         jnp.maximum(status, latched))  # fmt: skip
                return carry, new

            init = (tokens, caches, lengths, jnp.zeros_like(lengths))
            # Unrolled: straight-line steps that XLA records as one CUDA graph; a loop would
            # be a while command (or, outside a graph, one host launch per iteration).
            (tokens, caches, _, status), picked = jax.lax.scan(
                one, init, jnp.arange(k, dtype=jnp.int32), unroll=True
            )
            out = jnp.concatenate([picked, status[None]])
            return tokens, replicated(out), caches

        return run

    def _replicated(self, x: jax.Array) -> jax.Array:
        """Under a mesh, a step's per-row output (sampled tokens, status) whole on every
        device: each process reads its own copy."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))

    # -- submit -------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        sampling: Sampling | None = None,
        *,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queues a request; returns its handle at once. Thread-safe.

        Args:
            prompt: text (needs the model's tokenizer) or token ids.
            max_new_tokens: the most tokens to generate; prompt + max_new_tokens must fit
                max_len.
            sampling: temperature, top_k, top_p, seed (greedy when omitted).
            stop: strings that end the request (excluded from its text; needs a tokenizer).
            stop_token_ids: ids that end it (kept as its last token); default the model's EOS.

        Raises:
            ValueError: a bad argument, or a request longer than max_len or than the memory
                could ever hold (naming the numbers).
            QueueFull: max_queue requests wait. EngineError: shut down or failed.
        """
        ids, max_new, sampling, stops, stop_ids = self.limits.check(
            self.model, prompt, max_new_tokens, sampling, stop, stop_token_ids
        )
        text = None
        if getattr(self.model, "tokenizer", None) is not None:
            text = TextStream(lambda t: self.model.decode(t, skip_special_tokens=True), stops)
        seq = _Seq(
            request=Request(ids, request_id, on_cancel=self._note_cancel),
            prompt=ids,
            max_new=max_new,
            sampling=sampling,
            stop_ids=stop_ids,
            text=text,
        )
        with self._lock:
            if self._failure is not None:
                raise EngineError(f"the engine failed: {self._failure}") from self._failure
            if not self._accepting:
                raise EngineError("the engine is shutting down: it accepts no new requests")
            waiting = self._queued_new()
            if waiting >= self.max_queue:
                raise QueueFull(
                    f"submit: the queue is full ({waiting} requests waiting, max_queue="
                    f"{self.max_queue}); retry later"
                )
            self._queue.append(seq)
            self.stats.submitted += 1
            self._work.notify_all()
        return seq.request

    # -- the scheduling step ------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """The counters, the requests and the KV bytes now (read from any thread: each value
        is current, the set of them not one instant's)."""
        cache = self.cache
        kv = None
        if not cache.closed:
            kv = dict(committed=cache.committed_bytes, held=cache.held_bytes,
                      live=cache.live_bytes, cached_only=cache.cached_only_bytes)  # fmt: skip
        stats = dataclasses.replace(
            self.stats,
            finished=dict(self.stats.finished),
            prefill_buckets=list(self.stats.prefill_buckets),
            decode_bucket_calls=dict(self.stats.decode_bucket_calls),
        )
        prefix = None if self.prefix is None else dataclasses.replace(self.prefix.stats)
        with self._lock:
            waiting, queued = len(self._queue), self._queued_new()
        return EngineSnapshot(stats, self.num_running, waiting, queued, kv, prefix)

    def _queued_new(self) -> int:
        """Queued requests never admitted (preempted ones wait too, uncounted). Under _lock."""
        return sum(1 for s in self._queue if s.admitted < 0)

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the engine (a step raised), or None."""
        return self._failure

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return sum(s is not None for s in self._slots)

    @property
    def live_bytes(self) -> int:
        """KV bytes of the running requests' tokens, all layers, K and V (ended requests'
        slots, released or handed over after their last call, are not counted)."""
        running = [b for b, s in enumerate(self._slots) if s is not None]
        tokens = int(self.cache.lengths[running].astype(np.int64).sum())
        return tokens * self.cache.token_bytes * self.cache.bindings

    @property
    def num_waiting(self) -> int:
        """Requests queued (preempted ones included)."""
        with self._lock:
            return len(self._queue)

    @property
    def accepting(self) -> bool:
        with self._lock:
            return self._accepting and self._failure is None

    def has_work(self) -> bool:
        with self._lock:
            queued = bool(self._queue)
        return queued or self._holds_slots()

    def step(self) -> bool:
        """One scheduling iteration; returns whether any work remains. Call it from one
        thread at a time (start() runs it on a background thread). Its tokens and endings
        have reached their requests when it returns."""
        return self._step(defer_delivery=False)

    def _step(self, defer_delivery: bool) -> bool:
        """step(); with defer_delivery (the background driver), the tokens and endings of
        this step's call reach their requests while the next call runs (_deliver), unless
        no call follows: streaming to clients (a listener per request, an event loop's
        wake-up: ~6 us each) is then host work the device does not wait for."""
        t0 = self._step_t0 = time.perf_counter()
        try:
            if self._next is not None:  # a decode call dispatched by the last step
                prefill_tokens, decode_rows, prefill_s = 0, len(self._next.rows), 0.0
                decode_s = self._run_next()
                if self._next is None:
                    self._end_cancelled()  # nothing in flight: the slots can go at once
                if not defer_delivery or not self.has_work():
                    self._deliver()
                return self._account(t0, prefill_tokens, prefill_s, decode_rows, decode_s)
            self._end_cancelled()
            counts = self._plan_prefill()
            rows = self._plan_decode()
            # A prefilling slot preempted for a decoding row's memory leaves this call.
            counts[[b for b in np.flatnonzero(counts) if self._slots[b] is None]] = 0
            prefill_tokens, decode_rows = int(counts.sum()), len(rows)
            prefill_s = decode_s = 0.0
            if prefill_tokens:
                prefill_s = self._run_prefill(counts, rows)
            elif rows:
                decode_s = self._run_decode(rows)
            else:
                self._retire()  # no call to overlap
            if not (defer_delivery and (prefill_tokens or rows) and self.has_work()):
                self._deliver()
            return self._account(t0, prefill_tokens, prefill_s, decode_rows, decode_s)
        except BaseException as error:
            self._fail(error)
            raise

    def _account(self, t0: float, prefill_tokens: int, prefill_s: float, decode_rows: int,
                 decode_s: float) -> bool:  # fmt: skip
        """Counts a step that started at t0; returns whether work remains (after the
        delivery: a listener may have submitted)."""
        work = self.has_work()
        self.stats.steps += 1
        elapsed = time.perf_counter() - t0
        device = prefill_s + decode_s
        self.last_step = StepRecord(prefill_tokens, prefill_s, decode_rows, decode_s, elapsed)
        self.stats.step_seconds += elapsed
        self.stats.host_seconds += elapsed - device
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self.cache.held_bytes)
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.cache.live_bytes)
        return work

    def warm_up(self, between: Callable[[], None] | None = None) -> None:
        """Compiles every prefill bucket (16 .. prefill_chunk_tokens), the decode step of
        every decode bucket and both token pickers (argmax, sampler) of each, by serving a few
        short requests and then, for the buckets and pickers those left out, a decode call
        whose rows are all idle, before the background driver starts (a server is ready only
        after this: no request then waits for a compile). A shutdown() from another thread
        ends it at its next request or idle call (refused with EngineError).

        `between` runs before each warm-up request (between compiles); the server's engine
        process reads its pipe there. If it raises, the warm-up's own requests are cancelled
        and ended (the engine is idle again, its compiles so far kept) and the exception
        propagates."""
        if self._thread is not None:
            raise EngineError("warm_up: call it before start()")
        mine: list[Request] = []

        def pause() -> None:  # before each compile
            if between is not None:
                try:
                    between()
                except BaseException:
                    for request in mine:
                        request.cancel()
                    self.run_until_idle()
                    raise

        def submit(prompt: list[int], max_new: int, sampling: Sampling | None = None) -> None:
            pause()
            while self.num_waiting >= self.max_queue:  # within the engine's own max_queue
                self.step()
            mine.append(self.submit(prompt, max_new, sampling, stop_token_ids=[]))

        vocab = self.model.config.vocab_size
        longest = self.max_len - 1  # a prompt with one new token (its first, from prefill)
        smaller = 0  # the bucket below n
        for n in self.prefill_buckets():
            # The most real tokens a call for bucket n can hold: one prompt, or several packed
            # together (a serving call packs rows too) where n passes the longest prompt.
            real = min(n, self.max_slots * longest)
            if real <= smaller:
                break  # no call reaches bucket n
            for j in range(-(-real // longest)):
                size = min(longest, real - j * longest)
                # Prompts that share no block (the prefix cache would shorten their prefill).
                submit([(n + 131 * j + i) % vocab for i in range(size)], 1)
            self.run_until_idle()
            smaller = n
        size = max(1, min(20, self.max_len - 3))
        for j in range(min(4, self.max_slots)):  # a packed call of several rows, a wide decode
            # The first samples: the sampler is compiled too (the others' calls: argmax).
            submit([1 + j] * size, min(3, self.max_len - size), Sampling(1.0) if j == 0 else None)
        self.run_until_idle()
        # The decode buckets and pickers no call above ran (the requests' decode calls take
        # the smallest bucket; at max_len 2 none decodes): a call of idle rows each.
        for n in self.decode_buckets():
            for picker in ("argmax", "sampler"):
                if self._decode_programs(n, picker) <= self._ran:
                    continue
                pause()
                if not self.accepting:
                    raise EngineError("warm_up: the engine is shutting down or failed")
                self.run_until_idle()  # a request submitted meanwhile (in-process server)
                if not self._decode_programs(n, picker) <= self._ran:
                    self._run_decode([], bucket=n, sample=picker == "sampler")

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Steps until every submitted request finished (tests, offline use)."""
        n = 0
        while self.has_work():
            if max_steps is not None and n >= max_steps:
                raise RuntimeError(f"run_until_idle: work left after {max_steps} steps")
            self.step()
            n += 1

    def _active(self) -> list[_Seq]:
        return [s for s in self._slots if s is not None]

    def _note_cancel(self) -> None:
        with self._lock:
            self._cancels += 1

    def _end_cancelled(self) -> None:
        with self._lock:
            if self._cancels == self._cancels_seen:  # none since the last look
                return
            self._cancels_seen = self._cancels
        for seq in self._active():
            if seq.request.cancel_requested:
                self._finish(seq, FINISH_CANCELLED)
        with self._lock:
            gone = [s for s in self._queue if s.request.cancel_requested]
            for s in gone:
                self._queue.remove(s)
        for s in gone:
            self._finish(s, FINISH_CANCELLED)

    def _admit(self, room: int, counts: np.ndarray, defer_hand_over: bool = False) -> int:
        """Admits queued requests, FIFO, into free slots while the prefill call has room and
        the head's first piece (what it prefills in this call) can be committed; the head
        never preempts to get in. Returns the room left. While a call is in flight
        (_plan_ahead) the pieces are the next call's, and a head that the call's blocks would
        give more prefix hits waits for the next planning. defer_hand_over: a head that finds
        no free slot waits for the call in flight instead of taking an ending request's."""
        while room > 0:
            with self._lock:
                if not self._queue:
                    break
                seq = self._queue[0]
                # Beside a call, a request cancelled since the step's _end_cancelled.
                cancelled = seq.request.cancel_requested
                if cancelled:
                    self._queue.popleft()
            if cancelled:
                self._finish(seq, FINISH_CANCELLED)
                continue
            b = self._free_slot()
            ended = self._releasable()
            if b is None and (defer_hand_over or not ended):
                break
            hits, partial = self._lookup(seq)
            if self._inflight_extends(seq, hits):
                break
            if b is None:  # the head needs an ended request's slot now (idle in the call)
                b = ended[0]
                first = min(seq.prefill_target, room)
                # Its granules serve the head as they are (SlotCache.hand_over), or fresh ones
                # replace them in place where the prefix store keeps the old request's blocks
                # (then only if the memory is there: no eviction for it). The partial block
                # the old request ended in is evicted instead where nothing maps it: the slot
                # is then reused as it is, no driver call, where keeping the block costs a
                # fresh granule per binding (4 driver calls each); it would serve only a
                # request continuing the old one, and the head is not one (no hit).
                reuse = not hits and partial is None  # hits: b's blocks to map, not reuse
                if reuse and self.prefix is not None:
                    _, wrote = self.cache.links_within(b, first)
                    self.stats.hand_over_evictions += self.prefix.evict_partials(wrote)
                if reuse and (
                    self.cache.hands_over_in_place(b, first)
                    or self.cache.bytes_for(first) <= self.cache.available_bytes()
                ):
                    self._retiring.pop(b).slot = None
                    try:
                        self.cache.hand_over(b, first)
                        self.stats.slots_handed_over += 1
                    except ArenaExhausted:
                        pass  # b is released: the head's commit below tries (and evicts) again
                    self._trim_prefix()  # the old request's blocks are the store's alone now
                else:
                    self._retire(only=b)
                    hits, partial = self._lookup(seq)  # the release may have evicted some
            if partial is not None and self.cache.block_bytes > self.cache.available_bytes():
                self._retire()  # the memory ended requests still hold
                # Their release trims the prefix cache to its cap, which may drop the blocks
                # just looked up (a partial block goes first): look up again before mapping.
                hits, partial = self._lookup(seq)
                if partial is not None and self.cache.block_bytes > self.cache.available_bytes():
                    partial = None  # its private copy does not fit: its tokens are prefilled
            start = len(hits) * self.cache.block_tokens + (len(partial.tokens) if partial else 0)
            n = min(seq.prefill_target - start, room)
            try:
                if hits:
                    self.cache.map_cached(b, [h.store for h in hits])
                if partial is not None:  # a private copy of the block to append to
                    self.cache.map_partial(b, len(hits), partial.store)
                self._commit(b, start + n)
            except ArenaExhausted:
                self.cache.release_slot(b)  # the mapped prefix too
                self._trim_prefix()  # its hits, unmapped, are evictable again
                break  # FIFO: the head waits for memory, and so does everyone behind it
            with self._lock:
                self._queue.popleft()
            if self.prefix is not None:
                self.prefix.count_hits(hits, partial)
            seq.slot, seq.cached, seq.blocks = b, start, hits
            self.cache.lengths[b] = start
            seq.admitted = self._admissions
            self._admissions += 1
            self._slots[b] = seq
            s = seq.sampling
            self._temperature[b], self._top_k[b], self._top_p[b] = s.temperature, s.top_k, s.top_p
            self._seeds[b] = s.seed & 0xFFFFFFFF  # JAX keys on the low 32 bits (Sampling)
            self._sampling_dirty = True
            counts[b] = n
            room -= n
            if self._in_flight is not None:
                self._ahead[b] = (seq, start + n)
                self.stats.admitted_ahead += 1
        return room

    def _free_slot(self) -> int | None:
        for b, seq in enumerate(self._slots):
            if seq is None and b not in self._retiring:
                return b
        return None

    def _lookup(self, seq: _Seq) -> tuple[list, Any]:
        """The cached full blocks seq's tokens start with and a cached partial block after
        them, leaving at least one token to prefill (its logits give the next token)."""
        if self.prefix is None or seq.prefill_target < 2:
            return [], None
        return self.prefix.lookup(seq.token_at, seq.prefill_target - 1)

    def _cache_partial(self, seq: _Seq) -> None:
        """Caches the block seq's slot ends in, partly filled, before the slot is released:
        a request that continues these tokens (the next turn of a chat) copies it."""
        if self.prefix is None or seq.slot is None:
            return
        bt, b = self.cache.block_tokens, seq.slot
        k, rest = divmod(seq.cached, bt)
        if not rest or k != len(seq.blocks):
            return
        if int(self.cache.granules[b]) < (k + 1) * self.cache.block_granules:
            return
        tokens = tuple(seq.tokens(k * bt, seq.cached))
        self.prefix.insert_partial(b, k, seq.blocks[-1] if seq.blocks else None, tokens)

    def _commit(self, b: int, tokens: int) -> int:
        """ensure_slot, evicting cached prefix blocks no slot maps before giving up; returns
        the granules per binding it committed. Counts the commits made with no call in
        flight (the device waits for them)."""
        try:
            committed = self.cache.ensure_slot(b, tokens)
        except ArenaExhausted:
            if self._releasable():  # memory the last call's ended requests still hold
                self._retire()
                return self._commit(b, tokens)
            if self.prefix is None:
                raise
            need = self.cache.bytes_for(tokens) - int(self.cache.granules[b]) * (
                self.cache.bindings * self.cache.granule
            )
            if self.prefix.evict_for(need) == 0:
                raise
            committed = self.cache.ensure_slot(b, tokens)
        if committed and self._in_flight is None:
            self.stats.planning_commits += 1
        return committed

    def _cache_blocks(self, seq: _Seq) -> None:
        """Puts seq's newly written full blocks in the prefix cache."""
        if self.prefix is None or seq.slot is None:
            return
        bt = self.prefix.block_tokens
        for k in range(len(seq.blocks), seq.cached // bt):
            tokens = tuple(seq.tokens(k * bt, (k + 1) * bt))
            parent = seq.blocks[-1] if seq.blocks else None
            block = self.prefix.insert(seq.slot, k, parent, tokens)
            if block is None:
                break  # the store is full of blocks in use
            seq.blocks.append(block)
        self._trim_prefix()

    def _reserve(self, seq: _Seq, tokens: int) -> bool:
        """Commits what seq's slot needs for `tokens` tokens, evicting unused cached prefix
        blocks, then preempting younger slot holders while memory is short; False if even
        that cannot make room."""
        assert seq.slot is not None
        while True:
            try:
                self._commit(seq.slot, tokens)
                return True
            except ArenaExhausted:
                younger = [s for s in self._active() if s.admitted > seq.admitted]
                if not younger:
                    return False
                self._preempt(max(younger, key=lambda s: s.admitted))

    def _preempt(self, seq: _Seq) -> None:
        """Releases seq's slot and memory; it keeps its tokens and waits at the queue's head
        to be re-prefilled."""
        assert seq.slot is not None
        self._slots[seq.slot] = None
        self._release(seq, keep_partial=True)
        seq.cached, seq.blocks = 0, []
        seq.preemptions += 1
        self.stats.preemptions += 1
        with self._lock:
            self._queue.appendleft(seq)

    def _release(self, seq: _Seq, keep_partial: bool) -> None:
        """Returns seq's slot and its granules (the block it ends in cached first, unless
        the slot's bytes are not to be trusted)."""
        assert seq.slot is not None
        if keep_partial:
            self._cache_partial(seq)
        self.cache.release_slot(seq.slot)
        seq.slot = None
        self._trim_prefix()

    def _retire(self, only: int | None = None, keep_for_queue: bool = False) -> None:
        """Releases the slots of the requests that ended in the last call (or slot `only`;
        the block each ended in was cached when it ended). While a call is in flight it
        leaves those rows idle (they were not planned into it), so the unmaps need not wait
        for it (SlotCache.beside_step).

        keep_for_queue: as many of them as the queue has heads beyond the free slots stay
        (the fewest granules first), for _admit to hand over with their granules when the
        prefill chunk has room: released now, each would cost ~7 driver calls per granule
        and binding (unmap, zero map, then map again) for the head that takes its place a
        call or two later. Short of memory, _commit releases them first."""
        slots = [only] if only is not None else self._releasable()
        if keep_for_queue and slots:
            with self._lock:
                waiting = len(self._queue)
            free = sum(s is None and b not in self._retiring for b, s in enumerate(self._slots))
            keep = max(0, min(len(slots), waiting - free))
            slots.sort(key=lambda b: int(self.cache.granules[b]))
            self.stats.slots_kept_for_queue += keep
            slots = slots[keep:]
        if not slots:
            return
        beside_step = self._in_flight is not None  # inside _complete's cache.beside_step()
        t0 = time.perf_counter()
        for b in slots:
            self._release(self._retiring.pop(b), keep_partial=False)
            self.stats.releases_beside_step += beside_step
        if beside_step:
            self.stats.release_beside_step_seconds += time.perf_counter() - t0

    def _releasable(self) -> list[int]:
        """The slots of ended requests that no call in flight writes: a decode call
        dispatched ahead (_dispatch_next) may still compute a row whose request ended on the
        call before it; that slot goes after it."""
        busy = self._in_flight_slots()
        return [b for b in self._retiring if b not in busy]

    def _in_flight_slots(self) -> set[int]:
        """The slots whose rows the call in flight advances (its decoding rows)."""
        return set() if self._in_flight is None else {s.slot for s in self._in_flight[1]}

    def _running(self, rows: list[_Seq]) -> list[_Seq]:
        """The rows of a call whose request still holds its slot (not ended since the call
        was dispatched: a call ahead may hold rows that ended on the call before it)."""
        return [s for s in rows if s.slot is not None and self._slots[s.slot] is s]

    def _trim_prefix(self) -> None:
        """Evicts blocks no running request maps (PrefixCache's order) while the store's
        blocks pass prefix_cache_bytes. Called wherever the store grows (_cache_blocks, a
        request's end) or blocks become evictable (an end, a release, an admission that gave
        back the blocks it had mapped)."""
        if self.prefix is None or self.prefix_cache_bytes is None:
            return
        if self.cache.store_bytes > self.prefix_cache_bytes:
            self.prefix.trim_to(self.prefix_cache_bytes, ended=self._retiring)

    def _plan_prefill(self) -> np.ndarray:
        """Commits this step's prefill pieces (the prefilling slots' next ones in admission
        order, then admissions while the chunk has room); returns tokens per slot [B]."""
        waiting = sorted(
            (s for s in self._active() if s.cached < s.prefill_target), key=lambda s: s.admitted
        )
        counts = np.zeros((self.max_slots,), np.int64)
        room = self.prefill_chunk_tokens
        for seq in waiting:
            if room == 0:
                break
            if seq.slot is None:  # preempted by an older one's reservation in this loop
                continue
            n = min(seq.prefill_target - seq.cached, room)
            if not self._reserve(seq, seq.cached + n):
                continue
            counts[seq.slot] = n
            room -= n
        # With a call to run anyway, a head that needs an ending request's slot is admitted
        # beside it (_plan_ahead: the hand-over's unmaps and commits hidden behind the call,
        # its first piece one call later); free slots are taken now.
        decoding = any(s.generated and s.cached == s.prefill_target for s in self._active())
        self._admit(room, counts, defer_hand_over=bool(counts.any()) or decoding)
        return counts

    def _plan_decode(self) -> list[_Seq]:
        """Commits the memory of each decoding slot's next token, preempting the youngest
        holders where it cannot; returns the rows this step advances."""
        decoding = sorted(
            (s for s in self._active() if s.cached == s.prefill_target and s.generated),
            key=lambda s: s.admitted,
        )
        rows: list[_Seq] = []
        # A row crosses into a new granule once per granule's tokens (1,024 at 8B); the others
        # skip ensure_slot (bench/engine_host.py, 256 busy slots: 1.25 -> 1.17 ms of host time
        # per step). Preemptions below only free slots (theirs then read None).
        backed = self.cache.committed_tokens()
        for seq in decoding:
            if seq.slot is None:  # preempted for an older one
                continue
            need = seq.cached + self._steps_of(seq)
            if need <= backed[seq.slot] or self._reserve(seq, need):
                rows.append(seq)
            else:
                self._preempt(seq)  # the youngest: it waits for the older ones' memory
        return [s for s in rows if s.slot is not None]

    def _write_inputs(self, rows: list[_Seq], **more: np.ndarray) -> None:
        """A call's inputs, in one host-to-device copy: the decoding `rows`' tokens, lengths
        and write bound, `more` (the prefill's cu_seqlens and tokens, a decode bucket's rows),
        and the sampling parameters when an admission changed them."""
        tokens = np.zeros((self.max_slots,), np.int32)
        for seq in rows:
            tokens[seq.slot] = seq.generated[-1]
        values = dict(tokens=tokens, lengths=self._lengths(), bound=self._decode_bound(rows))
        values.update(more)
        if self._sampling_dirty:
            values.update(self._sampling_values())
            self._sampling_dirty = False
        self._inputs.write(**values)

    def _run_prefill(self, counts: np.ndarray, rows: list[_Seq]) -> float:
        """One call of the prefill step: the slots' packed pieces (`counts` tokens each) and,
        in the same pass over the weights, the decoding `rows`' next tokens (the decode
        kernel's rows of the call). Returns its seconds."""
        real = int(counts.sum())
        N = min(bucket_for(real, PREFILL_MIN_TOKENS), self.prefill_chunk_tokens)
        tokens = np.zeros((N,), np.int32)
        i = 0
        for b in np.flatnonzero(counts):
            seq = self._slots[b]
            assert seq is not None
            n = int(counts[b])
            tokens[i : i + n] = seq.tokens(seq.cached, seq.cached + n)
            i += n
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        if N not in self.stats.prefill_buckets:
            self.stats.prefill_buckets.append(N)
        name = f"prefill_tokens_{N}"
        self._write_inputs(rows, cu_seqlens=cu, **{name: tokens})
        inputs = self._inputs
        sampled, status, seconds = self._call(
            "prefill", inputs[name], inputs["cu_seqlens"], self._caches(), inputs["lengths"],
            self.cache.committed, inputs["tokens"], inputs["bound"], rows=rows, counts=counts,
        )  # fmt: skip
        self.stats.prefill_calls += 1
        self.stats.mixed_calls += bool(rows)
        self.stats.prefill_tokens += real
        self.stats.prefill_tokens_computed += N
        for b in np.flatnonzero(counts):
            seq = self._slots[b]
            assert seq is not None
            if status[b]:
                self._fail_row(seq, int(status[b]), "prefill")
                continue
            seq.cached += int(counts[b])
            self.cache.lengths[b] = seq.cached
            self._cache_blocks(seq)
            if seq.cached == seq.prefill_target and not seq.generated:
                self._emit(seq, int(sampled[b]))
        self._advance(rows, sampled, status)
        return seconds

    def _run_decode(
        self, rows: list[_Seq], bucket: int | None = None, sample: bool | None = None
    ) -> float:
        """One call of the decode step: the decoding `rows` advance, the others are idle. It
        computes the smallest decode bucket of rows that holds them, or `bucket` with the
        picker `sample` says (warm_up's calls of idle rows). Returns its seconds."""
        n = self._decode_bucket(len(rows)) if bucket is None else bucket
        more = self._row_index(rows, n)
        if self.decode_steps > 1:
            more["steps"] = np.zeros((self.max_slots,), np.int32)
            for seq in rows:
                more["steps"][seq.slot] = self._steps_of(seq)
        self._write_inputs(rows, **more)
        inputs = self._inputs
        sampled, status, seconds = self._call(
            "decode", inputs["tokens"], self._caches(), inputs["lengths"], inputs["bound"],
            rows=rows, bucket=n, sample=sample,
        )  # fmt: skip
        self._count_decode(n)
        self._advance(rows, sampled, status)
        return seconds

    def _row_index(self, rows: list[_Seq], bucket: int) -> dict[str, np.ndarray]:
        """The row index of a decode call on `bucket` rows, as an input to write: the decoding
        `rows`' slots ascending, then max_slots (padding: its picked token is dropped); none
        for the max_slots bucket (every row, in slot order)."""
        if bucket == self.max_slots:
            return {}
        if len(rows) > bucket:
            raise AssertionError(f"decode bucket {bucket}: {len(rows)} rows do not fit")
        index = np.full((bucket,), self.max_slots, np.int32)
        index[: len(rows)] = sorted(s.slot for s in rows)
        return {f"decode_rows_{bucket}": index}

    def _row_index_arg(self, bucket: int) -> tuple[jax.Array, ...]:
        """The row index input of a call on `bucket` rows as the step's and the picker's last
        argument: () for the max_slots bucket. Taken after any write of the inputs (a write
        returns every field as a new array, at the same address)."""
        return () if bucket == self.max_slots else (self._inputs[f"decode_rows_{bucket}"],)

    def _count_decode(self, bucket: int) -> None:
        self.stats.decode_calls += 1
        calls = self.stats.decode_bucket_calls
        calls[bucket] = calls.get(bucket, 0) + 1

    def _advance(self, rows: list[_Seq], sampled: np.ndarray, status: np.ndarray) -> None:
        """The decoding rows' tokens of a call reach their requests. On the host's path once
        per call (every running row at 0.5B's short steps): the rows' slots, statuses, tokens
        and lengths are read and written as arrays, not per row."""
        if not rows:
            return
        slots = np.fromiter((seq.slot for seq in rows), np.int64, len(rows))
        codes = status[slots]
        if codes.any():
            for seq, code in zip(rows, codes.tolist(), strict=True):
                if code:
                    self._fail_row(seq, code, "decode")
            ok = codes == 0
            rows, slots = [s for s, k in zip(rows, ok, strict=True) if k], slots[ok]
        if sampled.ndim == 2:  # a call of decode_steps tokens per row
            self._advance_steps(rows, slots, sampled)
            return
        self.cache.lengths[slots] = np.fromiter((s.cached + 1 for s in rows), np.int32, len(rows))
        bt = None if self.prefix is None else self.prefix.block_tokens
        for seq, token in zip(rows, sampled[slots].tolist(), strict=True):
            seq.cached += 1
            if bt is not None and seq.cached // bt > len(seq.blocks):
                self._cache_blocks(seq)
            self._emit(seq, token)
        self.stats.decode_tokens += len(rows)

    def _advance_steps(self, rows: list[_Seq], slots: np.ndarray, sampled: np.ndarray) -> None:
        """_advance of a call of decode_steps steps (sampled [k, B]): each row takes the
        tokens of the steps it computed, until its request ends (a stop: its later tokens
        were computed for nothing and are dropped)."""
        bt = None if self.prefix is None else self.prefix.block_tokens
        emitted = 0
        for seq, b, tokens in zip(rows, slots.tolist(), sampled[:, slots].T.tolist(), strict=True):
            for token in tokens[: self._steps_of(seq)]:
                seq.cached += 1
                self.cache.lengths[b] = seq.cached
                if bt is not None and seq.cached // bt > len(seq.blocks):
                    self._cache_blocks(seq)
                self._emit(seq, token)
                emitted += 1
                if self._slots[b] is not seq:  # it ended on this token
                    break
        self.stats.decode_tokens += emitted

    def _call(
        self,
        kind: str,
        *args: Any,
        rows: list[_Seq],
        counts: np.ndarray | None = None,
        bucket: int | None = None,
        sample: bool | None = None,
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """Runs the `kind` step on (params, *args) and the picker of its tokens, with the
        next call's memory committed beside it (_complete) -> (tokens [B], status [B] on the
        host, seconds until they were there)."""
        return self._complete(self._dispatch(kind, args, rows, counts, bucket, sample))

    def _dispatch(
        self,
        kind: str,
        args: tuple,
        rows: list[_Seq],
        counts: np.ndarray | None,
        bucket: int | None = None,
        sample: bool | None = None,
    ) -> _Pending:
        """Queues the `kind` step on (params, *args), then the picker of its tokens (argmax
        where every row of the call is greedy, or as `sample` says), which also writes them
        into the `tokens` input; counts their compiles (jit's cache of each, _programs) and
        takes the caches. A decode call on a `bucket` below max_slots (its row index written)
        passes the step and the picker its row index; a prefill call computes every row."""
        bucket = self.max_slots if bucket is None else bucket
        if kind == "decode" and self.decode_steps > 1:
            return self._dispatch_steps(rows, bucket, sample)
        step = self._prefill if kind == "prefill" else self._decode
        programs, pickers = _programs(step, self._traces[kind]), self._picker_programs()
        t0 = time.perf_counter()
        if kind == "decode":
            args = (*args, self._inputs["status"])
        logits, status, caches, positions = step(self.params, *args, *self._row_index_arg(bucket))
        compiled = _programs(step, self._traces[kind]) - programs
        self._accept(caches, verify=bool(compiled))  # the cache's arrays, whatever follows
        if kind == "decode":
            # Taken back at once, and read back after the sampler's parameters' write below:
            # a write passes every field donated, this one too, and returns each anew.
            self._inputs.replace("status", status)
        if sample is None:
            sample = self._samples(rows, counts)
        sampling = self._sampling_args() if sample else ()  # may write the inputs: first
        if kind == "decode":
            status = self._inputs["status"]
        if sample:
            field, out = self._sampler(
                logits, positions, *sampling, status, self._inputs["tokens"],
                *self._row_index_arg(bucket),
            )  # fmt: skip
        else:
            field, out = self._greedy(
                logits, status, self._inputs["tokens"], *self._row_index_arg(bucket)
            )
        self._inputs.replace("tokens", field)
        self._ran.update({(kind, bucket), ("sampler" if sample else "argmax", bucket)})
        # The step's outputs go back to XLA's allocator once the picker has read them.
        del logits, positions, status
        self.stats.sampler_compiles += self._picker_programs() - pickers
        if kind == "prefill":
            self.stats.prefill_compiles += compiled
        else:
            self.stats.decode_compiles += compiled
        return _Pending(rows, counts, out, t0, bucket)

    def _dispatch_steps(self, rows: list[_Seq], bucket: int, sample: bool | None) -> _Pending:
        """_dispatch of a decode call of decode_steps > 1 steps: one program, its picker
        inside, on the inputs as written (the `steps` field too)."""
        if sample is None:
            sample = self._samples(rows, None)
        step = self._decode_steps[sample]
        programs = _programs(step, self._traces["decode"])
        sampling = self._sampling_args()  # may write the inputs: before taking them
        inputs = self._inputs
        t0 = time.perf_counter()
        tokens, out, caches = step(
            self.params, inputs["tokens"], self._caches(), inputs["lengths"], inputs["bound"],
            inputs["steps"], *sampling, *self._row_index_arg(bucket),
        )  # fmt: skip
        compiled = _programs(step, self._traces["decode"]) - programs
        self._accept(caches, verify=bool(compiled))
        self._inputs.replace("tokens", tokens)
        self._ran.update(self._decode_programs(bucket, "sampler" if sample else "argmax"))
        self.stats.decode_compiles += compiled
        return _Pending(rows, None, out, t0, bucket)

    def _decode_programs(self, bucket: int, picker: str) -> set[tuple[str, int]]:
        """What a decode call on `bucket` rows with `picker` runs, as _ran names it: the
        decode step and the picker (shared with a prefill call's on max_slots rows), or with
        decode_steps > 1 the one program of both."""
        if self.decode_steps > 1:
            return {(f"decode_steps_{picker}", bucket)}
        return {("decode", bucket), (picker, bucket)}

    def _steps_of(self, seq: _Seq, done: int = 0) -> int:
        """The tokens seq's next decode call computes, after `done` more of its tokens."""
        return min(self.decode_steps, seq.max_new - len(seq.generated) - done)

    def _complete(self, call: _Pending) -> tuple[np.ndarray, np.ndarray, float]:
        """Waits for a dispatched call's tokens -> (tokens [B], status [B] on the host,
        seconds until they were there, from its dispatch or this step's start, the later).
        While it runs (its prefill `counts` per slot and decoding `rows` in flight), the
        decoding rows' next granules are committed and, where the next call is decode only,
        it is dispatched (_dispatch_next). Then, beside both calls, the last call's tokens
        are delivered, the next prefill's memory is committed (_plan_ahead: an admission made
        there waits for the call after the one dispatched) and the ended requests' slots are
        released. Done first, a burst of them (a wave of endings or admissions) delayed the
        next call's dispatch; done after it, the device runs that call meanwhile, so a burst
        up to about one call long costs the device nothing. The host's whole work per step
        still bounds the step where it is longer than the call."""
        # Every slot these touch is idle in the call: not planned into it (free, ending, or
        # admitted after it was planned), or past the bound it was given.
        self._in_flight = (call.counts, call.rows)
        t1 = time.perf_counter()
        start = max(call.t0, self._step_t0)  # a call dispatched ahead: this step's start
        self.stats.dispatch_seconds += t1 - start
        try:
            with self.cache.beside_step():
                self._commit_ahead(call.rows, call.counts)  # the running requests' memory first
                # A queued request that can go in now is admitted before the decode call
                # ahead would be dispatched, and the next call prefills it instead: after
                # the call ahead it would wait one more call for its first token (measured
                # at ~4 calls of TTFT under arrivals, aefb305). The call after an admission
                # is dispatched after the call before it returns either way (_dispatch_next),
                # one call sooner here; but two heads whose slots free on consecutive calls
                # would be prefilled in two calls where they shared one: so only while every
                # queued request has a slot (_admits_now), not at saturation.
                early = self._admits_now()
                if early:
                    self._plan_ahead(call.counts)
                self._next = self._dispatch_next(call)
                if self._next is not None:  # the host's time before a call ahead's dispatch
                    self.stats.before_next_seconds += time.perf_counter() - t1
                # The rest leaves the next call's rows alone: they are some of `call`'s rows,
                # which _in_flight still names.
                self.stats.delivered_beside_call += self._deliver()  # the last call's tokens
                if not early:
                    self._plan_ahead(call.counts)
                self._retire(keep_for_queue=True)
        finally:
            # A call dispatched ahead is in flight until the next step completes it.
            self._in_flight = None if self._next is None else (None, self._next.rows)
            t2 = time.perf_counter()
            self.stats.beside_seconds += t2 - t1
        self.stats.beside_overran += call.out.is_ready()
        host = _host(call.out)  # [2, B], or [k + 1, B] for decode_steps = k > 1
        sampled, status = (host[0] if len(host) == 2 else host[:-1]), host[-1]
        t3 = time.perf_counter()
        self.stats.wait_seconds += t3 - t2
        return sampled, status, t3 - start

    def _admits_now(self) -> bool:
        """Whether the queue's head is admitted before the decode call ahead would be
        dispatched (_complete): it waits, every queued request has a slot free (or an ended
        request's, releasable), and the arena has the memory of the head's first piece
        without evicting (a prefix hit only needs less). A longer queue is saturation, where
        a request's TTFT is its wait in the queue and admissions made after the call ahead
        share one prefill call (two slots freed on consecutive calls: one call, not two).
        Where memory is short, the admission is tried after the call ahead too: a failed one
        (maps and commits given back) would delay that dispatch."""
        with self._lock:
            if not self._queue:
                return False
            head, waiting = self._queue[0], len(self._queue)
        free = sum(seq is None and b not in self._retiring for b, seq in enumerate(self._slots))
        if waiting > free + len(self._releasable()):
            return False
        first = min(head.prefill_target, self.prefill_chunk_tokens)
        return self.cache.bytes_for(first) <= self.cache.available_bytes()

    def _dispatch_next(self, call: _Pending) -> _Pending | None:
        """Dispatches the decode call after `call` (in flight, its tokens not yet read) where
        that call is known now: decode only (no piece planned or admitted beside `call`, no
        slot prefilling, no cancel to handle), over `call`'s rows except those its token ends
        by length, each with its next token's memory committed. Its inputs are written in
        stream order after `call` (StepInputs), its tokens are the ones `call`'s picker writes
        into the `tokens` input, its lengths one more than each row holds now. A row whose
        request ends on `call`'s token (a stop) is computed for nothing: its token is dropped
        and its slot released after this call (_retire skips the rows in flight). Its bucket
        is the smallest that holds its rows, their slots in its row index (written with the
        lengths): some of `call`'s rows, so never a larger bucket than `call`'s."""
        if not self.decode_ahead or call.counts is not None or self._ahead:
            return None
        with self._lock:
            if self._cancels != self._cancels_seen:
                return None
        backed = self.cache.committed_tokens()
        in_call = self._in_flight_slots()  # call's rows: _complete set it in flight
        rows = []
        lengths = np.zeros((self.max_slots,), np.int32)
        bound = np.zeros((self.max_slots,), np.int32)
        steps = np.zeros((self.max_slots,), np.int32)
        for seq in self._active():
            if seq.cached != seq.prefill_target or not seq.generated:
                return None  # prefilling: the next call is the prefill step
            if seq.slot not in in_call:
                return None  # not one of the call's rows: the next planning decides
            now = self._steps_of(seq)  # the tokens `call` computes for it
            if len(seq.generated) + now >= seq.max_new:
                continue  # call's tokens end it by length
            b = seq.slot
            assert b is not None
            lengths[b], bound[b], steps[b] = seq.cached + now, backed[b], self._steps_of(seq, now)
            if lengths[b] + steps[b] > backed[b]:
                return None  # its next tokens need memory: the next planning commits it
            rows.append(seq)
        if not rows:
            return None
        n = self._decode_bucket(len(rows))
        assert n <= call.bucket, (n, call.bucket)
        more = self._row_index(rows, n)
        if self.decode_steps > 1:
            more["steps"] = steps
        # `tokens`: call's picker writes them, at its rows' slots (these among them).
        self._inputs.write(lengths=lengths, bound=bound, **more)
        inputs = self._inputs
        args = (inputs["tokens"], self._caches(), inputs["lengths"], inputs["bound"])
        self.stats.calls_ahead += 1
        return self._dispatch("decode", args, rows, None, n)

    def _run_next(self) -> float:
        """Completes the decode call dispatched ahead: its rows whose request is still running
        advance. Returns its seconds."""
        call, self._next = self._next, None
        assert call is not None
        sampled, status, seconds = self._complete(call)
        self._count_decode(call.bucket)
        running = self._running(call.rows)
        self.stats.wasted_rows += len(call.rows) - len(running)
        self._advance(running, sampled, status)
        return seconds

    def _settle(self) -> None:
        """Waits for a call dispatched ahead and drops it (a failure, or closing): its tokens
        are not delivered, its slots can be released."""
        call, self._next, self._in_flight = self._next, None, None
        if call is not None:
            try:
                jax.block_until_ready(call.out)
            except Exception:  # noqa: BLE001 - the failure being handled is the one to see
                pass

    def _picker_programs(self) -> int:
        # A stand-in picker (bench/engine_host.py) compiles nothing.
        return _programs(self._greedy, 0) + _programs(self._sampler, 0)

    def _samples(self, rows: list[_Seq], counts: np.ndarray | None) -> bool:
        """Whether a row whose token the call uses samples rather than takes the argmax:
        a decoding row, or one whose piece ends its prompt's first prefill (a re-prefill's
        token and a piece short of the prompt's end are dropped; _run_prefill)."""
        hot = [s.slot for s in rows]
        if counts is not None:
            for b in np.flatnonzero(counts):
                seq = self._slots[b]
                if seq is not None and not seq.generated:
                    if seq.cached + int(counts[b]) == seq.prefill_target:
                        hot.append(int(b))
        return bool(hot) and bool((self._temperature[hot] >= GREEDY_BELOW).any())

    def _commit_ahead(self, rows: list[_Seq], counts: np.ndarray | None) -> None:
        """Commits, while the call runs, the granule each row's next decode step writes in:
        the decoding `rows`' (a row crosses into a new granule every granule's tokens: 64
        bindings' commits at 8B) and those whose prefill ends in the call (`counts`), so the
        next planning finds it backed. The new granules lie past the bound the call was
        given; a row whose request ends on this call's token by length gets none. Short of
        memory (after the ended requests' slots and the unused prefix blocks, as _commit
        takes them) it stops: the next planning preempts or waits, as before."""
        backed = self.cache.committed_tokens()
        # (row, tokens in its slot after the call, tokens generated after the call): a
        # prompt's last piece samples the first token, a re-prefill's samples none. A row of
        # a call dispatched ahead whose request has ended since gets none.
        # A decoding row of a prefill call advances one token; of a decode call, its steps.
        nexts = [
            (seq, seq.cached + now, len(seq.generated) + now)
            for seq in self._running(rows)
            for now in (1 if counts is not None else self._steps_of(seq),)
        ]
        if counts is not None:
            for b in np.flatnonzero(counts):
                seq = self._slots[b]
                assert seq is not None
                written = seq.cached + int(counts[b])
                if written == seq.prefill_target:
                    nexts.append((seq, written, max(1, len(seq.generated))))
        t0 = time.perf_counter()
        try:
            for seq, written, generated in nexts:
                if generated >= seq.max_new:
                    continue
                b, need = seq.slot, written + min(self.decode_steps, seq.max_new - generated)
                if need <= backed[b] or need > self.max_len:
                    continue
                try:
                    committed = self._commit(b, need)
                except ArenaExhausted:
                    return
                self.stats.commits_ahead += bool(committed)
        finally:
            self.stats.commit_ahead_seconds += time.perf_counter() - t0

    def _plan_ahead(self, counts: np.ndarray | None) -> None:
        """Commits, while the call runs, the memory of the next call's prefill as the next
        planning would: the prefilling slots' next pieces in admission order, then, while the
        chunk has room, queued requests admitted FIFO into free or ending slots (_admit). The
        next
        planning finds the memory there; it plans the call as before, decoding rows first
        (which may preempt these admissions: they are the youngest). Short of memory it
        stops, leaving the rest to the next planning."""
        self._ahead = {}
        room = self.prefill_chunk_tokens
        for seq in sorted(self._active(), key=lambda s: s.admitted):
            b = seq.slot
            assert b is not None
            written = seq.cached + (0 if counts is None else int(counts[b]))
            n = min(seq.prefill_target - written, room)
            if n <= 0:
                continue
            target, room = written + n, room - n
            try:
                if self._commit(b, target):
                    self.stats.pieces_ahead += 1
            except ArenaExhausted:
                return
            self._ahead[b] = (seq, target)
        if room:
            self._admit(room, np.zeros((self.max_slots,), np.int64))

    def _inflight_extends(self, seq: _Seq, hits: list) -> bool:
        """Whether the call in flight completes a block that would extend seq's prefix hits
        (same tokens up to the block's end): admitted now, seq would compute what it can map
        once the call's blocks are cached, so its admission waits for the next planning."""
        if self.prefix is None or self._in_flight is None:
            return False
        bt = self.cache.block_tokens
        end = (len(hits) + 1) * bt
        if end > seq.prefill_target - 1:  # no further block the lookup could give it
            return False
        counts, rows = self._in_flight
        decoding = {r.slot for r in rows}
        # The decode call dispatched after it (_complete dispatches it first) writes one more.
        ahead = set() if self._next is None else {r.slot for r in self._next.rows}
        want = None
        for r in self._active():
            b = r.slot
            # A decode call's rows advance at most decode_steps tokens (an over-count only
            # delays an admission), a prefill call's decoding rows one.
            k = self.decode_steps
            decoded = int(b in decoding) * (1 if counts is not None else k) + int(b in ahead) * k
            new = int(counts[b]) if counts is not None and counts[b] else decoded
            # Only the call that writes the block's last token completes it. One complete
            # before the call and still not cached (the store was full of blocks in use) is
            # cached, if ever, only when the store frees room: waiting for it could last
            # until r ends, so the head goes in without it.
            if not new or len(r.blocks) * bt >= end or not r.cached < end <= r.cached + new:
                continue
            if want is None:
                want = seq.tokens(0, end)
            if r.tokens(0, end) == want:
                return True
        return False

    def _decode_bound(self, rows: list[_Seq]) -> np.ndarray:
        """The write bound of this decode call: the cache's committed tokens, 0 (idle) for
        every row it does not advance (free, or prefilling)."""
        values = np.zeros((self.max_slots,), np.int32)
        decoding = [s.slot for s in rows]
        values[decoding] = self.cache.committed_tokens()[decoding]
        return values

    def _lengths(self) -> np.ndarray:
        return np.array([0 if s is None else s.cached for s in self._slots], np.int32)

    def _caches(self) -> list[tuple[jax.Array, jax.Array]]:
        return list(zip(self.cache.k, self.cache.v, strict=True))

    def _accept(self, caches: list[tuple[jax.Array, jax.Array]], verify: bool) -> None:
        # Verified (shapes, VMM aliasing) on a compiled step's first call: the slots never
        # change the arrays, so a compiled step cannot move its outputs later (and the ~8 us
        # per array of the check would be host time on every step).
        self.cache.accept([k for k, _ in caches], [v for _, v in caches], verify=verify)

    def _sampling_values(self) -> dict[str, np.ndarray]:
        return dict(
            temperature=self._temperature, top_k=self._top_k, top_p=self._top_p, seeds=self._seeds
        )

    def _sampling_args(self) -> tuple[jax.Array, ...]:
        # Written with a call's other inputs after an admission changed a row (_write_inputs).
        if self._sampling_dirty:
            self._inputs.write(**self._sampling_values())
            self._sampling_dirty = False
        inputs = self._inputs
        return inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["seeds"]

    # -- tokens and endings -------------------------------------------------------------

    def _emit(self, seq: _Seq, token: int) -> None:
        seq.generated.append(token)
        text = ""
        reason = None
        if token in seq.stop_ids:
            reason = FINISH_STOP
        elif seq.text is not None:
            text = seq.text.push(token)
            if seq.text.stopped:
                reason = FINISH_STOP
        if reason is None and len(seq.generated) >= seq.max_new:
            reason = FINISH_LENGTH
        if reason is not None and seq.text is not None:
            text += seq.text.finish()
        self._outbox.append((seq.request, Delta(token, text)))
        if reason is not None:
            self._finish(seq, reason, defer=True)

    def _finish(
        self, seq: _Seq, reason: str, error: BaseException | None = None, *, defer: bool = False
    ) -> None:
        """Ends seq's request. defer: its slot is released beside the next call (_retire),
        for a request that ended on a call's token, with its bytes valid."""
        if seq.slot is not None:
            self._slots[seq.slot] = None
            if defer:
                # Cached now, so that a request continuing it (a chat's next turn) can map it
                # from the next step on; only the unmaps wait for the next call. Retiring
                # first: under prefix_cache_bytes its blocks are evictable from here on.
                self._retiring[seq.slot] = seq
                self._cache_partial(seq)
            elif seq.slot in self._in_flight_slots():
                # A call dispatched ahead still writes it (a row refused by the attention op
                # on the call before): released after that call, with no block cached.
                self._retiring[seq.slot] = seq
            else:  # after an error the slot's bytes are not trusted: no block is cached
                self._release(seq, keep_partial=reason != FINISH_ERROR)
            self._trim_prefix()  # its blocks are evictable now, partial or not
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        completion = Completion(
            request_id=seq.request.id,
            prompt_tokens=len(seq.prompt),
            tokens=list(seq.generated),
            text=None if seq.text is None else seq.text.released,
            finish_reason=reason,
            error=error,
            preemptions=seq.preemptions,
        )
        self._outbox.append((seq.request, completion))

    def _deliver(self, robust: bool = False) -> int:
        """Hands the tokens and endings the engine produced since the last delivery to their
        requests, in order (their waiters and listeners run here); returns how many. A
        listener's error (a KeyboardInterrupt too) leaves the rest in the outbox and is
        raised: the step fails, and _fail delivers them `robust`ly, each one whatever the
        listeners raise (then raising the first interrupt among those, if any)."""
        outbox, self._outbox = self._outbox, []
        if not outbox:
            return 0
        t0 = time.perf_counter()
        try:
            return self._hand_over_outbox(outbox, robust)
        finally:
            self.stats.deliver_seconds += time.perf_counter() - t0

    def _hand_over_outbox(self, outbox: list[tuple[Request, Delta | Completion]],
                          robust: bool) -> int:  # fmt: skip
        interrupt: BaseException | None = None
        for i, (request, item) in enumerate(outbox):
            try:
                if isinstance(item, Completion):
                    request._finish(item)
                else:
                    request._push([item])
            except BaseException as error:
                if not robust:
                    self._outbox[:0] = outbox[i + 1 :]
                    raise
                if interrupt is None and not isinstance(error, Exception):
                    interrupt = error
        if self.on_delivered is not None:
            self.on_delivered()
        if interrupt is not None:
            raise interrupt
        return len(outbox)

    def _fail_row(self, seq: _Seq, code: int, where: str) -> None:
        cause = STATUS_CAUSES.get(code, f"unknown status {code}")
        error = StepStatusError(
            f"{where}: slot {seq.slot} of {seq.request.id} was refused by the attention op "
            f"(status {code}: {cause}); the other requests went on"
        )
        self._finish(seq, FINISH_ERROR, error)

    def _fail(self, error: BaseException) -> None:
        """A step raised: its donated cache may be gone, so the engine stops; every request
        it holds ends with the error (none is lost) and later submits are refused."""
        with self._lock:
            self._failure = error
            self._accepting = False
            queued = list(self._queue)
            self._queue.clear()
        self._settle()  # a call dispatched ahead: its slots are released below
        for seq in self._retiring.values():  # ended before the failure; their slots go
            try:
                self._release(seq, keep_partial=False)
            except Exception:  # noqa: BLE001 - the cache may be broken
                seq.slot = None
        self._retiring.clear()
        for seq in [*self._active(), *queued]:
            try:
                self._finish(seq, FINISH_ERROR, error)
            except Exception:  # noqa: BLE001 - the cache may be broken: end the request anyway
                seq.slot = None
                self._outbox.append(
                    (seq.request, Completion(seq.request.id, len(seq.prompt),
                                             list(seq.generated), None, FINISH_ERROR, error,
                                             seq.preemptions))
                )  # fmt: skip
        self._slots = [None] * self.max_slots
        self._deliver(robust=True)  # what was produced before the failure, then its endings

    # -- memory ---------------------------------------------------------------------------

    def check_memory(self) -> None:
        """Asserts the cache holds no more than its live tokens (a shared block's once) plus
        one granule per (binding, slot in use) plus the cached prefix blocks no slot maps plus
        the next call's prefill tokens committed beside the last call, and on VMM that the
        arena's physical bytes are what the cache counts."""
        cache = self.cache
        in_use = sum(s is not None for s in self._slots) + len(self._retiring)
        live = cache.live_unique_bytes
        ahead = (
            sum(
                max(0, tokens - int(cache.lengths[b]))
                for b, (seq, tokens) in self._ahead.items()
                if self._slots[b] is seq
            )
            * cache.token_bytes
            * cache.bindings
        )
        # decode_steps = k > 1: a slot holds the tokens of the call running and of the one
        # after it (committed beside it, before either's tokens are read), up to 2 (k - 1)
        # past the granule its live ones reach; a request that stopped early in the call
        # keeps them until its slot is released.
        steps = 2 * (self.decode_steps - 1) * cache.token_bytes * cache.bindings * in_use
        limit = live + cache.floor_bytes(in_use) + cache.cached_only_bytes + ahead + steps
        if cache.held_bytes > limit:
            raise AssertionError(
                f"KV memory: {cache.held_bytes} bytes held > live {live} + "
                f"{cache.floor_bytes(in_use)} (one granule per binding and slot in use) + "
                f"{cache.cached_only_bytes} (prefix blocks no slot maps) + {ahead} (the next "
                f"call's prefill tokens, committed beside the last call) + {steps} (decode_steps)"
            )
        if cache.is_vmm and cache.committed_bytes != cache.held_bytes:
            raise AssertionError(
                f"KV memory: the arena holds {cache.committed_bytes} bytes for slots that "
                f"hold {cache.held_bytes}"
            )

    # -- the background driver ------------------------------------------------------------

    def start(self) -> None:
        """Runs step() on a background thread while there is work (the server's driver).
        Refused after shutdown() or a failure: nothing would be accepted for it to run."""
        if self._thread is not None:
            return
        if not self.accepting:
            raise EngineError("start: the engine was shut down or failed")
        self._stop_thread = False
        self._thread = threading.Thread(target=self._drive, name="jax_kv-engine", daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        while True:
            with self._lock:
                work = self._work.wait_for(
                    lambda: self._stop_thread or bool(self._queue) or self._holds_slots(),
                    timeout=0.1,
                )
                if self._stop_thread and not self._queue and not self._holds_slots():
                    return
                if self._failure is not None:
                    return
                if not work:
                    continue  # idle: a step would do nothing, and count in the stats
            try:
                self._step(defer_delivery=True)
            except BaseException:  # noqa: BLE001 - _fail ended every request with it
                return

    def _holds_slots(self) -> bool:
        return (
            self._next is not None
            or bool(self._retiring)
            or any(s is not None for s in self._slots)
        )

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting requests; with drain, finishes the running and queued ones (after
        `timeout` seconds the rest are cancelled), else cancels them; then stops the driver."""
        with self._lock:
            self._accepting = False
            pending = list(self._queue)
        if not drain:
            for seq in [*pending, *self._active()]:
                seq.request.cancel()
        if self._thread is None:
            if not drain:
                if self._next is not None:
                    self.step()  # completes the call dispatched ahead
                self.step()  # ends the cancelled ones
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._stop_thread = True
            self._work.notify_all()
        while self._thread.is_alive():
            self._thread.join(0.05)
            if deadline is not None and time.monotonic() > deadline:
                for seq in [*list(self._queue), *self._active()]:
                    seq.request.cancel()
                deadline = None
        self._thread = None

    def close(self) -> None:
        """Shuts down without draining and frees the cache (also when the last step, which
        ends the cancelled requests, raises)."""
        try:
            self.shutdown(drain=False)
        except BaseException as error:
            try:
                self._free()
            except Exception as close_error:  # the step's error is the one to see
                error.add_note(f"and closing the engine's cache failed: {close_error}")
            raise
        self._free()

    def _free(self) -> None:
        try:
            self._deliver(robust=True)  # nothing is left there after a drained driver
            self._settle()
            if self._failure is None:
                self._retire()
            self._inputs.close()
        finally:
            self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "Engine",
    "EngineError",
    "EngineSnapshot",
    "EngineStats",
    "QueueFull",
    "RequestLimits",
    "StepRecord",
]
