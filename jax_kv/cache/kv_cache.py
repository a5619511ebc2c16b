"""KvCache: per-layer K and V arrays, host-side lengths, and growth through one strategy."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.cache._lifecycle import closed_on_failure
from jax_kv.cache.capacity import CapacityError, bucket_for
from jax_kv.cache.events import GrowthEvent, GrowthReason
from jax_kv.cache.growth import GrowthStrategy, describe_need, growth_for
from jax_kv.config import runtime_config
from jax_kv.layout import Layout
from jax_kv.memory import EagerArena, MeshArena, VmmArena
from jax_kv.parallel import check_tp, mesh_size, put_replicated


def _module_exists(name: str) -> bool:
    """find_spec of a dotted name imports its parents and raises when a parent is missing
    (`cuda` absent: ModuleNotFoundError); a CPU-only install must read that as False."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def default_arena(mesh: Any = None) -> Any:
    """The arena JAX_KV_ARENA names (auto: a VmmArena on CUDA, else an EagerArena); under a
    mesh the VMM choice is a MeshArena (one VmmArena per device)."""
    choice = runtime_config().arena
    if choice == "eager":
        return EagerArena()
    has_cuda = _module_exists("cuda.bindings")
    if choice == "vmm" or (choice == "auto" and has_cuda and jax.default_backend() == "gpu"):
        return VmmArena() if mesh is None else MeshArena(mesh)
    return EagerArena()


def arena_for(arena: Any, mesh: Any, num_kv_heads: int) -> Any:
    """The arena a cache of `num_kv_heads` uses: `arena`, or the default for `mesh`; under a
    mesh, refuses a split the heads do not allow and a one-device VmmArena."""
    if mesh is not None:
        check_tp(num_kv_heads, mesh_size(mesh))
    arena = default_arena(mesh) if arena is None else arena
    if mesh is not None and isinstance(arena, VmmArena):
        raise ValueError(
            "arena: a VmmArena holds one device's memory; under a mesh pass a "
            "jax_kv.memory.MeshArena(mesh) (one VmmArena per device) or an EagerArena"
        )
    if isinstance(arena, MeshArena) and arena.mesh != mesh:
        raise ValueError("arena: the MeshArena's mesh is not the cache's `mesh`")
    return arena


class KvCache:
    """Per-layer K and V caches [B, Hkv, S, D] (HEAD_MAJOR) or [B, S, Hkv, D] (SEQ_MAJOR).

    Args:
        num_layers, batch, num_kv_heads, head_dim: the cache geometry (L, B, Hkv, D).
        dtype: bfloat16, float16 or float32.
        layout: the cache's Layout, owned here and passed to every op from `self.layout`.
        arena: a VmmArena or EagerArena; default from JAX_KV_ARENA (auto: VMM on CUDA).
        max_len: the caller's hard max in tokens; else `model_max_len` (the model's
            max_position_embeddings); else unbounded (VMM: bounded for the reservation).
        min_bucket: capacity floor and bucket base (JAX_KV_MIN_BUCKET, 256).
        commit_ahead: seq-major VMM commit step in tokens (JAX_KV_COMMIT_AHEAD, min_bucket).
        initial_tokens: capacity to have ready at construction (at least 1): an int, or one
            per sequence ([B]; seq-major on VMM then commits each its own).
        mesh: a jax.sharding.Mesh with a "tp" axis (jax_kv.parallel): the Hkv axis of every
            array is split over it. On VMM the arena is a MeshArena (default MeshArena(mesh);
            seq-major only): growth commits on every device or on none, and a kept step is
            kept on every device. Byte counts are totals over the devices.

    Use: `event = cache.ensure_capacity(L + 1)` before a step (outside jit); run the step
    with `cache.k, cache.v` donated; `cache.accept(k, v)` with the step's outputs;
    `cache.advance(1)`.

    `growth` is the strategy chosen here from the arena and the layout (SeqMajorVmmGrowth,
    HeadMajorVmmGrowth or EagerGrowth); everything that differs between the paths is there.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = jnp.bfloat16,
        layout: Layout | str | int = Layout.SEQ_MAJOR,
        arena: Any = None,
        max_len: int | None = None,
        model_max_len: int | None = None,
        min_bucket: int | None = None,
        commit_ahead: int | None = None,
        initial_tokens: int | Sequence[int] | np.ndarray = 0,
        mesh: Any = None,
    ) -> None:
        config = runtime_config()
        self.layout = Layout.parse(layout)
        self.num_layers, self.batch = int(num_layers), int(batch)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.dtype = jnp.dtype(dtype)
        for name, value in (
            ("num_layers", num_layers),
            ("batch", batch),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")
        self.min_bucket = config.min_bucket if min_bucket is None else int(min_bucket)
        bucket_for(1, self.min_bucket)  # validates
        step = config.commit_ahead if commit_ahead is None else commit_ahead
        self.commit_step = self.min_bucket if step is None else int(step)
        if self.commit_step < 1:
            raise ValueError(f"commit_ahead: expected >= 1 token, got {commit_ahead}")
        self.closed = False
        self.mesh = mesh
        self.arena = arena_for(arena, mesh, self.num_kv_heads)
        self.growth: GrowthStrategy = growth_for(self.arena, self.layout)
        self.lengths = np.zeros((self.batch,), np.int32)
        self.token_bytes = self.num_kv_heads * self.head_dim * self.dtype.itemsize
        self.bytes_moved_total = 0
        self.growth_events = 0
        self.growth_keeps = 0
        # int32 [B], committed_tokens() on the device: the bound a step's kernels write under.
        # On VMM a view of arena memory the host rewrites in place at growth, so its address
        # (which the recorded CUDA graph holds) never changes and a kept step is replayed.
        self.committed: jax.Array | None = None
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []
        self.capacity = 0
        n0 = np.maximum(1, self._need("initial_tokens", initial_tokens))
        self.plan = self.growth.plan(self, max_len, model_max_len)
        # VMM: the reservation (bounded even when the cache is not); else the hard max.
        reserved = self.plan.reservation_tokens
        self.max_len: int | None = self.plan.hard_max if reserved is None else reserved
        self._check_hard_max(n0)
        with closed_on_failure(self, "KvCache"):
            self.growth.start(self, n0 if self.growth.per_row else int(n0.max()))
            self._sync_committed()

    # -- geometry and accounting ---------------------------------------------------------

    @property
    def is_vmm(self) -> bool:
        return self.growth.is_vmm

    @property
    def commits_per_row(self) -> bool:
        """Whether each sequence commits its own tokens (seq-major on VMM), or every row the
        largest need."""
        return self.growth.per_row

    @property
    def array_capacity(self) -> int:
        """S of the arrays (max_len for seq-major VMM; the capacity otherwise)."""
        return self.growth.array_capacity(self)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layout.cache_shape(
            self.batch, self.array_capacity, self.num_kv_heads, self.head_dim
        )

    @property
    def live_bytes(self) -> int:
        """KV bytes of the live tokens, all layers, K and V."""
        return int(self.lengths.astype(np.int64).sum()) * self.token_bytes * 2 * self.num_layers

    @property
    def committed_bytes(self) -> int:
        """Physical KV bytes this cache holds (VMM: its regions' granules; eager: buffers)."""
        return self.growth.committed_bytes(self)

    @property
    def reserved_bytes(self) -> int:
        return sum(r.reserved_bytes for r in self.growth.regions)

    def committed_tokens(self) -> np.ndarray:
        """int32 [B]: positions of each sequence backed by committed memory, the bound a kept
        step's kernels write under (gqa_decode's `committed`). Seq-major on VMM commits each
        row its own need (`capacity` is then the longest row's); the other paths commit every
        row to `capacity`."""
        self._check_open("committed_tokens")
        return self.growth.committed_tokens(self)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise CacheClosedError(
                f"{what}: this KvCache is closed (its arrays and memory are released); make a "
                f"new one"
            )

    def _sync_committed(self) -> None:
        values = np.ascontiguousarray(self.committed_tokens(), np.int32)
        control = self.growth.control
        if control is None:
            self.committed = put_replicated(values, self.mesh)
        else:  # no step is in flight during growth: the write cannot race a kernel's read
            control.write(0, values.tobytes())  # on every device under a mesh

    def pointers(self) -> list[int]:
        self._check_open("pointers")
        # Per shard: one per array on one device, one per device under a mesh.
        return [
            s.data.unsafe_buffer_pointer() for a in (*self.k, *self.v) for s in a.addressable_shards
        ]

    def stats(self) -> dict[str, Any]:
        return dict(
            layout=self.layout.name,
            arena="vmm" if self.is_vmm else "eager",
            capacity=self.capacity,
            array_capacity=self.array_capacity,
            max_len=self.max_len,
            capacity_source=self.plan.source,
            growth_events=self.growth_events,
            growth_keeps=self.growth_keeps,
            kv_bytes_moved=self.bytes_moved_total,
            committed_bytes=self.committed_bytes,
            reserved_bytes=self.reserved_bytes,
            live_bytes=self.live_bytes,
        )

    # -- the step protocol -------------------------------------------------------------------

    def advance(self, num_tokens: int | np.ndarray = 1) -> None:
        """Records `num_tokens` (scalar or [B]) more live tokens after a step wrote them."""
        self._check_open("advance")
        new = self.lengths.astype(np.int64) + np.asarray(num_tokens, np.int64)
        committed = self.growth.committed_tokens(self)
        if (new < 0).any() or (new > committed).any():
            raise ValueError(
                f"advance: lengths would become {new.tolist()}, outside [0, committed tokens "
                f"{committed.tolist()}]; call ensure_capacity first"
            )
        self.lengths = new.astype(np.int32)

    def accept(self, k: list[jax.Array], v: list[jax.Array], *, verify: bool = True) -> None:
        """Takes the step's output caches (the inputs were donated).

        On VMM the outputs must alias the arena memory: XLA wrote in place. A moved pointer
        means the cache was not donated (or XLA copied it) and the arena no longer backs it.
        `verify=False` skips the per-array checks (~8 us per array): for a compiled step
        whose outputs were verified once, their shapes, dtypes and aliasing cannot change.
        """
        self._check_open("accept")
        if not verify:
            self.k, self.v = list(k), list(v)
            return
        if len(k) != self.num_layers or len(v) != self.num_layers:
            raise ValueError(
                f"accept: expected {self.num_layers} K and V arrays, got {len(k)} and {len(v)}"
            )
        for name, arrays in (("k", k), ("v", v)):
            for i, a in enumerate(arrays):
                if tuple(a.shape) != self.shape or a.dtype != self.dtype:
                    raise ValueError(
                        f"accept: {name}[{i}] expected {self.dtype.name} "
                        f"{list(self.shape)}, got {a.dtype} {list(a.shape)}"
                    )
        self.growth.check_outputs([*k, *v])
        self.k, self.v = list(k), list(v)

    # -- growth --------------------------------------------------------------------------------

    def ensure_capacity(self, n: int | Sequence[int] | np.ndarray) -> GrowthEvent:
        """Makes room for `n` tokens per sequence (an int, or one per row: [B]); returns what
        that cost. Seq-major on VMM commits each row its own need; the other paths grow every
        row to the largest.

        Raises:
            CapacityError: n is above the hard max (caller, metadata, or the VMM reservation).
            ArenaExhausted: memory ran out. In both cases the cache is unchanged: same
                capacity, same arrays, data intact.
        """
        self._check_open("ensure_capacity")
        need = self._need("n", n)
        if not self._grows(need):
            return GrowthEvent(
                old_capacity=self.capacity,
                new_capacity=self.capacity,
                bytes_moved=0,
                granules_committed=0,
                shape_changed=False,
                pointer_changed=False,
                keeps_compiled_step=True,
                reason=GrowthReason.NONE,
                committed_bytes=self.committed_bytes,
            )
        self._check_hard_max(need)
        t0 = time.perf_counter()
        event = self.growth.grow(self, need if self.growth.per_row else int(need.max()))
        event = dataclasses.replace(
            event, seconds=time.perf_counter() - t0, committed_bytes=self.committed_bytes
        )
        self._sync_committed()
        self.growth_events += 1
        self.growth_keeps += int(event.keeps_compiled_step)
        self.bytes_moved_total += event.bytes_moved
        self.growth.after_growth(self)  # ahead of the next growth, outside the event's time
        return event

    def would_grow(self, n: int | Sequence[int] | np.ndarray) -> bool:
        """Whether ensure_capacity(n) would commit: some row needs more than it holds."""
        self._check_open("would_grow")
        return self._grows(self._need("n", n))

    def _grows(self, need: np.ndarray) -> bool:
        return bool((need > self.growth.committed_tokens(self)).any())

    def _need(self, name: str, n: Any) -> np.ndarray:
        """int64 [B] from an int or one int per row; a clear error naming `name` otherwise."""
        rows = np.asarray(n)
        shapes = ((), (self.batch,))
        if (
            isinstance(n, bool)
            or rows.dtype.kind not in "iu"
            or rows.shape not in shapes
            or rows.min() < 0
        ):
            raise ValueError(
                f"{name}: expected an int >= 0 or {self.batch} of them (one per sequence), "
                f"got {n!r}"
            )
        if rows.ndim == 0:
            return np.full((self.batch,), int(rows), np.int64)
        return rows.astype(np.int64)  # a copy: the caller's array is not kept

    def _needed_bytes(self, n: int | np.ndarray) -> int:
        """KV bytes of `n` tokens per sequence (an int, or per row): all layers, K and V."""
        tokens = int(np.broadcast_to(np.asarray(n, np.int64), (self.batch,)).sum())
        return 2 * self.num_layers * tokens * self.token_bytes

    def _check_hard_max(self, need: np.ndarray) -> None:
        """need: int64 [B], the tokens each sequence asks for."""
        if self.max_len is not None and int(need.max()) > self.max_len:
            # Only a VMM reservation bounds a cache without a hard max.
            kind = "reservation" if self.plan.hard_max is None else "hard max"
            raise CapacityError(
                f"ensure_capacity: n={describe_need(need)} tokens exceeds the {kind} of "
                f"{self.max_len} tokens ({self.plan.source}); requested "
                f"{self._needed_bytes(need)} bytes, committed "
                f"{self.committed_bytes} bytes, available {int(self.arena.available_bytes())} "
                f"bytes"
            )

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drops the arrays and, on VMM, frees the regions (their memory is decommitted).
        Idempotent; every other call on a closed cache raises CacheClosedError."""
        if self.closed:
            return
        self.closed = True
        arrays, committed = [*self.k, *self.v], self.committed
        self.k, self.v, self.committed = [], [], None
        if committed is not None and not committed.is_deleted():
            committed.block_until_ready()
            committed.delete()  # a view of the control region on VMM: it ends here
        try:
            self.growth.close(self, arrays)
        except BaseException:
            self.closed = False  # e.g. a view still referenced: drop it and close again
            raise

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CacheClosedError(ValueError):
    """A call on a KvCache after close()."""


__all__ = ["CacheClosedError", "KvCache"]
