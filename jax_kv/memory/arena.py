"""VmmArena: one large virtual reservation, physical memory committed on demand, regions
exported to JAX zero-copy through DLPack.

Rules the arena enforces (DESIGN.md, Memory):
- regions start on a granule boundary (>= 256-byte aligned views);
- never two live views of the same bytes: `export` refuses an overlap;
- never unmap memory a live view covers: decommit is deferred and skips covered granules,
  `Region.free` and `close` refuse while a view is live;
- accounting is exact: every driver call is counted, commit time is measured;
- a stray read never faults: every granule of a region that holds no physical memory of its
  own is mapped read-only to one shared zero granule (the seeds' dummy page), so a full-array
  read of a view reserved at max_len returns zeros past the committed prefix; commit replaces
  that mapping by a real granule, zeroed, and decommit puts the zero mapping back. A write
  through a read-only mapping is an illegal address: the kernels bound their writes by the
  committed capacity (gqa_decode's `committed`), never by the array's shape;
- it fails closed: a granule whose unmap fails is quarantined (never pooled, never mapped
  again), a commit's rollback never returns a still-mapped handle to the pool, and the
  must-be-zero fault counters (`ref_underflows`, `unaccounted_committed_bytes`,
  `unbacked_bytes`) are in `stats()`.

A live view is counted from `export` until XLA drops the last array of its donation chain:
the DLPack owner is a `_ViewToken` whose finalizer decrements the count, and nanobind
releases it from the capsule deleter.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.memory._drivers import ArenaError, ArenaExhausted, CudaDriver, HostDriver

GiB = 1 << 30
LADDER_FLOOR = 64 * GiB
MIN_ALIGN = 256
# The CUDA driver refuses mappings past about 2^19 per process (bench/experiments/
# zero_map_cost.py: the 524,097th on an H100, driver 580.159.04). While the process's arenas
# hold at most ZERO_SINGLES_LIMIT mappings, a region maps zeros granule by granule; past that,
# a new region is aligned to blocks of ZERO_BLOCK_GRANULES (Z) granules and maps each block as
# buddy pieces from its start, [0], [1], [2-3], [4-7], .., [Z/2 .. Z-1]: log2(Z) + 1 mappings
# (6 at Z = 32). A row grows from its start, so committing its granules 0..k-1 splits at most
# one piece and releasing them forms the same pieces again. Z = 32 makes a 32-granule row (the
# 8B shape at 32k tokens in 2 MiB granules) one block; its zeroed handles (2 .. 16 granules)
# take 60 MiB at 2 MiB granules.
ZERO_SINGLES_LIMIT = 262_144
ZERO_BLOCK_GRANULES = 32

_DLPACK_DTYPES = ("bfloat16", "float16", "float32", "int32", "uint32", "uint8")


@dataclasses.dataclass(frozen=True)
class ArenaStats:
    """Exact accounting of one arena. Bytes are physical unless named reserved."""

    granule: int
    reserved_bytes: int  # virtual address space held (costs no physical memory)
    committed_bytes: int  # mapped and accessible
    pooled_bytes: int  # physical handles created ahead of need, not mapped
    pending_decommit_bytes: int  # mapped, queued for deferred unmap
    live_views: int
    regions: int
    zero_mapped_bytes: int  # address space mapped read-only to the shared zero granule
    zero_mappings: int  # driver mappings doing it (one per granule, or per buddy piece)
    zero_handles: int  # the zero granule and the zero pieces (in handles_live)
    zero_map_calls: int  # zero mappings made (at allocate, commit splits a piece, decommit)
    zero_access_calls: int  # read-only set-access calls over zero-mapped runs
    zero_map_seconds: float  # time in those maps and their read-only set-access calls
    zero_fill_calls: int  # device memsets of newly committed granules (one per run)
    quarantined_bytes: int  # granules whose unmap failed: held, never handed out again
    handles_live: int  # physical handles created and not yet released (0 after close)
    ref_underflows: int  # a granule or handle count would have gone below 0 (must be 0)
    unaccounted_committed_bytes: int  # committed granules no live region accounts for (0)
    unbacked_bytes: int  # region granules neither committed nor zero-mapped (must be 0)
    mapped_bytes: int  # every mapping of a committed handle (shared handles once per mapping)
    shared_mappings: int  # mappings of a handle beyond its first (VmmArena.share)
    held_bytes: int  # handles kept by hold(), mapped or not (in committed_bytes once)
    hold_calls: int  # granules held, cumulative
    share_calls: int  # granules mapped by share, cumulative
    cow_copies: int  # shared granules given a handle of their own (copy_on_write), cumulative
    map_calls: int
    unmap_calls: int
    set_access_calls: int
    create_calls: int
    release_calls: int
    copy_calls: int
    commit_seconds: float  # inside commit: handle creation on shortfall, map, set-access
    share_seconds: float  # inside share: the second mappings of committed granules
    decommit_seconds: float  # unmapping: the device synchronize, unmaps, zero granule mapped back
    create_seconds: float  # all cuMemCreate time, commit shortfalls and pool refills
    views_exported: int
    views_released: int
    reservation_ladder: tuple[int, ...]  # sizes tried, in order; the last one succeeded

    @property
    def faults(self) -> dict[str, int]:
        """The counters that must stay zero: anything else is an accounting bug."""
        return {name: getattr(self, name) for name in FAULT_COUNTERS}


FAULT_COUNTERS = ("ref_underflows", "unaccounted_committed_bytes", "unbacked_bytes")

# Every arena constructed in this process and not yet garbage-collected: the test suite checks
# the fault counters of each after every test.
_LIVE_ARENAS: weakref.WeakSet = weakref.WeakSet()


def _process_mappings(kind: str) -> int:
    """The driver mappings this process's open arenas of one driver kind hold (committed and
    zero): the CUDA driver's limit on mappings is per process, not per arena."""
    return sum(
        len(a._state.mapped) + len(a._state.zero_maps)
        for a in list(_LIVE_ARENAS)
        if not a._state.closed and a._state.driver.kind == kind
    )


def live_arenas() -> list[VmmArena]:
    """The VmmArenas of this process that are still referenced (closed ones included)."""
    return list(_LIVE_ARENAS)


@dataclasses.dataclass(frozen=True)
class CommitReport:
    """What one commit did."""

    granules: int
    map_calls: int
    set_access_calls: int
    seconds: float
    mapped: tuple[int, ...] = ()  # granules it mapped (arena numbering), for undo_commit


def reservation_ladder(total_memory: int, granule: int) -> list[int]:
    """16x device memory, halving down to (and ending at) 64 GiB, granule multiples."""
    sizes, size = [], 16 * total_memory
    while size > LADDER_FLOOR:
        sizes.append(size // granule * granule)
        size //= 2
    sizes.append(LADDER_FLOOR)
    return sizes


class _State:
    """Everything teardown needs, kept apart from the arena so a finalizer can hold it."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.base = 0
        self.reserved = 0
        self.mapped: dict[int, Any] = {}  # granule index -> physical handle (committed)
        # id(handle) -> how many granule indices map it: a handle shared by several mappings
        # (VmmArena.share) returns to the pool only when its last mapping goes.
        self.refs: dict[int, int] = {}
        # id(handle) -> [handle, holds]: handles kept by VmmArena.hold, each hold one of its
        # refs, so a held handle outlives its mappings (a prefix store without addresses).
        self.holds: dict[int, list[Any]] = {}
        self.scratch = 0  # one granule of address space for copy_on_write's copies (lazy)
        # Scratch addresses whose unmap was refused (the mapping may still be there): close()
        # unmaps them again before it releases the handles and frees the addresses.
        self.stuck_scratch: list[int] = []
        self.zero_handle: Any = None  # the shared zeroed granule, mapped read-only
        # Zeroed handles of 2, 4, .. zero_block / 2 granules (granules -> handle), mapped
        # read-only in the regions allocated past ZERO_SINGLES_LIMIT: an aligned block that
        # reads zeros is its buddy pieces [0], [1], [2-3], .. [Z/2 .. Z-1] (the single ones
        # zero_handle), a piece split by a commit a few aligned smaller ones (all the handles
        # made with the first such region).
        self.zero_pieces: dict[int, Any] = {}
        self.zero_block = ZERO_BLOCK_GRANULES
        # Zero mappings: start index -> granules (1: zero_handle; more: the zero piece of that
        # size), and every granule index they cover -> the start of its mapping.
        self.zero_maps: dict[int, int] = {}
        self.zero_mapped: dict[int, int] = {}
        self.quarantined: dict[int, Any] = {}  # granule index -> handle whose unmap failed
        self.unreleased: list[Any] = []  # unmapped handles whose release failed
        self.pool: list[Any] = []
        self.counts = dict.fromkeys(
            (
                "map",
                "unmap",
                "set_access",
                "create",
                "release",
                "copy",
                "exported",
                "released",
                "zero_map",
                "zero_access",
                "zero_fill",
                "ref_underflows",
                "share",
                "cow_copies",
                "holds",
            ),
            0,
        )
        self.closed = False

    def close(self) -> list[str]:
        if self.closed:
            return []
        self.closed = True
        errors: list[str] = []

        def attempt(fn: Any, *args: Any) -> bool:
            try:
                fn(*args)
                return True
            except Exception as e:  # noqa: BLE001 - teardown collects every failure
                errors.append(str(e))
                return False

        d, g = self.driver, self.driver.granule
        attempt(d.make_current)
        attempt(d.synchronize)
        for index in sorted({*self.mapped, *self.quarantined}):
            self.counts["unmap"] += attempt(d.unmap, self.base + index * g, g)
        for start, granules in sorted(self.zero_maps.items()):
            self.counts["unmap"] += attempt(d.unmap, self.base + start * g, granules * g)
        for va in self.stuck_scratch:
            self.counts["unmap"] += attempt(d.unmap, va, g)
        handles = [*self.mapped.values(), *self.pool, *self.quarantined.values(), *self.unreleased]
        handles += [h for h, _ in self.holds.values()]
        handles += [h for h in (self.zero_handle, *self.zero_pieces.values()) if h is not None]
        # A shared handle appears once per mapping: each is released once.
        for handle in {id(h): h for h in handles}.values():
            self.counts["release"] += attempt(d.release, handle)
        self.mapped.clear()
        self.refs.clear()
        self.holds.clear()
        self.pool.clear()
        self.zero_mapped.clear()
        self.zero_maps.clear()
        self.quarantined.clear()
        self.unreleased.clear()
        self.zero_pieces.clear()
        self.zero_handle = None
        if self.reserved:
            attempt(d.free_va, self.base, self.reserved)
        for va in filter(None, [*self.stuck_scratch, self.scratch]):
            attempt(d.free_va, va, g)
        self.scratch = 0
        self.stuck_scratch.clear()
        attempt(d.close)
        return errors


class _ViewToken:
    """The DLPack owner of one exported view; its death ends the view."""

    __slots__ = ("arena", "key", "__weakref__")

    def __init__(self, arena: VmmArena, key: int) -> None:
        self.arena = arena  # keeps the arena (and its mappings) alive while XLA holds the view
        self.key = key

    def __del__(self) -> None:
        self.arena._release_view(self.key)


class Region:
    """A granule-aligned range of the reservation: [ptr, ptr + reserved_bytes)."""

    def __init__(self, arena: VmmArena, offset: int, reserved_bytes: int, nbytes: int) -> None:
        self.arena = arena
        self.offset = offset
        self.reserved_bytes = reserved_bytes
        self.nbytes = nbytes
        self.freed = False
        self.closing = False  # being freed: decommitted granules are not zero-mapped again
        self.zero_blocks = False  # its aligned blocks of granules map zeros as buddy pieces
        self.granules = 0  # committed granules, kept by the arena

    @property
    def ptr(self) -> int:
        return self.arena._state.base + self.offset

    @property
    def committed_bytes(self) -> int:
        return self.granules * self.arena.granule

    def commit(self, nbytes: int) -> CommitReport:
        """Commits the prefix [0, nbytes) (rounded up to granules)."""
        return self.commit_ranges([(0, nbytes)])

    def commit_ranges(self, ranges: Iterable[tuple[int, int]]) -> CommitReport:
        """Commits the granules covering each [start, end) byte range of the region."""
        absolute = []
        for start, end in ranges:
            if not 0 <= start <= end <= self.reserved_bytes:
                raise ArenaError(
                    f"commit: range [{start}, {end}) outside the region's "
                    f"{self.reserved_bytes} reserved bytes"
                )
            absolute.append((self.offset + start, self.offset + end))
        return self.arena._commit(absolute)

    def decommit(self, keep_bytes: int) -> int:
        """Queues the granules past [0, keep_bytes) for deferred unmap; returns bytes queued."""
        g = self.arena.granule
        first = (self.offset + _round_up(keep_bytes, g)) // g
        last = (self.offset + self.reserved_bytes) // g
        return self.arena._queue_decommit(range(first, last))

    def export(self, shape: Sequence[int], dtype: Any, offset: int = 0) -> jax.Array:
        """A jax.Array viewing [offset, offset + nbytes) of this region, zero-copy."""
        return self.arena._export(self, tuple(int(s) for s in shape), dtype, offset)

    def write(self, offset: int, data: bytes) -> None:
        """Writes host bytes at `offset` (committed memory; no step may be in flight)."""
        self.arena.write(self.ptr + offset, data)

    def holds(self, array: jax.Array) -> bool:
        """Whether `array` is this region's memory (not a copy XLA made)."""
        return array.unsafe_buffer_pointer() == self.ptr

    def write_spans(self, array: jax.Array, spans: Iterable[tuple[int, int]]) -> int:
        """Writes the byte spans [lo, lo + n) of `array` (laid out as this region) into the
        region (the host driver's write-back); returns the bytes written."""
        data = np.asarray(array).reshape(-1).view(np.uint8)
        written = 0
        for lo, n in spans:
            self.write(lo, data[lo : lo + n].tobytes())
            written += n
        return written

    def free(self) -> None:
        self.arena._free(self)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class VmmArena:
    """CUDA virtual-memory arena (or its host stand-in), see the module docstring.

    Args:
        device: the jax device whose memory is used (default: the first CUDA device).
        reserve_bytes: virtual reservation; None tries `reservation_ladder`. Default from
            RuntimeConfig (JAX_KV_RESERVE_BYTES).
        pool_bytes: physical memory kept created ahead of need (JAX_KV_POOL_BYTES).
        limit_bytes: cap on this arena's physical memory (committed + pooled); None: the
            device's.
        driver: a HostDriver for CPU use/tests; default CudaDriver(device).
        zero_singles_limit: driver mappings this process's arenas may hold (committed and
            zero, all arenas together) before a new region maps zeros in blocks (default
            ZERO_SINGLES_LIMIT, half of what the CUDA driver allows a process).
        zero_block_granules: Z, granules of a zero block, a power of two (default
            ZERO_BLOCK_GRANULES). A block that reads zeros is log2(Z) + 1 mappings, its buddy
            pieces [0], [1], [2-3], .. [Z/2 .. Z-1]; their zeroed handles (2, 4, .. Z/2
            granules: 60 MiB of device memory at Z = 32 and 2 MiB granules) are made with the
            first region of blocks. 1: granule by granule always.
    """

    def __init__(
        self,
        device: Any = None,
        *,
        reserve_bytes: int | None = None,
        pool_bytes: int | None = None,
        limit_bytes: int | None = None,
        driver: Any = None,
        zero_singles_limit: int = ZERO_SINGLES_LIMIT,
        zero_block_granules: int = ZERO_BLOCK_GRANULES,
    ) -> None:
        from jax_kv.config import runtime_config

        if zero_block_granules < 1 or zero_block_granules & (zero_block_granules - 1):
            raise ValueError(
                f"zero_block_granules: expected a power of two, got {zero_block_granules}"
            )

        config = runtime_config()
        if driver is None:
            if device is None:
                device = jax.devices("cuda")[0]
            driver = CudaDriver(device)
        elif device is None:
            device = jax.devices("cpu")[0] if driver.kind == "cpu" else jax.devices("cuda")[0]
        self.device = device
        self._state = _State(driver)
        self._lock = threading.RLock()
        self.granule: int = driver.granule
        self.pool_target = config.pool_bytes if pool_bytes is None else int(pool_bytes)
        self.limit_bytes = limit_bytes
        self.zero_singles_limit = int(zero_singles_limit)
        self._state.zero_block = int(zero_block_granules)
        self._free_va: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced
        self._regions: dict[int, Region] = {}
        self._starts: list[int] = []  # sorted region offsets
        self._pending: set[int] = set()
        self._views: dict[int, tuple[int, int]] = {}
        self._next_key = 0
        self._counts = self._state.counts
        self._commit_seconds = 0.0
        self._share_seconds = 0.0
        self._decommit_seconds = 0.0
        self._create_seconds = 0.0
        self._zero_map_seconds = 0.0
        _LIVE_ARENAS.add(self)
        reserve = config.reserve_bytes if reserve_bytes is None else reserve_bytes
        ladder = (
            [_round_up(int(reserve), self.granule)]
            if reserve is not None
            else reservation_ladder(driver.total_memory, self.granule)
        )
        tried: list[int] = []
        last_error: Exception | None = None
        for size in ladder:
            tried.append(size)
            try:
                self._state.base = driver.reserve(size)
                self._state.reserved = size
                break
            except ArenaError as e:
                last_error = e
        self._ladder = tuple(tried)
        self._finalizer = weakref.finalize(self, _State.close, self._state)
        if not self._state.reserved:
            self._finalizer()
            raise ArenaExhausted(
                f"VmmArena: every reservation size failed ({', '.join(map(str, tried))} "
                f"bytes); last error: {last_error}"
            )
        try:
            self._make_zero_granule()
        except BaseException:
            self._finalizer()
            raise
        # Granule 0 of the reservation keeps the zero granule's own (read-only) mapping.
        self._free_va = [(self.granule, self._state.reserved - self.granule)]

    def _make_zero_granule(self) -> None:
        """Creates the shared zero granule: mapped read-write at granule 0 to be zeroed on
        the device, then made read-only there; regions map the same handle read-only."""
        s, d, g = self._state, self._state.driver, self.granule
        d.make_current()
        s.zero_handle = d.create()
        self._counts["create"] += 1
        d.map(s.base, s.zero_handle)
        self._counts["zero_map"] += 1
        s.zero_maps[0] = 1
        s.zero_mapped[0] = 0
        d.set_access(s.base, g)
        d.zero(s.base, g)
        d.finish_copies()
        d.set_access(s.base, g, read_only=True)
        self._counts["zero_access"] += 2

    # -- context manager / teardown ---------------------------------------------------------

    def __enter__(self) -> VmmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Unmaps and releases everything, frees the reservation, releases the context.

        Refused while a view is live (XLA may still read it). Safe to call twice, and after
        earlier errors: every step is attempted, failures are collected and raised together.
        """
        with self._lock:
            if self._state.closed:
                return
            if self._views:
                raise ArenaError(
                    f"close: {len(self._views)} exported view(s) still live; drop the jax "
                    f"arrays (the whole donation chain) first"
                )
            self._pending.clear()
            errors = self._finalizer() or []
            # The teardown unmapped every region: they hold nothing now (a later free() is a
            # no-op) and the accounting says so.
            for region in self._regions.values():
                region.freed = True
            self._regions.clear()
            self._starts.clear()
        if errors:
            raise ArenaError("VmmArena teardown: " + "; ".join(errors))

    # -- accounting --------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self._state.reserved

    @property
    def committed_bytes(self) -> int:
        """Physical bytes mapped or held: a handle mapped at several addresses, or held,
        counts once."""
        return len(self._state.refs) * self.granule

    def physical_bytes(
        self, regions: Iterable[Region], held: AbstractSet[int] = frozenset()
    ) -> int:
        """Physical bytes mapped in `regions` or held (`held`: the ids of handles the caller
        holds, from hold(), and no others): a handle mapped at several of their addresses (a
        shared granule), or mapped and held, counts once.

        Counted from whichever side is smaller: the granules of the arena's other regions
        (an engine's cache is nearly all of its arena: its own count less the handles only
        those others map), or every mapping, in NumPy. Read after every engine step by the
        benchmarks: a Python set over 100k mappings had taken 70 ms."""
        g = self.granule
        regions = list(regions)
        with self._lock:
            mapped, refs, holds = self._state.mapped, self._state.refs, self._state.holds
            given = {r.offset for r in regions}
            others = [r for off, r in self._regions.items() if off not in given]
            if sum(r.reserved_bytes // g for r in others) <= len(mapped):
                seen: dict[int, int] = {}  # handle -> its mappings inside the other regions
                for r in others:
                    first = r.offset // g
                    for i in range(first, first + r.reserved_bytes // g):
                        if i in mapped:
                            h = id(mapped[i])
                            seen[h] = seen.get(h, 0) + 1

                # A handle whose every reference is another region's mapping or a hold not
                # in `held` is not counted; every other one is mapped in `regions` or held.
                def elsewhere(h: int) -> bool:
                    return refs[h] == seen.get(h, 0) + (holds[h][1] if h in holds else 0)

                candidates = seen.keys() - held
                if len(held) != len(holds):  # equal: `held` is every hold (a subset by contract)
                    candidates |= holds.keys() - held
                return (len(refs) - sum(map(elsewhere, candidates))) * g
            if len(held) != len(holds):
                held = held & holds.keys()  # a MeshArena passes every device's
            if not regions:
                return len(held) * g
            index = np.fromiter(mapped.keys(), np.int64, len(mapped))
            handle = np.fromiter((id(h) for h in mapped.values()), np.int64, len(mapped))
        spans = sorted((r.offset // g, (r.offset + r.reserved_bytes) // g) for r in regions)
        lo, hi = (np.array(x, np.int64) for x in zip(*spans, strict=True))
        at = np.searchsorted(lo, index, side="right") - 1  # the span starting at or before
        inside = (at >= 0) & (index < hi[np.maximum(at, 0)])
        ids = np.unique(handle[inside])
        if held:
            extra = np.fromiter(held, np.int64, len(held))
            ids = np.union1d(ids, extra)
        return len(ids) * g

    @property
    def live_views(self) -> int:
        return len(self._views)

    @property
    def capacity_bytes(self) -> int:
        """The most physical memory this arena could ever hold: the device's (the host
        driver's limit), or limit_bytes. Address space past it can never be backed."""
        driver = self._state.driver.capacity_bytes
        return driver if self.limit_bytes is None else min(driver, self.limit_bytes)

    @property
    def free_va_bytes(self) -> int:
        return sum(size for _, size in self._free_va)

    def available_bytes(self) -> int:
        """Physical bytes a commit could still get: pool + min(device free, arena limit)."""
        pooled = len(self._state.pool) * self.granule
        device = self._state.driver.free_memory() + pooled
        if self.limit_bytes is None:
            return device
        return max(0, min(device, self.limit_bytes - self.committed_bytes))

    def stats(self) -> ArenaStats:
        c = self._counts
        return ArenaStats(
            granule=self.granule,
            reserved_bytes=self._state.reserved,
            committed_bytes=self.committed_bytes,
            pooled_bytes=len(self._state.pool) * self.granule,
            pending_decommit_bytes=len(self._pending) * self.granule,
            live_views=len(self._views),
            regions=len(self._regions),
            zero_mapped_bytes=len(self._state.zero_mapped) * self.granule,
            zero_mappings=len(self._state.zero_maps),
            zero_handles=(self._state.zero_handle is not None) + len(self._state.zero_pieces),
            zero_map_calls=c["zero_map"],
            zero_access_calls=c["zero_access"],
            zero_map_seconds=self._zero_map_seconds,
            zero_fill_calls=c["zero_fill"],
            quarantined_bytes=(len(self._state.quarantined) + len(self._state.unreleased))
            * self.granule,
            handles_live=c["create"] - c["release"],
            ref_underflows=c["ref_underflows"],
            mapped_bytes=len(self._state.mapped) * self.granule,
            shared_mappings=len(self._state.mapped) - self._mapped_handles(),
            held_bytes=len(self._state.holds) * self.granule,
            hold_calls=c["holds"],
            share_calls=c["share"],
            cow_copies=c["cow_copies"],
            unaccounted_committed_bytes=abs(
                sum(r.granules for r in self._regions.values()) - len(self._state.mapped)
            )
            * self.granule,
            unbacked_bytes=self._unbacked_granules() * self.granule,
            map_calls=c["map"],
            unmap_calls=c["unmap"],
            set_access_calls=c["set_access"],
            create_calls=c["create"],
            release_calls=c["release"],
            copy_calls=c["copy"],
            commit_seconds=self._commit_seconds,
            share_seconds=self._share_seconds,
            decommit_seconds=self._decommit_seconds,
            create_seconds=self._create_seconds,
            views_exported=c["exported"],
            views_released=c["released"],
            reservation_ladder=self._ladder,
        )

    # -- regions ------------------------------------------------------------------------------

    def allocate(self, nbytes: int, align: int = MIN_ALIGN) -> Region:
        """Reserves a region of `nbytes` (no physical memory until commit)."""
        if align < MIN_ALIGN or align & (align - 1) or align > self.granule:
            raise ValueError(
                f"align: expected a power of two in [{MIN_ALIGN}, granule={self.granule}], "
                f"got {align}"
            )
        if nbytes <= 0:
            raise ValueError(f"nbytes: expected > 0, got {nbytes}")
        size = _round_up(int(nbytes), self.granule)
        g, s = self.granule, self._state
        with self._lock:
            self._check_open()
            # Past the singles' limit a region is aligned to a zero block, and maps its pieces.
            blocks = (
                s.zero_block > 1
                and _process_mappings(s.driver.kind) + size // g > self.zero_singles_limit
            )
            if blocks:
                self._make_zero_pieces()  # before the region: a refusal leaves nothing behind
            for attempt in range(2):
                off = self._take_va(size, s.zero_block * g if blocks else g)
                if off is None and blocks:
                    off = self._take_va(size, g)  # unaligned: its first pieces are split
                if off is not None:
                    region = Region(self, off, size, int(nbytes))
                    region.zero_blocks = blocks
                    self._regions[off] = region
                    bisect.insort(self._starts, off)
                    indices = range(off // g, (off + size) // g)
                    try:
                        self._map_zero(indices)
                    except ArenaError as error:
                        held = len(s.zero_maps) + len(s.mapped)
                        self._unmap_zero(indices, strict=False)
                        del self._regions[off]
                        self._starts.remove(off)
                        self._give_back_va(off, size)
                        if isinstance(error, ArenaExhausted):
                            raise ArenaExhausted(
                                f"{error}, allocating {size} bytes: a region maps the "
                                f"read-only zero granule over each of its {len(indices)} "
                                f"granules, and this arena held {held} mappings when the "
                                f"driver refused one. The CUDA driver refuses mappings "
                                f"past about 524,000 per process (measured on an H100, "
                                f"driver 580.159.04, at 16 bytes of device memory each), "
                                f"so reserve less: fewer slots or a shorter max_len"
                            ) from error
                        raise
                    return region
                if attempt == 0 and self._pending:
                    self.flush()
            raise ArenaExhausted(
                f"allocate: requested {size} bytes of address space, reserved "
                f"{self._state.reserved}, free {self.free_va_bytes} (largest free range "
                f"{max((s for _, s in self._free_va), default=0)})"
            )

    def _take_va(self, size: int, align: int) -> int | None:
        """The offset of `size` bytes of free address space starting at a multiple of
        `align` (first fit), taken from the free list; None if no range has room."""
        for i, (off, free) in enumerate(self._free_va):
            start = _round_up(off, align)
            if start - off + size <= free:
                end = off + free
                left = [(off, start - off)] if start > off else []
                right = [(start + size, end - start - size)] if start + size < end else []
                self._free_va[i : i + 1] = left + right
                return start
        return None

    def _give_back_va(self, off: int, size: int) -> None:
        """Returns [off, off + size) to the free list, coalesced with its neighbours."""
        self._free_va.append((off, size))
        self._free_va.sort()
        merged: list[tuple[int, int]] = []
        for start, n in self._free_va:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free_va = merged

    def _free(self, region: Region) -> None:
        with self._lock:
            if region.freed:
                return
            lo, hi = region.offset, region.offset + region.reserved_bytes
            if any(s < hi and lo < e for s, e in self._views.values()):
                raise ArenaError("free: a live view covers this region; drop its jax arrays first")
            g = self.granule
            indices = range(lo // g, hi // g)
            region.closing = True
            self._queue_decommit(indices)
            self.flush()
            self._unmap_zero(indices, strict=False)
            region.freed = True
            del self._regions[region.offset]
            self._starts.remove(region.offset)
            if any(i in self._state.quarantined for i in indices):
                return  # its address space keeps the quarantined granules: never reused
            self._give_back_va(lo, region.reserved_bytes)

    def _check_open(self) -> None:
        if self._state.closed:
            raise ArenaError("the arena is closed")

    # -- the zero granule ------------------------------------------------------------------

    def _map_zero(self, indices: Iterable[int], *, reform: bool = True) -> None:
        """Maps zeros read-only at each granule index not backed (one set-access per run).
        In a region of zero blocks the mappings are buddy pieces (_zero_pieces_for): where
        `reform` and a granule's canonical piece would read zeros throughout, the piece is
        mapped whole, the smaller pieces inside it unmapped first; otherwise the granules are
        mapped as aligned pieces of it. If one of those smaller pieces cannot be unmapped,
        that piece's granules are mapped as aligned pieces instead and the error is raised
        once the rest is mapped; if the piece's own map is refused, the granules that read
        zeros before this call are mapped back as aligned pieces before the error goes up
        (the others stay unbacked, for the caller's rollback, as without blocks)."""
        s, d = self._state, self._state.driver
        todo = sorted(i for i in indices if i not in s.zero_mapped and i not in s.mapped)
        if not todo:
            return
        t0 = time.perf_counter()
        d.make_current()
        mapped: list[int] = []  # granules of the mappings made here (no access until set)
        error: ArenaError | None = None
        try:
            for start, granules in self._zero_pieces_for(todo, reform):
                inside = [j for j in range(start, start + granules) if j in s.zero_mapped]
                if inside:
                    try:
                        self._unmap_zero(inside)  # a piece's smaller pieces make way for it
                    except ArenaError as e:
                        error = error or e
                        self._map_zero_split(range(start, start + granules), mapped)
                        continue
                try:
                    self._map_zero_at(start, granules)
                except ArenaError:
                    self._map_zero_split(inside, mapped)
                    raise
                mapped.extend(range(start, start + granules))
        finally:
            # A new mapping has no access until it is set: set it on what was mapped, also
            # when a later map failed (those granules must read zeros, not fault).
            try:
                self._allow_zero_reads(mapped)
            finally:
                self._zero_map_seconds += time.perf_counter() - t0
        if error is not None:
            raise error

    def _map_zero_split(self, indices: Iterable[int], mapped: list[int]) -> None:
        """_map_zero's fallback where a piece could not be formed: those of `indices` that
        read nothing are mapped as aligned pieces, each tried once (a refused one stays
        unbacked: stats().unbacked_bytes); their granules are appended to `mapped`."""
        s = self._state
        back = sorted(
            j
            for j in indices
            if j not in s.zero_mapped and j not in s.mapped and j not in s.quarantined
        )
        for first, n in self._zero_pieces_for(back, reform=False):
            try:
                self._map_zero_at(first, n)
            except ArenaError:
                continue
            mapped.extend(range(first, first + n))

    def _allow_zero_reads(self, mapped: list[int]) -> None:
        """Read-only access on the zero mappings just made (their granules, `mapped`), one
        call per run. Where the driver refuses, those mappings are taken back (unbacked, for
        the caller's rollback) rather than left to fault a read; then it raises."""
        s, d, g = self._state, self._state.driver, self.granule
        error: ArenaError | None = None
        for first, count in _runs(sorted(set(mapped))):
            try:
                d.set_access(s.base + first * g, count * g, read_only=True)
                self._counts["zero_access"] += 1
                continue
            except ArenaError as e:
                error = error or e
            for start in sorted({s.zero_mapped[j] for j in range(first, first + count)}):
                granules = s.zero_maps[start]
                try:
                    d.unmap(s.base + start * g, granules * g)
                except ArenaError:
                    continue  # still mapped without access: nothing more to do here
                self._counts["unmap"] += 1
                del s.zero_maps[start]
                for j in range(start, start + granules):
                    del s.zero_mapped[j]
        if error is not None:
            raise error

    def _zero_pieces_for(self, todo: list[int], reform: bool) -> list[tuple[int, int]]:
        """(start, granules) of the zero mappings that cover `todo` (sorted): one granule
        each outside regions of zero blocks. Inside them, a granule's canonical piece
        (_canonical_piece) whole where `reform` and each of its granules, in the same region,
        is in `todo` or already reads zeros; else the run's part inside that piece as aligned
        pieces, each n granules at a multiple of n from the block's start (the largest that
        fits): [4-7] less granule 4 is [5], [6-7], so committing 5 next splits nothing."""
        s, z = self._state, self._state.zero_block
        pieces: list[tuple[int, int]] = []
        wanted = set(todo)
        for first, count in self._runs_by_region(todo):
            region = self._region_of(first)
            if z == 1 or region is None or not region.zero_blocks:
                pieces += [(i, 1) for i in range(first, first + count)]
                continue
            i, end = first, first + count
            while i < end:
                start, granules = _canonical_piece(i, z)
                last = start + granules - 1
                if (
                    reform
                    and self._region_of(start) is region
                    and self._region_of(last) is region
                    and all(j in wanted or j in s.zero_mapped for j in range(start, last + 1))
                ):
                    if not pieces or pieces[-1][0] != start:  # two runs of one piece
                        pieces.append((start, granules))
                    i = last + 1
                    continue
                stop = min(end, last + 1)  # the run's part inside this canonical piece
                while i < stop:
                    n = 1 << ((stop - i).bit_length() - 1)
                    if i % z:
                        n = min(n, i % z & -(i % z))  # aligned: at a multiple of its size
                    pieces.append((i, n))
                    i += n
        return pieces

    def _runs_by_region(self, indices: list[int]) -> list[tuple[int, int]]:
        """_runs(indices) (sorted), each split where one region ends: a zero piece never
        spans two regions."""
        g = self.granule
        out: list[tuple[int, int]] = []
        for first, count in _runs(indices):
            i, end = first, first + count
            while i < end:
                region = self._region_of(i)
                last = i + 1 if region is None else (region.offset + region.reserved_bytes) // g
                stop = min(end, last)
                out.append((i, stop - i))
                i = stop
        return out

    def _map_zero_at(self, start: int, granules: int) -> None:
        """One zero mapping of `granules` at granule `start`: the zero granule, or the zero
        piece of that size (allocate made them). Its set-access is the caller's."""
        s, d, g = self._state, self._state.driver, self.granule
        if granules == 1:
            d.map(s.base + start * g, s.zero_handle)
        else:
            d.map(s.base + start * g, s.zero_pieces[granules], granules)
        self._counts["zero_map"] += 1
        s.zero_maps[start] = granules
        for j in range(start, start + granules):
            s.zero_mapped[j] = start

    def _make_zero_pieces(self) -> None:
        """Creates the zero pieces a region of blocks maps (2, 4, .. zero_block / 2 granules:
        a block's largest buddy piece is half of it; none at 2), all at once when the first
        such region is allocated: made later, under memory pressure, a commit or a release
        could find no memory for one."""
        s = self._state
        size = 2
        while size < s.zero_block:
            if size not in s.zero_pieces:
                self._make_zero_piece(size)
            size *= 2

    def _make_zero_piece(self, granules: int) -> None:
        """Creates a zero piece of `granules`: zeroed through a read-write mapping at an
        address range of its own, unmapped there after (regions map it read-only)."""
        s, d, g = self._state, self._state.driver, self.granule
        n = granules * g
        handle = d.create(granules)
        self._counts["create"] += 1
        try:
            va = d.reserve(n)
        except BaseException:
            d.release(handle)
            raise
        mapped = False
        try:
            d.map(va, handle, granules)
            mapped = True
            d.set_access(va, n)
            d.zero(va, n)
            d.finish_copies()
            d.unmap(va, n)
            mapped = False
        except BaseException:
            if mapped:
                try:
                    d.unmap(va, n)
                    mapped = False
                except ArenaError:
                    s.unreleased.append(handle)  # still mapped there: never freed under it
            if not mapped:
                d.release(handle)
                d.free_va(va, n)
            raise
        s.zero_pieces[granules] = handle  # recorded first: close() releases it whatever follows
        d.free_va(va, n)

    def _unmap_zero(self, indices: Iterable[int], *, strict: bool = True) -> None:
        """Unmaps the zero mappings at these granule indices. A piece is unmapped whole
        (cuMemUnmap cannot unmap part of a mapping): its other granules get zeros back, as
        the aligned pieces they split into ([4-7] less 4: [5], [6-7])."""
        s, d, g = self._state, self._state.driver, self.granule
        gone = {i for i in indices if i in s.zero_mapped}
        rest: list[int] = []
        error: ArenaError | None = None
        for start in sorted({s.zero_mapped[i] for i in gone}):
            granules = s.zero_maps[start]
            try:
                d.unmap(s.base + start * g, granules * g)
            except ArenaError as e:
                error = error or e
                if strict:
                    break  # the rest of the pieces unmapped so far still go back below
                continue
            self._counts["unmap"] += 1
            del s.zero_maps[start]
            for j in range(start, start + granules):
                del s.zero_mapped[j]
                if j not in gone:
                    rest.append(j)
        if rest:
            try:
                self._map_zero(rest, reform=False)
            except ArenaError as e:
                error = error or e  # the granules not mapped back count as unbacked (stats)
        if error is not None and strict:
            raise error

    def _unbacked_granules(self) -> int:
        s, g = self._state, self.granule
        total = 0
        for region in self._regions.values():
            if region.closing:
                continue
            for index in range(region.offset // g, (region.offset + region.reserved_bytes) // g):
                if index not in s.mapped and index not in s.zero_mapped:
                    total += index not in s.quarantined
        return total

    def _mapped_handles(self) -> int:
        """Handles with at least one mapping (a held one may have none)."""
        s = self._state
        return len(s.refs) - sum(1 for h, n in s.holds.values() if s.refs[id(h)] == n)

    def _drop_ref(self, handle: Any) -> bool:
        """One mapping of `handle` goes; True if it was the last."""
        refs = self._state.refs
        n = refs.get(id(handle), 0) - 1
        if n < 0:
            self._counts["ref_underflows"] += 1
            return False
        if n:
            refs[id(handle)] = n
            return False
        del refs[id(handle)]
        return True

    def _count_granule(self, index: int, delta: int) -> None:
        region = self._region_of(index)
        if region is None:
            return
        if region.granules + delta < 0:
            self._counts["ref_underflows"] += 1
            return
        region.granules += delta

    # -- commit / decommit -------------------------------------------------------------------

    def _region_of(self, index: int) -> Region | None:
        offset = index * self.granule
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return None
        region = self._regions[self._starts[i]]
        return region if offset < region.offset + region.reserved_bytes else None

    def prefill(self, nbytes: int) -> int:
        """Creates physical handles until the pool holds `nbytes`; returns handles created."""
        with self._lock:
            self._check_open()
            want = _round_up(int(nbytes), self.granule) // self.granule
            created = 0
            while len(self._state.pool) < want:
                self._state.pool.append(self._create())
                created += 1
            return created

    def refill_pool(self) -> int:
        """Tops the pool up to pool_bytes (JAX_KV_POOL_BYTES), as far as memory allows."""
        try:
            return self.prefill(self.pool_target)
        except ArenaExhausted:
            return 0

    def _create(self, in_flight: int = 0) -> Any:
        if self.limit_bytes is not None:
            s = self._state
            quarantined = len({id(h) for h in s.quarantined.values()} - s.refs.keys())
            held = len(s.refs) + len(s.pool) + quarantined + len(s.unreleased) + in_flight
            physical = (held + 1) * self.granule
            if physical > self.limit_bytes:
                raise ArenaExhausted(f"arena limit of {self.limit_bytes} bytes reached")
        t0 = time.perf_counter()
        handle = self._state.driver.create()
        self._create_seconds += time.perf_counter() - t0
        self._counts["create"] += 1
        return handle

    def _granule_span(self, what: str, region: Region, offset: int, nbytes: int) -> range:
        g = self.granule
        if offset % g or nbytes % g or offset < 0 or nbytes < 0:
            raise ValueError(
                f"{what}: offset and nbytes must be multiples of the granule ({g} bytes), got "
                f"offset={offset}, nbytes={nbytes}"
            )
        if offset + nbytes > region.reserved_bytes:
            raise ValueError(
                f"{what}: [{offset}, {offset + nbytes}) passes the region's "
                f"{region.reserved_bytes} reserved bytes"
            )
        if region.freed:
            raise ArenaError(f"{what}: the region was freed")
        first = (region.offset + offset) // g
        return range(first, first + nbytes // g)

    def _require_committed(self, span: range, what: str) -> None:
        """Refuses unless every granule of `span` is mapped and not queued for decommit;
        `what` names the granule ({} is its place in the span)."""
        for i in span:
            if i not in self._state.mapped or i in self._pending:
                raise ArenaError(what.format(i - span.start) + " is not committed")

    def share(
        self,
        src: Region,
        src_offset: int,
        dst: Region,
        dst_offset: int,
        nbytes: int,
        *,
        read_only: bool = True,
    ) -> CommitReport:
        """Maps the physical granules behind [src_offset, src_offset + nbytes) of `src` at
        [dst_offset, ...) of `dst` too: both ranges then hold the same bytes, and the memory
        is counted once (committed_bytes) however many mappings it has (mapped_bytes). Offsets
        and nbytes are granule multiples; every source granule must be committed, every
        destination granule uncommitted. Read-only by default (a prefix others read); write to
        a shared granule only after copy_on_write. All or nothing: a refusal changes nothing.
        Decommitting either range later unmaps only that mapping; a handle returns to the pool
        when its last mapping goes."""
        with self._lock:
            self._check_open()
            src_span = self._granule_span("share", src, src_offset, nbytes)
            self._require_committed(
                src_span, f"share: source granule {{}} of the range (src_offset={src_offset})"
            )
            handles = [self._state.mapped[i] for i in src_span]
            return self._map_handles("share", handles, dst, dst_offset, read_only)

    def hold(self, region: Region, offset: int, nbytes: int) -> tuple[Any, ...]:
        """Keeps the physical granules behind [offset, offset + nbytes) of `region` (every one
        committed) past their mapping there: each handle gains a reference, so a later unmap
        of the range leaves its memory and bytes to the holder. No driver call. The holder maps
        them with map_held and gives them back with release_held; committed_bytes counts a
        held handle once, mapped or not (held_bytes counts the held ones)."""
        with self._lock:
            self._check_open()
            span = self._granule_span("hold", region, offset, nbytes)
            self._require_committed(span, f"hold: granule {{}} of the range (offset={offset})")
            s = self._state
            handles = tuple(s.mapped[i] for i in span)
            for h in handles:
                s.refs[id(h)] += 1
                s.holds.setdefault(id(h), [h, 0])[1] += 1
            self._counts["holds"] += len(handles)
            return handles

    def release_held(self, handles: Iterable[Any]) -> int:
        """Gives back one hold of each handle (from hold); returns the bytes that left the
        arena's committed memory (handles nothing else held or mapped: pooled or released).
        No driver call unless the pool is full (then cuMemRelease)."""
        with self._lock:
            s, freed = self._state, 0
            if s.closed:
                return 0  # close() released every handle
            for h in handles:
                entry = s.holds.get(id(h))
                if entry is None:
                    self._counts["ref_underflows"] += 1
                    continue
                entry[1] -= 1
                if not entry[1]:
                    del s.holds[id(h)]
                if self._drop_ref(h):
                    self._retire_handle(h)
                    freed += self.granule
            return freed

    def map_held(
        self, handles: Sequence[Any], dst: Region, dst_offset: int, *, read_only: bool = True
    ) -> CommitReport:
        """share() from held handles (hold) instead of a mapped source range: maps them, in
        order, at [dst_offset, ...) of `dst` (uncommitted). All or nothing."""
        with self._lock:
            self._check_open()
            for k, h in enumerate(handles):
                if id(h) not in self._state.holds:
                    raise ArenaError(f"map_held: handle {k} is not held by this arena")
            return self._map_handles("map_held", list(handles), dst, dst_offset, read_only)

    def _map_handles(
        self, what: str, handles: list[Any], dst: Region, dst_offset: int, read_only: bool
    ) -> CommitReport:
        """Maps committed `handles` at dst's granules from dst_offset (the lock held)."""
        g = self.granule
        dst_span = self._granule_span(what, dst, dst_offset, len(handles) * g)
        s, d = self._state, self._state.driver
        for i in dst_span:
            if i in s.mapped or i in s.quarantined:
                raise ArenaError(
                    f"{what}: destination granule {i - dst_span.start} of the range is "
                    f"already committed (dst_offset={dst_offset}); decommit it first"
                )
        t0 = time.perf_counter()
        done: list[int] = []
        unzeroed: list[int] = []
        try:
            d.make_current()
            self._unzero(list(dst_span), unzeroed)
            for handle, j in zip(handles, dst_span, strict=True):
                self._map_at(j, handle)
                done.append(j)
            runs = _runs(list(dst_span))
            for first, count in runs:
                d.set_access(s.base + first * g, count * g, read_only=read_only)
                self._counts["set_access"] += 1
        except ArenaError:
            for j, handle in zip(done, handles, strict=False):
                try:
                    d.unmap(s.base + j * g, g)
                    self._counts["unmap"] += 1
                except ArenaError:
                    # Still mapped: never zero-mapped over, unmapped by close(), and its
                    # handle never pooled (_retire_handle) while this mapping may remain.
                    s.quarantined[j] = handle
            try:
                self._map_zero(i for i in unzeroed if i not in s.quarantined)
            except ArenaError:
                pass  # counted by stats().unbacked_bytes
            raise
        for handle, j in zip(handles, dst_span, strict=True):
            s.mapped[j] = handle
            s.refs[id(handle)] += 1
            self._count_granule(j, +1)
        self._counts["share"] += len(dst_span)
        seconds = time.perf_counter() - t0
        self._share_seconds += seconds
        return CommitReport(len(dst_span), len(dst_span), len(runs), seconds)

    def _unzero(self, indices: list[int], unzeroed: list[int]) -> None:
        """The zero mappings at `indices`, about to be mapped, go in one pass (a zero piece
        is unmapped once, its other granules mapped back once); the indices that read zeros
        are appended to `unzeroed`, for the caller's rollback."""
        s = self._state
        zeroed = [i for i in indices if i in s.zero_mapped]
        # Every granule of the mappings touched: a piece's other granules are mapped back as
        # smaller pieces, and where that fails the caller's rollback maps them too.
        touched = [
            j for start in {s.zero_mapped[i] for i in zeroed}
            for j in range(start, start + s.zero_maps[start])
        ]  # fmt: skip
        try:
            self._unmap_zero(zeroed)
        finally:
            unzeroed.extend(j for j in touched if j not in s.zero_mapped)

    def _map_at(self, index: int, handle: Any) -> None:
        """Maps `handle` at granule `index` (its zero mapping already gone: _unzero)."""
        s, d, g = self._state, self._state.driver, self.granule
        d.map(s.base + index * g, handle)
        self._counts["map"] += 1

    def _restore_mapping(self, index: int, handle: Any, fresh: Any) -> None:
        """A copy-on-write step failed at `index`: map the shared `handle` there again
        (read-only, as shared granules are) and pool `fresh` once nothing maps it. If the
        unmap fails, `fresh` may still be mapped there: the granule is quarantined with it."""
        s, d, g = self._state, self._state.driver, self.granule
        va = s.base + index * g
        try:
            d.unmap(va, g)
        except ArenaError:
            s.quarantined[index] = fresh
            del s.mapped[index]
            self._count_granule(index, -1)
            self._drop_ref(handle)
            return
        s.pool.append(fresh)
        try:
            d.map(va, handle)
            d.set_access(va, g, read_only=True)
        except ArenaError:
            del s.mapped[index]  # nothing is mapped there now: stats().unbacked_bytes counts it
            self._count_granule(index, -1)
            self._drop_ref(handle)

    def copy_on_write(
        self, region: Region, offset: int, nbytes: int, *, synchronize: bool = True
    ) -> int:
        """Gives every shared granule of [offset, offset + nbytes) of `region` a handle of its
        own holding a copy of its bytes, writable; granules not shared are left as they are
        (made writable). Returns the granules copied (counted in stats().cow_copies).
        `synchronize=False` skips the device synchronize, for a caller that knows no queued
        or running work reads the range (decommit_now's contract)."""
        g = self.granule
        with self._lock:
            self._check_open()
            span = self._granule_span("copy_on_write", region, offset, nbytes)
            s, d = self._state, self._state.driver
            self._require_committed(span, "copy_on_write: granule {} of the range")
            shared = [i for i in span if s.refs[id(s.mapped[i])] > 1]
            copied = []
            if shared:
                d.make_current()
                if synchronize:  # in-flight work may still read through the shared mapping
                    d.synchronize()
            for i in shared:
                old = s.mapped[i]
                if s.refs[id(old)] <= 1:
                    continue  # its other mappings in this range were copied already
                handle = s.pool.pop() if s.pool else self._create()
                va = s.base + i * g
                self._copy_into(handle, va)
                try:
                    d.unmap(va, g)
                    self._counts["unmap"] += 1
                    d.map(va, handle)
                    self._counts["map"] += 1
                    d.set_access(va, g)
                    self._counts["set_access"] += 1
                except ArenaError:
                    self._restore_mapping(i, old, handle)
                    raise
                s.mapped[i] = handle
                s.refs[id(handle)] = 1
                self._drop_ref(old)
                self._counts["cow_copies"] += 1
                copied.append(i)
            for first, count in _runs([i for i in span if i not in copied]):
                d.set_access(s.base + first * g, count * g)
                self._counts["set_access"] += 1
            return len(copied)

    def _copy_into(self, handle: Any, src_va: int) -> None:
        """Copies the granule mapped at src_va into `handle` (unmapped), through one granule
        of address space kept for it: the granule's handle may have no other mapping (a held
        one), and src_va keeps mapping it until the copy is done. On a refusal `handle` goes
        back to the pool (or, mapped still, is never handed out again)."""
        s, d, g = self._state, self._state.driver, self.granule
        if not s.scratch:
            s.scratch = d.reserve(g)
        try:
            d.map(s.scratch, handle)
            self._counts["map"] += 1
        except ArenaError:
            s.pool.append(handle)
            raise
        failed: ArenaError | None = None
        try:
            d.set_access(s.scratch, g)
            self._counts["set_access"] += 1
            d.copy2d(s.scratch, g, src_va, g, g, 1)
            self._counts["copy"] += 1
            d.finish_copies()
        except ArenaError as e:
            failed = e
        try:
            d.unmap(s.scratch, g)
            self._counts["unmap"] += 1
        except ArenaError:
            s.unreleased.append(handle)  # may still be mapped there: never handed out
            s.stuck_scratch.append(s.scratch)  # nor that address used again: close() tries
            s.scratch = 0
            raise
        if failed is not None:
            s.pool.append(handle)
            raise failed

    def commit(self, ranges: Iterable[tuple[Region, int, int]]) -> CommitReport:
        """Commits [start, end) of each region, all or nothing: on a refusal every granule
        mapped by this call is unmapped again and the error states the bytes requested,
        committed and available."""
        absolute = []
        for region, start, end in ranges:
            if not 0 <= start <= end <= region.reserved_bytes:
                raise ArenaError(
                    f"commit: range [{start}, {end}) outside the region's "
                    f"{region.reserved_bytes} reserved bytes"
                )
            absolute.append((region.offset + start, region.offset + end))
        return self._commit(absolute)

    def wait_unviewed(self, regions: Iterable[Region], timeout: float = 5.0) -> None:
        """Waits until no live view covers any of `regions` (XLA frees buffers lazily)."""
        import gc

        spans = [(r.offset, r.offset + r.reserved_bytes) for r in regions]

        def covered() -> int:
            with self._lock:
                views = list(self._views.values())
            return sum(1 for s, e in views for lo, hi in spans if s < hi and lo < e)

        deadline = time.monotonic() + timeout
        while covered():
            gc.collect()
            if time.monotonic() > deadline:
                raise ArenaError(
                    f"{covered()} view(s) still live after {timeout} s: a jax array of the "
                    f"cache (or of its donation chain) is still referenced"
                )
            time.sleep(0.001)

    def _commit(self, ranges: Sequence[tuple[int, int]]) -> CommitReport:
        g = self.granule
        with self._lock:
            self._check_open()
            needed: set[int] = set()
            for lo, hi in ranges:
                if hi > lo:
                    needed.update(range(lo // g, -(-hi // g)))
            self._pending -= needed  # still mapped: a queued decommit is simply cancelled
            missing = sorted(i for i in needed if i not in self._state.mapped)
            if not missing:
                return CommitReport(0, 0, 0, 0.0)
            stuck = [i for i in missing if i in self._state.quarantined]
            if stuck:
                raise ArenaError(
                    f"commit refused: granule {stuck[0]} is quarantined (an earlier unmap of it "
                    f"failed); its address range cannot be committed again"
                )
            t0 = time.perf_counter()
            shortfall = len(missing) - len(self._state.pool)
            if shortfall > 0 and self._pending:
                self.flush()  # recycle deferred decommits before asking the driver
            handles: list[Any] = []
            mapped_now: list[tuple[int, Any]] = []
            unzeroed: list[int] = []
            s, d = self._state, self._state.driver
            try:
                d.make_current()
                while len(s.pool) + len(handles) < len(missing):
                    handles.append(self._create(in_flight=len(handles)))
                handles = [s.pool.pop() for _ in range(len(missing) - len(handles))] + handles
                self._unzero(missing, unzeroed)
                for index, handle in zip(missing, handles, strict=True):
                    self._map_at(index, handle)
                    mapped_now.append((index, handle))
                runs = _runs(missing)
                for first, count in runs:
                    d.set_access(s.base + first * g, count * g)
                    self._counts["set_access"] += 1
                # A recycled handle holds another cache's bytes: the committed tail reads as
                # zeros, like the zero-mapped tail past it (and no data leaks between caches).
                for first, count in runs:
                    d.zero(s.base + first * g, count * g)
                    self._counts["zero_fill"] += 1
                d.finish_copies()
            except ArenaError as e:
                in_pool = {id(h) for _, h in mapped_now}
                returned = [h for h in handles if id(h) not in in_pool]
                for index, handle in mapped_now:
                    try:
                        d.unmap(s.base + index * g, g)
                        self._counts["unmap"] += 1
                        returned.append(handle)
                    except ArenaError:
                        s.quarantined[index] = handle  # still mapped: never pooled
                s.pool.extend(returned)
                try:
                    self._map_zero(i for i in unzeroed if i not in s.quarantined)
                except ArenaError:
                    pass  # counted by stats().unbacked_bytes
                requested = len(missing) * g
                raise type(e)(
                    f"commit refused: requested {requested} bytes ({len(missing)} granules of "
                    f"{g}), committed {self.committed_bytes} bytes, available "
                    f"{self.available_bytes()} bytes ({e})"
                ) from e
            for index, handle in zip(missing, handles, strict=True):
                s.mapped[index] = handle
                s.refs[id(handle)] = 1
                self._count_granule(index, +1)
            seconds = time.perf_counter() - t0
            self._commit_seconds += seconds
            return CommitReport(len(missing), len(missing), len(runs), seconds, tuple(missing))

    def undo_commit(self, report: CommitReport) -> int:
        """Unmaps the granules `report`'s commit mapped (those still mapped), as decommit_now
        does; returns the bytes unmapped. A commit's byte ranges need not be granule-aligned
        (a token range), and the granule holding their start may have been committed before:
        undoing by range would unmap live data, undoing by report cannot."""
        with self._lock:
            self._check_open()
            todo = sorted(i for i in report.mapped if i in self._state.mapped)
            if todo:
                self._unmap_granules(todo)
            return len(todo) * self.granule

    def _queue_decommit(self, indices: Iterable[int]) -> int:
        with self._lock:
            queued = [i for i in indices if i in self._state.mapped]
            self._pending.update(queued)
            return len(queued) * self.granule

    def flush(self) -> int:
        """Performs deferred decommits not covered by a live view; returns bytes unmapped.

        Synchronizes the device first: in-flight work may still read the memory.
        """
        with self._lock:
            if not self._pending or self._state.closed:
                return 0
            g = self.granule
            covered = {
                i for s, e in self._views.values() for i in range(s // g, -(-e // g))
            } & self._pending
            todo = sorted(self._pending - covered)
            if not todo:
                return 0
            self._unmap_granules(todo)
            return len(todo) * g

    def decommit_now(
        self, ranges: Iterable[tuple[Region, int, int]], *, synchronize: bool = True
    ) -> int:
        """Unmaps the granules of each granule-aligned [start, end) of a region now, even
        under a live view (flush() leaves those alone); returns the bytes unmapped.

        For memory that stays viewed for its owner's life: an engine's slot, released when
        its request ends. Safe because the device is synchronized first (no in-flight work
        still reads the granules) and each granule is mapped back to the read-only zero
        granule in the same locked section: a live view reads zeros where it read the data,
        and a write there would fault, so kernels must bound writes by the committed tokens.
        `synchronize=False` skips the synchronize, for a caller that knows no queued or
        running work touches the ranges (an engine's slot that the step in flight leaves
        idle): the unmap then overlaps that work instead of waiting for it.
        """
        indices = self._aligned_granules("decommit_now", ranges)
        with self._lock:
            self._check_open()
            todo = sorted(i for i in indices if i in self._state.mapped)
            self._pending.difference_update(todo)
            if todo:
                self._unmap_granules(todo, synchronize=synchronize)
            return len(todo) * self.granule

    def _aligned_granules(self, what: str, ranges: Iterable[tuple[Region, int, int]]) -> set[int]:
        """The granule indices of granule-aligned [start, end) ranges of regions."""
        g = self.granule
        indices: set[int] = set()
        for region, start, end in ranges:
            if not 0 <= start <= end <= region.reserved_bytes or start % g or end % g:
                raise ArenaError(
                    f"{what}: range [{start}, {end}) must be granule-aligned ({g} bytes) "
                    f"and inside the region's {region.reserved_bytes} reserved bytes"
                )
            indices.update(range((region.offset + start) // g, (region.offset + end) // g))
        return indices

    def recommit(
        self, ranges: Iterable[tuple[Region, int, int]], *, synchronize: bool = True
    ) -> CommitReport:
        """Gives each granule-aligned [start, end) of a region fresh zeroed granules in place
        of the ones mapped there, as decommit_now then commit would, but without mapping the
        zero granule in between (three driver calls fewer per granule). For memory that
        changes owner while its old granules live on elsewhere: an engine's slot handed to a
        new request while the prefix store holds the old request's blocks. The old handles
        lose this mapping (pooled where it was their last reference). `synchronize` as in
        decommit_now. A refusal leaves the ranges decommitted (reading the zero granule) and
        raises, as commit does."""
        g = self.granule
        indices = self._aligned_granules("recommit", ranges)
        with self._lock:
            self._check_open()
            s = self._state
            todo = sorted(i for i in indices if i in s.mapped)
            self._pending.difference_update(todo)
            if todo:
                self._unmap_granules(todo, synchronize=synchronize, zero_back=False)
            try:
                return self._commit([(i * g, (i + 1) * g) for i in sorted(indices)])
            except ArenaError:
                try:
                    self._map_zero(i for i in todo if i not in s.mapped and i not in s.quarantined)
                except ArenaError:
                    pass  # counted by stats().unbacked_bytes
                raise

    def _unmap_granules(
        self, todo: list[int], *, synchronize: bool = True, zero_back: bool = True
    ) -> None:
        """Unmaps mapped granules (sorted indices) after a device synchronize, pools or
        releases their handles and maps the zero granule back where a live region has them
        (unless not `zero_back`: the caller maps them again). Called with the lock held."""
        t0 = time.perf_counter()
        try:
            self._unmap_and_pool(todo, synchronize, zero_back)
        finally:
            self._decommit_seconds += time.perf_counter() - t0

    def _unmap_and_pool(self, todo: list[int], synchronize: bool, zero_back: bool) -> None:
        g, d = self.granule, self._state.driver
        d.make_current()
        if synchronize:
            d.synchronize()
        s = self._state
        unmapped: list[int] = []
        for index in todo:
            handle = s.mapped.pop(index)
            self._pending.discard(index)
            self._count_granule(index, -1)
            last = self._drop_ref(handle)
            try:
                d.unmap(s.base + index * g, g)
            except ArenaError:
                s.quarantined[index] = handle  # may still be mapped: never handed out
                continue
            self._counts["unmap"] += 1
            unmapped.append(index)
            if last:
                self._retire_handle(handle)
        if not zero_back:
            return
        live = [i for i in unmapped if (r := self._region_of(i)) is not None and not r.closing]
        try:
            self._map_zero(live)
        except ArenaError:
            pass  # counted by stats().unbacked_bytes

    def _retire_handle(self, handle: Any) -> None:
        """A handle nothing maps or holds any more: pooled, or released past the pool's target
        (kept if a failed unmap may still map it)."""
        s = self._state
        if any(h is handle for h in s.quarantined.values()):
            return
        if len(s.pool) * self.granule < self.pool_target:
            s.pool.append(handle)
            return
        try:
            s.driver.release(handle)
            self._counts["release"] += 1
        except ArenaError:
            s.unreleased.append(handle)  # unmapped: never handed out again

    # -- views ---------------------------------------------------------------------------------

    def _export(self, region: Region, shape: tuple[int, ...], dtype: Any, offset: int) -> jax.Array:
        dtype = jnp.dtype(dtype)
        if dtype.name not in _DLPACK_DTYPES:
            raise ValueError(f"dtype: expected one of {_DLPACK_DTYPES}, got {dtype.name}")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % MIN_ALIGN or offset < 0 or offset + nbytes > region.reserved_bytes:
            raise ValueError(
                f"export: [{offset}, {offset + nbytes}) must be 256-byte aligned and inside "
                f"the region's {region.reserved_bytes} reserved bytes"
            )
        from jax_kv import _ffi_cpu

        with self._lock:
            self._check_open()
            if region.freed:
                raise ArenaError("export: the region was freed")
            lo = region.offset + offset
            hi = lo + nbytes
            for s, e in self._views.values():
                if s < hi and lo < e:
                    raise ArenaError(
                        f"export refused: bytes [{lo}, {hi}) of the arena overlap a live view "
                        f"[{s}, {e}); never two live views of the same bytes"
                    )
            key = self._next_key
            self._next_key += 1
            self._views[key] = (lo, hi)
            self._counts["exported"] += 1
        ptr = self._state.base + lo
        token = _ViewToken(self, key)
        view = _ffi_cpu.export_view(
            ptr, list(shape), dtype.name, self._state.driver.kind, self.device_id, token
        )
        del token
        array = jax.dlpack.from_dlpack(view, copy=False)
        del view
        if array.unsafe_buffer_pointer() != ptr:
            raise ArenaError("export: jax copied the view instead of aliasing it")
        return array

    @property
    def device_id(self) -> int:
        ordinal = getattr(self.device, "local_hardware_id", None)
        return int(self.device.id if ordinal is None else ordinal)

    def _release_view(self, key: int) -> None:
        with self._lock:
            if self._views.pop(key, None) is not None:
                self._counts["released"] += 1

    # -- device copies ----------------------------------------------------------------------------

    def copy2d(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int
    ) -> None:
        """Strided device-to-device copy (asynchronous; `finish_copies` waits)."""
        with self._lock:
            self._state.driver.make_current()
            self._state.driver.copy2d(dst, dst_pitch, src, src_pitch, width, height)
            self._counts["copy"] += 1

    def write(self, dst: int, data: bytes) -> None:
        """Copies host bytes to committed arena memory and waits (no step may be in flight)."""
        with self._lock:
            self._check_open()
            self._state.driver.make_current()
            self._state.driver.write(dst, data)
            self._counts["copy"] += 1

    def finish_copies(self) -> None:
        self._state.driver.finish_copies()

    def synchronize(self) -> None:
        self._state.driver.make_current()
        self._state.driver.synchronize()

    @property
    def driver(self) -> Any:
        return self._state.driver


def _canonical_piece(index: int, z: int) -> tuple[int, int]:
    """(start, granules) of the buddy piece holding granule `index` when its aligned block of
    `z` granules reads zeros: [0], [1], [2-3], [4-7], .. [z/2 .. z-1] from the block's start."""
    r = index % z
    if r == 0:
        return index, 1
    n = 1 << (r.bit_length() - 1)
    return index - r + n, n


def _runs(sorted_indices: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs (first, count) of sorted granule indices: one set-access call each."""
    runs: list[tuple[int, int]] = []
    for i in sorted_indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def host_arena(
    *,
    reserve_bytes: int = 1 << 30,
    granule: int = 64 << 10,
    limit_bytes: int | None = None,
    pool_bytes: int = 0,
    device: Any = None,
    **zero: int,
) -> VmmArena:
    """A VmmArena over host memory (HostDriver), its views placed on the JAX CPU `device`
    (default the first); `zero`: VmmArena's zero_singles_limit, zero_block_granules."""
    driver = HostDriver(granule=granule, total_memory=reserve_bytes, limit_bytes=limit_bytes)
    return VmmArena(
        device, driver=driver, reserve_bytes=reserve_bytes, pool_bytes=pool_bytes, **zero
    )


__all__ = [
    "ArenaError",
    "ArenaExhausted",
    "ArenaStats",
    "CommitReport",
    "Region",
    "VmmArena",
    "host_arena",
    "reservation_ladder",
]
