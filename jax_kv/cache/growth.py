"""The three growth strategies of a KvCache, one per row of the table in `jax_kv.cache`.

`growth_for` picks one when the cache is built, from the arena's type and the layout; the
cache never branches on either to grow. A strategy creates the arrays (`start`), grows them
(`grow`) and tears down what it owns (`close`); the cache keeps the common protocol: lengths,
accept and advance, the capacity checks and counters, the committed bound.

| strategy | owns | start | grow |
|---|---|---|---|
| SeqMajorVmmGrowth | 2L regions at max_len, control | export at max_len | commit [old, new) |
| HeadMajorVmmGrowth | the same and a scratch region | export at a bucket | commit, re-stride |
| EagerGrowth | nothing: the arena tracks buffers | zeros at a bucket | grow_cache, new buffers |
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.cache.capacity import CapacityPlan, bucket_for, resolve_capacity
from jax_kv.cache.events import GrowthEvent, GrowthReason
from jax_kv.layout import Layout
from jax_kv.memory import ArenaError, ArenaExhausted, CommitReport, MeshArena, Region, VmmArena
from jax_kv.memory.mesh import REPLICATED, allocate
from jax_kv.ops import grow_cache
from jax_kv.parallel import cache_sharding, cache_spec

if TYPE_CHECKING:
    from jax_kv.cache.kv_cache import KvCache


def describe_need(n: int | np.ndarray) -> str:
    """`n` of an ensure_capacity call, short: one number, or the largest of a per-row need."""
    rows = np.asarray(n)
    if rows.ndim == 0 or (rows == rows.flat[0]).all():
        return str(int(rows.flat[0]))
    return f"[B] up to {int(rows.max())}"


def _refused(
    cache: KvCache, n: int | np.ndarray, requested: int, error: Exception
) -> ArenaExhausted:
    """The error of a growth the memory refused: the cache is left as it was."""
    return ArenaExhausted(
        f"ensure_capacity(n={describe_need(n)}): cache stays at capacity {cache.capacity}; "
        f"requested {requested} bytes, committed {cache.committed_bytes} bytes, available "
        f"{int(cache.arena.available_bytes())} bytes: {error}"
    )


def _set_arrays(cache: KvCache, arrays: list[jax.Array]) -> None:
    """Hands 2L arrays to the cache: K of every layer, then V of every layer."""
    cache.k, cache.v = arrays[: cache.num_layers], arrays[cache.num_layers :]


class GrowthStrategy(abc.ABC):
    """What differs between the growth paths. Each method takes the cache it serves; the
    strategy holds only the arena regions it owns (none without VMM)."""

    is_vmm: ClassVar[bool] = False
    # Whether each sequence gets only the tokens it needs (start and grow then take the need
    # per row, int64 [B]); otherwise every row is committed to the largest need, an int.
    per_row: ClassVar[bool] = False

    def __init__(self) -> None:
        self.regions: list[Region] = []  # one per binding, K of every layer then V
        # int32 [B] region behind `cache.committed` (None: a fresh device buffer per growth)
        self.control: Region | None = None

    @abc.abstractmethod
    def plan(self, cache: KvCache, max_len: int | None, model_max_len: int | None) -> CapacityPlan:
        """The cache's capacity plan (the VMM paths size their reservation here)."""

    @abc.abstractmethod
    def start(self, cache: KvCache, n: int | np.ndarray) -> None:
        """Creates the cache's arrays with room for `n` tokens (cache.capacity is 0): an int,
        or int64 [B] where `per_row`."""

    @abc.abstractmethod
    def grow(self, cache: KvCache, n: int | np.ndarray) -> GrowthEvent:
        """Grows to hold `n` tokens (an int, or int64 [B] where `per_row`), more than some row
        holds, all or nothing; `seconds` and `committed_bytes` of the event are filled in by
        the cache."""

    @abc.abstractmethod
    def committed_bytes(self, cache: KvCache) -> int:
        """Physical KV bytes the cache holds."""

    @abc.abstractmethod
    def close(self, cache: KvCache, arrays: list[jax.Array]) -> None:
        """Drops `arrays` (the cache's K and V, already detached) and what the strategy owns."""

    def array_capacity(self, cache: KvCache) -> int:
        """S of the arrays."""
        return cache.capacity

    def committed_tokens(self, cache: KvCache) -> np.ndarray:
        """int32 [B]: positions of each sequence backed by committed memory."""
        return np.full((cache.batch,), cache.capacity, np.int32)

    def check_outputs(self, arrays: list[jax.Array]) -> None:
        """Refuses a step's output caches that do not live where the strategy needs them."""
        return None

    def after_growth(self, cache: KvCache) -> None:
        """Work for the next growth, done after an event and outside its time."""
        return None


class EagerGrowth(GrowthStrategy):
    """Either layout on an EagerArena: growth builds bigger buffers with grow_cache, copying
    the live prefix (new pointers, new shape: the compiled step is invalidated)."""

    def plan(self, cache: KvCache, max_len: int | None, model_max_len: int | None) -> CapacityPlan:
        return resolve_capacity(max_len, model_max_len)

    def start(self, cache: KvCache, n: int) -> None:
        cap = bucket_for(n, cache.min_bucket, cache.max_len)
        shape = cache.layout.cache_shape(cache.batch, cap, cache.num_kv_heads, cache.head_dim)
        sharding = cache_sharding(cache.mesh, cache.layout)
        for _ in range(cache.num_layers):
            cache.k.append(cache.arena.zeros(shape, cache.dtype, sharding))
            cache.v.append(cache.arena.zeros(shape, cache.dtype, sharding))
        cache.capacity = cap

    def grow(self, cache: KvCache, n: int) -> GrowthEvent:
        arena, old = cache.arena, cache.capacity
        new = bucket_for(n, cache.min_bucket, cache.max_len)
        new_bytes = cache._needed_bytes(new)
        try:
            arena.reserve(new_bytes)  # old and new coexist until the copy is done
        except ArenaExhausted as e:
            raise _refused(cache, n, new_bytes, e) from e
        lengths = jnp.asarray(cache.lengths)
        grown: list[jax.Array] = []
        try:
            for a in (*cache.k, *cache.v):
                g = _grow(cache, a, lengths, new)
                arena.track(g)
                grown.append(g)
            for g in grown:
                g.block_until_ready()
        except Exception as e:
            for g in grown:
                arena.release(g)
            if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
                raise _refused(cache, n, new_bytes, e) from e
            raise
        for a in (*cache.k, *cache.v):
            arena.release(a)
        _set_arrays(cache, grown)
        cache.capacity = new
        return GrowthEvent(
            old_capacity=old,
            new_capacity=new,
            bytes_moved=cache.live_bytes,
            granules_committed=0,
            shape_changed=True,
            pointer_changed=True,
            keeps_compiled_step=False,
            reason=GrowthReason.EAGER,
        )

    def committed_bytes(self, cache: KvCache) -> int:
        return sum(a.nbytes for a in (*cache.k, *cache.v))

    def close(self, cache: KvCache, arrays: list[jax.Array]) -> None:
        for a in arrays:
            cache.arena.release(a)


def _grow(cache: KvCache, a: jax.Array, lengths: jax.Array, new: int) -> jax.Array:
    """grow_cache, per device under a mesh (each shard copies its own KV heads' live
    prefix)."""
    if cache.mesh is None:
        return grow_cache(a, lengths, new, layout=cache.layout)
    spec = cache_spec(cache.layout)
    per_shard = jax.shard_map(
        lambda a, n: grow_cache(a, n, new, layout=cache.layout),
        mesh=cache.mesh, in_specs=(spec, REPLICATED), out_specs=spec, check_vma=False,
    )  # fmt: skip
    return per_shard(a, lengths)


class _VmmGrowth(GrowthStrategy):
    """What both layouts share on a VmmArena: one region per binding reserved at max_len, the
    control region behind `cache.committed`, all-or-nothing commits, in-place outputs."""

    is_vmm = True
    reason: ClassVar[GrowthReason]
    reshapes: ClassVar[bool]  # whether growth changes the arrays' shape

    def _event(
        self, old: int, new: int, report: CommitReport, *, bytes_moved: int = 0, copy_calls: int = 0
    ) -> GrowthEvent:
        """A growth's event. The arrays never leave their regions, so the compiled step is
        kept exactly when their shape stays."""
        return GrowthEvent(
            old_capacity=old,
            new_capacity=new,
            bytes_moved=bytes_moved,
            granules_committed=report.granules,
            shape_changed=self.reshapes,
            pointer_changed=False,
            keeps_compiled_step=not self.reshapes,
            reason=self.reason,
            map_calls=report.map_calls,
            set_access_calls=report.set_access_calls,
            copy_calls=copy_calls,
        )

    def plan(self, cache: KvCache, max_len: int | None, model_max_len: int | None) -> CapacityPlan:
        bindings, arena = 2 * cache.num_layers, cache.arena
        return resolve_capacity(
            max_len,
            model_max_len,
            bytes_per_token=bindings * cache.batch * cache.token_bytes,
            device_free=arena.available_bytes(),
            arena_free=max(0, arena.free_va_bytes - (bindings + 1) * arena.granule),
        )

    @staticmethod
    def _slot_tokens(cache: KvCache) -> int:
        """Tokens each sequence's slot is reserved for: max_len, always set on VMM."""
        assert cache.max_len is not None
        return cache.max_len

    def _allocate(self, cache: KvCache) -> None:
        arena, batch = cache.arena, cache.batch
        slot_bytes = self._slot_tokens(cache) * cache.token_bytes
        spec = cache_spec(cache.layout)
        for _ in range(2 * cache.num_layers):
            self.regions.append(allocate(arena, batch * slot_bytes, spec))
        self.control = allocate(arena, batch * 4, REPLICATED)  # every device's bound
        self.control.commit(batch * 4)
        # A view the host rewrites in place at growth: its address (which the recorded CUDA
        # graph holds) never changes, so a kept step is replayed.
        cache.committed = self.control.export((batch,), jnp.int32)

    def _export(self, cache: KvCache) -> None:
        shape = cache.shape
        _set_arrays(cache, [r.export(shape, cache.dtype) for r in self.regions])

    def _commit(
        self, cache: KvCache, ranges: list[tuple[Region, int, int]], n: int
    ) -> CommitReport:
        try:
            return cache.arena.commit(ranges)
        except ArenaExhausted as e:
            raise _refused(cache, n, cache._needed_bytes(n), e) from e

    def committed_bytes(self, cache: KvCache) -> int:
        return sum(r.committed_bytes for r in self.regions)

    def check_outputs(self, arrays: list[jax.Array]) -> None:
        """A moved pointer means the cache was not donated (or XLA copied it) and the arena no
        longer backs it."""
        for i, (a, r) in enumerate(zip(arrays, self.regions, strict=True)):
            if not r.holds(a):
                # A step that failed on the device hands back arrays that carry its error, at
                # other addresses: that error is the cause the caller must see, raised here.
                a.block_until_ready()
                raise ArenaError(
                    f"accept: output cache {i} is not the arena's memory (it moved): donate "
                    f"the cache arrays to the step so XLA updates them in place"
                )

    def after_growth(self, cache: KvCache) -> None:
        cache.arena.refill_pool()

    def _owned(self) -> list[Region | None]:
        """Every region held, in the order `close` frees them."""
        return [*self.regions, self.control]

    def close(self, cache: KvCache, arrays: list[jax.Array]) -> None:
        for a in arrays:
            if not a.is_deleted():
                a.block_until_ready()
                a.delete()
        arrays.clear()
        regions = [r for r in self._owned() if r is not None]
        cache.arena.wait_unviewed(regions)
        for r in regions:
            r.free()
        self.regions, self.control = [], None


class SeqMajorVmmGrowth(_VmmGrowth):
    """Seq-major on a VmmArena: each sequence's slot is reserved at max_len and the arrays are
    exported once at that shape; growth commits granules in steps of `commit_ahead` tokens
    (0 bytes moved, same pointers, same shape: the compiled step is kept). Each sequence's
    slot is committed to its own need: a batch of one long and 63 short prompts holds one long
    slot, not 64 (`cache.capacity` is the longest row's)."""

    reason = GrowthReason.SEQ_VMM
    reshapes = False
    per_row = True

    def __init__(self) -> None:
        super().__init__()
        self.rows = np.zeros((0,), np.int64)  # committed tokens per sequence

    def start(self, cache: KvCache, n: np.ndarray) -> None:
        self.rows = np.zeros((cache.batch,), np.int64)
        self._allocate(cache)
        self._export(cache)
        self.grow(cache, n)

    def array_capacity(self, cache: KvCache) -> int:
        return self._slot_tokens(cache)

    def committed_tokens(self, cache: KvCache) -> np.ndarray:
        return self.rows.astype(np.int32)

    def grow(self, cache: KvCache, n: np.ndarray) -> GrowthEvent:
        tok, step, old = cache.token_bytes, cache.commit_step, self.rows
        max_len = self._slot_tokens(cache)
        new = np.maximum(old, np.minimum(max_len, -(-np.asarray(n, np.int64) // step) * step))
        slot = max_len * tok  # one sequence's slot, reserved at max_len
        # Only the delta [old, new) of each slot that grows: earlier granules are mapped.
        grows = np.flatnonzero(new > old).tolist()
        ranges = [
            (r, b * slot + int(old[b]) * tok, b * slot + int(new[b]) * tok)
            for r in self.regions
            for b in grows
        ]
        report = self._commit(cache, ranges, n)
        self.rows = new
        before, cache.capacity = cache.capacity, int(new.max())
        return self._event(before, cache.capacity, report)


class HeadMajorVmmGrowth(_VmmGrowth):
    """Head-major on a VmmArena: the per-head stride is the capacity, so growth commits the
    next bucket and re-strides every (b, h) stripe in place through a device scratch region
    (live bytes moved, same pointers, new shape: the compiled step is invalidated)."""

    reason = GrowthReason.HEAD_VMM
    reshapes = True  # the per-head stride is the capacity

    def __init__(self) -> None:
        super().__init__()
        self._scratch: Region | None = None  # the re-stride's bounce buffer, grown on demand

    def start(self, cache: KvCache, n: int) -> None:
        self._allocate(cache)
        self.grow(cache, n)  # no arrays and no live tokens yet: commits and exports only

    def grow(self, cache: KvCache, n: int) -> GrowthEvent:
        arena, old = cache.arena, cache.capacity
        B, H = cache.batch, cache.num_kv_heads
        new = bucket_for(n, cache.min_bucket, cache.max_len)
        row = cache.token_bytes // H  # one token of one head: D * itemsize
        ranges = [(r, B * H * old * row, B * H * new * row) for r in self.regions]
        live_per_binding = int(cache.lengths.astype(np.int64).sum()) * H * row
        if live_per_binding:
            if self._scratch is None or self._scratch.reserved_bytes < live_per_binding:
                if self._scratch is not None:
                    # Forgotten before the allocation: were it refused, a later growth would
                    # commit into the freed (perhaps reused) address space.
                    self._scratch, old_scratch = None, self._scratch
                    old_scratch.free()
                self._scratch = arena.allocate(live_per_binding)
            ranges.append((self._scratch, 0, live_per_binding))
        report = self._commit(cache, ranges, n)  # all or nothing: a refusal changes nothing
        old_arrays = [*cache.k, *cache.v]
        for a in old_arrays:
            a.block_until_ready()
        cache.k, cache.v = [], []
        for a in old_arrays:
            a.delete()
        del old_arrays
        arena.wait_unviewed(self.regions)
        copies = 0
        if live_per_binding:
            copies = self._restride(cache, old, new, row)
            self._scratch.decommit(0)  # deferred: the next growth may reuse the granules
        cache.capacity = new
        self._export(cache)
        moved = live_per_binding * len(self.regions)
        return self._event(old, new, report, bytes_moved=moved, copy_calls=copies)

    def _restride(self, cache: KvCache, old: int, new: int, row: int) -> int:
        """Moves every (b, h) stripe's live prefix from stride old*row to new*row, in place.

        Why a bounce through a device scratch region rather than per-stripe copies from the
        last stripe backwards: stripe i's destination [i*new, i*new + L) overlaps stripe 2i's
        source when new = 2*old, so one strided copy cannot do it in place, and per-stripe
        copies cost B*Hkv driver calls per binding (16384 per event for a Llama-3-8B cache at
        B=32). The bounce is two strided cuMemcpy2DAsync per run of equal lengths per binding,
        entirely on the device (2x the live bytes of traffic, no host copy).
        """
        arena, H, scratch = cache.arena, cache.num_kv_heads, self._scratch
        assert scratch is not None
        copies = 0
        runs = [r for r in _runs_of_equal_length(cache.lengths) if r[2] > 0]
        for region in self.regions:
            packed = 0
            for b0, count, length in runs:  # region -> scratch, packed
                width = length * row
                arena.copy2d(
                    scratch.ptr + packed,
                    width,
                    region.ptr + b0 * H * old * row,
                    old * row,
                    width,
                    count * H,
                )
                packed += width * count * H
                copies += 1
            packed = 0
            for b0, count, length in runs:  # scratch -> region, at the new stride
                width = length * row
                arena.copy2d(
                    region.ptr + b0 * H * new * row,
                    new * row,
                    scratch.ptr + packed,
                    width,
                    width,
                    count * H,
                )
                packed += width * count * H
                copies += 1
            # The scratch is reused by the next binding: finish before overwriting it.
            arena.finish_copies()
        return copies

    def _owned(self) -> list[Region | None]:
        return [*self.regions, self._scratch, self.control]

    def close(self, cache: KvCache, arrays: list[jax.Array]) -> None:
        super().close(cache, arrays)
        self._scratch = None


def _runs_of_equal_length(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(first b, count, L) runs of consecutive sequences with equal length."""
    runs: list[tuple[int, int, int]] = []
    for b, length in enumerate(lengths.tolist()):
        if runs and runs[-1][2] == length:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, length)
        else:
            runs.append((b, 1, length))
    return runs


def growth_for(arena: object, layout: Layout) -> GrowthStrategy:
    """The strategy for a cache on `arena` with `layout`, chosen once at construction."""
    if not isinstance(arena, VmmArena | MeshArena):
        return EagerGrowth()
    if layout == Layout.SEQ_MAJOR:
        return SeqMajorVmmGrowth()
    if isinstance(arena, MeshArena):
        raise ValueError(
            "layout: a head-major cache on a MeshArena is not built (its growth re-strides "
            "through one device's scratch); use SEQ_MAJOR under a mesh, or an EagerArena"
        )
    return HeadMajorVmmGrowth()


__all__ = [
    "EagerGrowth",
    "GrowthStrategy",
    "HeadMajorVmmGrowth",
    "SeqMajorVmmGrowth",
    "growth_for",
]
