"""VmmArena: one large virtual reservation, physical memory committed on demand, regions
exported to JAX zero-copy through DLPack.

Rules the arena enforces (DESIGN.md, Memory):
- regions start on a granule boundary (>= 256-byte aligned views);
- never two live views of the same bytes: `export` refuses an overlap;
- never unmap memory a live view covers: decommit is deferred and skips covered granules,
  `Region.free` and `close` refuse while a view is live;
- accounting is exact: every driver call is counted, commit time is measured.

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
from typing import Any

import jax
import jax.numpy as jnp

from jax_kv.memory._drivers import ArenaError, ArenaExhausted, CudaDriver, HostDriver

GiB = 1 << 30
LADDER_FLOOR = 64 * GiB
MIN_ALIGN = 256

_DLPACK_DTYPES = ("bfloat16", "float16", "float32", "int32", "uint8")


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
    map_calls: int
    unmap_calls: int
    set_access_calls: int
    create_calls: int
    release_calls: int
    copy_calls: int
    commit_seconds: float  # inside commit: handle creation on shortfall, map, set-access
    create_seconds: float  # all cuMemCreate time, commit shortfalls and pool refills
    views_exported: int
    views_released: int
    reservation_ladder: tuple[int, ...]  # sizes tried, in order; the last one succeeded


@dataclasses.dataclass(frozen=True)
class CommitReport:
    """What one commit did."""

    granules: int
    map_calls: int
    set_access_calls: int
    seconds: float


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
        self.mapped: dict[int, Any] = {}  # granule index -> physical handle
        self.pool: list[Any] = []
        self.closed = False

    def close(self) -> list[str]:
        if self.closed:
            return []
        self.closed = True
        errors: list[str] = []

        def attempt(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - teardown collects every failure
                errors.append(str(e))

        d, g = self.driver, self.driver.granule
        attempt(d.make_current)
        attempt(d.synchronize)
        for index in sorted(self.mapped):
            attempt(d.unmap, self.base + index * g, g)
        for handle in [*self.mapped.values(), *self.pool]:
            attempt(d.release, handle)
        self.mapped.clear()
        self.pool.clear()
        if self.reserved:
            attempt(d.free_va, self.base, self.reserved)
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
    """

    def __init__(
        self,
        device: Any = None,
        *,
        reserve_bytes: int | None = None,
        pool_bytes: int | None = None,
        limit_bytes: int | None = None,
        driver: Any = None,
    ) -> None:
        from jax_kv.config import runtime_config

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
        self._free_va: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced
        self._regions: dict[int, Region] = {}
        self._starts: list[int] = []  # sorted region offsets
        self._pending: set[int] = set()
        self._views: dict[int, tuple[int, int]] = {}
        self._next_key = 0
        self._counts = dict.fromkeys(
            ("map", "unmap", "set_access", "create", "release", "copy", "exported", "released"),
            0,
        )
        self._commit_seconds = 0.0
        self._create_seconds = 0.0
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
        self._free_va = [(0, self._state.reserved)]

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
        if errors:
            raise ArenaError("VmmArena teardown: " + "; ".join(errors))

    # -- accounting --------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self._state.reserved

    @property
    def committed_bytes(self) -> int:
        return len(self._state.mapped) * self.granule

    @property
    def live_views(self) -> int:
        return len(self._views)

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
            map_calls=c["map"],
            unmap_calls=c["unmap"],
            set_access_calls=c["set_access"],
            create_calls=c["create"],
            release_calls=c["release"],
            copy_calls=c["copy"],
            commit_seconds=self._commit_seconds,
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
        with self._lock:
            self._check_open()
            for attempt in range(2):
                for i, (off, free) in enumerate(self._free_va):
                    if free >= size:
                        self._free_va[i : i + 1] = (
                            [(off + size, free - size)] if free > size else []
                        )
                        region = Region(self, off, size, int(nbytes))
                        self._regions[off] = region
                        bisect.insort(self._starts, off)
                        return region
                if attempt == 0 and self._pending:
                    self.flush()
            raise ArenaExhausted(
                f"allocate: requested {size} bytes of address space, reserved "
                f"{self._state.reserved}, free {self.free_va_bytes} (largest free range "
                f"{max((s for _, s in self._free_va), default=0)})"
            )

    def _free(self, region: Region) -> None:
        with self._lock:
            if region.freed:
                return
            lo, hi = region.offset, region.offset + region.reserved_bytes
            if any(s < hi and lo < e for s, e in self._views.values()):
                raise ArenaError("free: a live view covers this region; drop its jax arrays first")
            g = self.granule
            self._queue_decommit(range(lo // g, hi // g))
            self.flush()
            region.freed = True
            del self._regions[region.offset]
            self._starts.remove(region.offset)
            self._free_va.append((lo, region.reserved_bytes))
            self._free_va.sort()
            merged: list[tuple[int, int]] = []
            for off, size in self._free_va:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free_va = merged

    def _check_open(self) -> None:
        if self._state.closed:
            raise ArenaError("the arena is closed")

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
            held = len(self._state.mapped) + len(self._state.pool) + in_flight
            physical = (held + 1) * self.granule
            if physical > self.limit_bytes:
                raise ArenaExhausted(f"arena limit of {self.limit_bytes} bytes reached")
        t0 = time.perf_counter()
        handle = self._state.driver.create()
        self._create_seconds += time.perf_counter() - t0
        self._counts["create"] += 1
        return handle

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
            t0 = time.perf_counter()
            shortfall = len(missing) - len(self._state.pool)
            if shortfall > 0 and self._pending:
                self.flush()  # recycle deferred decommits before asking the driver
            handles: list[Any] = []
            mapped_now: list[int] = []
            d = self._state.driver
            try:
                d.make_current()
                while len(self._state.pool) + len(handles) < len(missing):
                    handles.append(self._create(in_flight=len(handles)))
                handles = [
                    self._state.pool.pop() for _ in range(len(missing) - len(handles))
                ] + handles
                for index, handle in zip(missing, handles, strict=True):
                    d.map(self._state.base + index * g, handle)
                    self._counts["map"] += 1
                    mapped_now.append(index)
                runs = _runs(missing)
                for first, count in runs:
                    d.set_access(self._state.base + first * g, count * g)
                    self._counts["set_access"] += 1
            except ArenaError as e:
                for index in mapped_now:
                    try:
                        d.unmap(self._state.base + index * g, g)
                        self._counts["unmap"] += 1
                    except ArenaError:
                        pass
                self._state.pool.extend(handles)
                requested = len(missing) * g
                raise type(e)(
                    f"commit refused: requested {requested} bytes ({len(missing)} granules of "
                    f"{g}), committed {self.committed_bytes} bytes, available "
                    f"{self.available_bytes()} bytes ({e})"
                ) from e
            for index, handle in zip(missing, handles, strict=True):
                self._state.mapped[index] = handle
                region = self._region_of(index)
                if region is not None:
                    region.granules += 1
            seconds = time.perf_counter() - t0
            self._commit_seconds += seconds
            return CommitReport(len(missing), len(missing), len(runs), seconds)

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
            g, d = self.granule, self._state.driver
            covered = {
                i for s, e in self._views.values() for i in range(s // g, -(-e // g))
            } & self._pending
            todo = sorted(self._pending - covered)
            if not todo:
                return 0
            d.make_current()
            d.synchronize()
            for index in todo:
                d.unmap(self._state.base + index * g, g)
                self._counts["unmap"] += 1
                handle = self._state.mapped.pop(index)
                self._pending.discard(index)
                region = self._region_of(index)
                if region is not None:
                    region.granules -= 1
                if len(self._state.pool) * g < self.pool_target:
                    self._state.pool.append(handle)
                else:
                    d.release(handle)
                    self._counts["release"] += 1
            return len(todo) * g

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

    def finish_copies(self) -> None:
        self._state.driver.finish_copies()

    def synchronize(self) -> None:
        self._state.driver.make_current()
        self._state.driver.synchronize()

    @property
    def driver(self) -> Any:
        return self._state.driver


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
) -> VmmArena:
    """A VmmArena over host memory (HostDriver), exported to the JAX CPU device."""
    driver = HostDriver(granule=granule, total_memory=reserve_bytes, limit_bytes=limit_bytes)
    return VmmArena(driver=driver, reserve_bytes=reserve_bytes, pool_bytes=pool_bytes)


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
