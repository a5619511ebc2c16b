"""MeshArena: one VmmArena per device of a mesh's "tp" axis, driven as one (issue 28, item 1).

A cache sharded over KV heads holds, on every device, the same slots at the same offsets with
1/n of each token's bytes (n devices). So a MeshRegion is one Region per device, and the
MeshArena speaks in global bytes: a split region's global byte range [lo, hi) is the local
range [lo/n, hi/n) of every part; its granule is n device granules. A replicated region (the
per-row control values) holds the same bytes on every device, at the same offsets.

Every call that changes mappings (commit, share) is all-or-nothing across devices: a device
that refuses rolls back the devices already done (`decommit_now`), so the arenas never
disagree about which granules a slot holds. Byte counts are totals over the devices. Exports
are global jax.Arrays assembled from the per-device views
(`jax.make_array_from_single_device_arrays`): zero-copy, each shard's pointer the part's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kv.memory._drivers import ArenaError
from jax_kv.memory.arena import CommitReport, Region, VmmArena

REPLICATED = P()


class MeshRegion:
    """One Region per device; `spec` says how arrays exported from it are laid out over the
    mesh (P() replicated, else split: its global bytes are n times a part's)."""

    def __init__(self, arena: MeshArena, parts: list[Region], spec: P) -> None:
        self.arena, self.parts, self.spec = arena, parts, spec
        self.split = any(axis is not None for axis in spec)
        self.scale = len(parts) if self.split else 1  # global bytes per local byte

    @property
    def reserved_bytes(self) -> int:
        return self.parts[0].reserved_bytes * self.scale

    def local(self, offset: int) -> int:
        """The local offset of a global one (a multiple of the devices' count when split)."""
        if offset % self.scale:
            raise ArenaError(f"offset {offset}: not a multiple of the {self.scale} devices")
        return offset // self.scale

    @property
    def committed_bytes(self) -> int:
        return sum(part.committed_bytes for part in self.parts)

    def commit(self, nbytes: int) -> CommitReport:
        return self.arena.commit([(self, 0, nbytes)])

    def write(self, offset: int, data: bytes) -> None:
        """Writes host bytes at a local offset of every part (a replicated region's values)."""
        for part in self.parts:
            part.write(offset, data)

    def write_spans(self, array: jax.Array, spans: Iterable[tuple[int, int]]) -> int:
        """Writes the global byte spans [lo, lo + n) of `array` (laid out as this region) into
        the parts, shard by shard (the host driver's write-back); returns global bytes."""
        by_device = {s.device: s.data for s in array.addressable_shards}
        spans = [(self.local(lo), self.local(n)) for lo, n in spans]
        for arena, part in zip(self.arena.arenas, self.parts, strict=True):
            data = np.asarray(by_device[arena.device]).reshape(-1).view(np.uint8)
            for lo, n in spans:
                part.write(lo, data[lo : lo + n].tobytes())
        return sum(n for _, n in spans) * self.scale

    def holds(self, array: jax.Array) -> bool:
        """Whether `array` is this region's memory on every device (not a copy)."""
        ptrs = {s.device: s.data.unsafe_buffer_pointer() for s in array.addressable_shards}
        return all(
            ptrs.get(arena.device) == part.ptr
            for arena, part in zip(self.arena.arenas, self.parts, strict=True)
        )

    def export(self, shape: Sequence[int], dtype: Any, offset: int = 0) -> jax.Array:
        """A global array of `shape` over the parts, laid out as `spec`, zero-copy, from the
        global byte `offset`."""
        n = len(self.parts)
        local = list(shape)
        for axis, name in enumerate(self.spec):
            if name is not None:
                if local[axis] % n:
                    raise ValueError(f"export: axis {axis} of {list(shape)} not split by {n}")
                local[axis] //= n
        views = [part.export(local, dtype, self.local(offset)) for part in self.parts]
        sharding = NamedSharding(self.arena.mesh, self.spec)
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, views)

    def free(self) -> None:
        for part in self.parts:
            part.free()


class MeshArena:
    """VmmArenas, one per device of `mesh` (axis "tp"), in the order of the mesh's devices.

    Args:
        mesh: a jax.sharding.Mesh with one axis, "tp" (jax_kv.parallel.tp_mesh).
        arenas: one VmmArena per device (arena.device must be that device); default: a CUDA
            VmmArena per device, or a host arena per CPU device (its views placed on it).
        **kwargs: passed to each default arena (reserve_bytes, pool_bytes, limit_bytes; for
            host arenas reserve_bytes and granule).
    """

    kind = "vmm"

    def __init__(self, mesh: Mesh, arenas: Sequence[VmmArena] | None = None, **kwargs: Any):
        devices = list(mesh.devices.flat)
        if arenas is None:
            arenas = [_default_arena(d, **kwargs) for d in devices]
        arenas = list(arenas)
        if [a.device for a in arenas] != devices:
            raise ValueError(
                f"arenas: expected one VmmArena per mesh device {devices}, in that order; got "
                f"{[a.device for a in arenas]}"
            )
        granules = {a.granule for a in arenas}
        if len(granules) != 1:
            raise ValueError(f"arenas: expected one granule size, got {sorted(granules)}")
        self.mesh, self.arenas = mesh, arenas
        self.device_granule = granules.pop()
        self.granule = self.device_granule * len(arenas)  # of a split region, global bytes

    @property
    def devices(self) -> int:
        return len(self.arenas)

    @property
    def driver(self) -> Any:
        return self.arenas[0].driver

    @property
    def capacity_bytes(self) -> int:
        """Global bytes: every device's VmmArena.capacity_bytes together."""
        return sum(a.capacity_bytes for a in self.arenas)

    @property
    def closed(self) -> bool:
        return all(a.closed for a in self.arenas)

    def close(self) -> None:
        """Closes every device's arena, also past one that fails; raises the failures
        together (as VmmArena.close does its steps)."""
        errors = []
        for a in self.arenas:
            try:
                a.close()
            except Exception as e:  # noqa: BLE001 - collected, raised below
                errors.append(f"{a.device}: {e}")
        if errors:
            raise ArenaError("MeshArena.close: " + "; ".join(errors))

    # -- regions -------------------------------------------------------------------------------

    def allocate(self, nbytes: int, spec: P = REPLICATED) -> MeshRegion:
        """A region of `nbytes` global bytes laid out as `spec` (split: nbytes / n per device,
        rounded up to whole device granules; P(): nbytes on each)."""
        split = any(axis is not None for axis in spec)
        local = -(-int(nbytes) // self.devices) if split else int(nbytes)
        parts: list[Region] = []
        try:
            for a in self.arenas:
                parts.append(a.allocate(local))
        except BaseException:
            for part in parts:
                part.free()
            raise
        return MeshRegion(self, parts, spec)

    def _per_arena(self, ranges: Iterable[tuple[MeshRegion, int, int]]) -> list[list[tuple]]:
        ranges = list(ranges)
        return [
            [(r.parts[i], r.local(lo), r.local(hi)) for r, lo, hi in ranges]
            for i in range(self.devices)
        ]

    def commit(self, ranges: Iterable[tuple[MeshRegion, int, int]]) -> CommitReport:
        """Commits the ranges on every device or on none."""
        per, reports = self._per_arena(ranges), []
        try:
            for arena, local in zip(self.arenas, per, strict=True):
                reports.append(arena.commit(local))
        except BaseException as error:
            # By the granules each device mapped: the ranges are token ranges, not
            # granule-aligned, and decommit_now would refuse them (or unmap live data).
            for arena, report in zip(self.arenas, reports, strict=False):
                try:
                    arena.undo_commit(report)
                except Exception as undo_error:  # the refusal is what the caller must see
                    error.add_note(f"and undoing {arena.device}'s commit failed: {undo_error}")
            raise
        return _sum_reports(reports)

    def decommit_now(
        self, ranges: Iterable[tuple[MeshRegion, int, int]], *, synchronize: bool = True
    ) -> int:
        per = self._per_arena(ranges)
        return sum(
            a.decommit_now(local, synchronize=synchronize)
            for a, local in zip(self.arenas, per, strict=True)
        )

    def recommit(
        self, ranges: Iterable[tuple[MeshRegion, int, int]], *, synchronize: bool = True
    ) -> CommitReport:
        """VmmArena.recommit on every device. A refusal on one leaves the ranges decommitted
        on every device (as each refusing arena leaves its own)."""
        per, reports = self._per_arena(ranges), []
        try:
            for arena, local in zip(self.arenas, per, strict=True):
                reports.append(arena.recommit(local, synchronize=synchronize))
        except BaseException:
            for arena, local in zip(self.arenas, per, strict=True):
                arena.decommit_now(local)
            raise
        return _sum_reports(reports)

    def share(
        self, src: MeshRegion, src_offset: int, dst: MeshRegion, dst_offset: int, nbytes: int,
        *, read_only: bool = True,
    ) -> CommitReport:  # fmt: skip
        """VmmArena.share on every device or on none."""
        so, do, n = src.local(src_offset), dst.local(dst_offset), src.local(nbytes)
        reports, done = [], []
        try:
            for i, arena in enumerate(self.arenas):
                reports.append(
                    arena.share(src.parts[i], so, dst.parts[i], do, n, read_only=read_only)
                )
                done.append((arena, dst.parts[i]))
        except BaseException:
            for arena, part in done:
                arena.decommit_now([(part, do, do + n)])
            raise
        return _sum_reports(reports)

    def hold(self, region: MeshRegion, offset: int, nbytes: int) -> list[tuple[Any, ...]]:
        """VmmArena.hold on every device or on none: one tuple of handles per device."""
        lo, n = region.local(offset), region.local(nbytes)
        held: list[tuple[Any, ...]] = []
        try:
            for a, part in zip(self.arenas, region.parts, strict=True):
                held.append(a.hold(part, lo, n))
        except BaseException:
            for a, handles in zip(self.arenas, held, strict=False):
                a.release_held(handles)
            raise
        return held

    def release_held(self, held: list[tuple[Any, ...]]) -> int:
        """Bytes freed, over all devices."""
        return sum(a.release_held(h) for a, h in zip(self.arenas, held, strict=True))

    def map_held(
        self, held: list[tuple[Any, ...]], dst: MeshRegion, dst_offset: int, *,
        read_only: bool = True,
    ) -> CommitReport:  # fmt: skip
        """VmmArena.map_held on every device or on none."""
        do, reports, done = dst.local(dst_offset), [], []
        try:
            for i, arena in enumerate(self.arenas):
                reports.append(arena.map_held(held[i], dst.parts[i], do, read_only=read_only))
                done.append((arena, dst.parts[i], len(held[i]) * arena.granule))
        except BaseException:
            for arena, part, n in done:
                arena.decommit_now([(part, do, do + n)])
            raise
        return _sum_reports(reports)

    def copy_on_write(
        self, region: MeshRegion, offset: int, nbytes: int, *, synchronize: bool = True
    ) -> int:
        """Granules copied, over all devices (`synchronize` as in VmmArena.copy_on_write)."""
        lo, n = region.local(offset), region.local(nbytes)
        pairs = zip(self.arenas, region.parts, strict=True)
        return sum(a.copy_on_write(part, lo, n, synchronize=synchronize) for a, part in pairs)

    def wait_unviewed(self, regions: Iterable[MeshRegion], timeout: float = 5.0) -> None:
        """VmmArena.wait_unviewed on every device."""
        regions = list(regions)
        for i, a in enumerate(self.arenas):
            a.wait_unviewed([r.parts[i] for r in regions], timeout)

    # -- accounting ------------------------------------------------------------------------------

    @property
    def committed_bytes(self) -> int:
        return sum(a.committed_bytes for a in self.arenas)

    def physical_bytes(
        self, regions: Iterable[MeshRegion], held: AbstractSet[int] = frozenset()
    ) -> int:
        """Over all devices; `held` may name every device's held handles (each device counts
        its own)."""
        regions = list(regions)
        return sum(
            a.physical_bytes([r.parts[i] for r in regions], held) for i, a in enumerate(self.arenas)
        )

    @property
    def free_va_bytes(self) -> int:
        """Address space a split region can still take (the least of any device, n times)."""
        return min(a.free_va_bytes for a in self.arenas) * self.devices

    def refill_pool(self) -> int:
        return sum(a.refill_pool() for a in self.arenas)

    def available_bytes(self) -> int:
        """What a split region can still commit: the least any device can, n times."""
        return min(a.available_bytes() for a in self.arenas) * self.devices


def allocate(arena: Any, nbytes: int, spec: P) -> Any:
    """A region of `arena` whose exports are laid out as `spec` on a MeshArena (P() for
    per-row values every device holds); a plain Region of a one-device arena."""
    if isinstance(arena, MeshArena):
        return arena.allocate(nbytes, spec)
    return arena.allocate(nbytes)


def _sum_reports(reports: list[CommitReport]) -> CommitReport:
    return CommitReport(
        granules=sum(r.granules for r in reports),
        map_calls=sum(r.map_calls for r in reports),
        set_access_calls=sum(r.set_access_calls for r in reports),
        seconds=sum(r.seconds for r in reports),
    )


def _default_arena(device: Any, **kwargs: Any) -> VmmArena:
    if device.platform == "cpu":
        from jax_kv.memory.arena import host_arena

        return host_arena(device=device, **kwargs)
    return VmmArena(device, **kwargs)


__all__ = ["REPLICATED", "MeshArena", "MeshRegion", "allocate"]
