"""SlotCache: an engine's KV cache, one slot per live request, memory per slot.

A slot is row b of every layer's seq-major K and V array [B, S, Hkv, D]: for each of the 2L
bindings one contiguous range of S tokens (S >= max_len). A request takes a free slot,
`ensure_slot(b, n)` commits the granules its first n tokens need, `release_slot(b)` returns
them when it ends. The arrays keep their shape and (on VMM) their pointers for the cache's
life, so one compiled step serves every set of requests.

The write bound the ops take (`committed`, int32 [B]) is each slot's committed tokens; 0 marks
a free slot, which the attention ops neither read nor write (`row_idle`, cuda/gqa_params.h).
On VMM `committed`, `k` and `v` are views the cache writes in place, behind JAX's back: read
host values with `committed_tokens()`. `np.asarray` of a GPU view is a snapshot that JAX keeps
on the array object, so a second `np.asarray` returns the first one's bytes (found on the
H100: a test read `committed` before and after `release_slot` and saw no change).

Memory, by arena:
- VmmArena: each slot's range is whole granules (S rounded up so a slot starts and ends on a
  granule), so a slot's granules are its own. `ensure_slot` commits them (all or nothing),
  `release_slot` unmaps them at once under the live views (`VmmArena.decommit_now`: device
  synchronized first, the read-only zero granule mapped back). `committed_bytes` is physical.
- EagerArena: the arrays are dense XLA buffers for all slots at S, allocated up front. The
  slots' granules are counted the same way (blocks of `granule_bytes`, default 2 MiB) against a
  budget, so the engine's admission and preemption behave as on VMM, but `committed_bytes`
  (physical) stays the dense size: only VMM returns memory.

`held_bytes` (the slots' granules, all bindings) is what admission counts on both; on VMM it
equals `committed_bytes`. Invariant: held_bytes <= live bytes + one granule per (binding,
slot in use).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.cache._lifecycle import closed_on_failure
from jax_kv.cache.capacity import CapacityError
from jax_kv.cache.kv_cache import arena_for
from jax_kv.layout import Layout
from jax_kv.memory import ArenaError, ArenaExhausted, MeshArena, Region, VmmArena
from jax_kv.memory.mesh import REPLICATED, allocate
from jax_kv.parallel import cache_sharding, cache_spec, put_replicated

DEFAULT_GRANULE_BYTES = 2 << 20  # the eager path's accounting block: the H200's VMM granule


class SlotCache:
    """Per-layer K and V arrays [B, S, Hkv, D] (seq-major) whose rows are request slots.

    Args:
        num_layers, num_slots, num_kv_heads, head_dim, dtype: the geometry (L, B, Hkv, D).
        max_len: the most tokens one slot holds (prompt and generated).
        arena: a VmmArena (memory follows the slots) or an EagerArena (dense buffers); the
            default is KvCache's (JAX_KV_ARENA; auto: VMM on CUDA).
        granule_bytes: the eager path's accounting block per binding (default 2 MiB, at
            most one slot's bytes; ignored on VMM, where it is the arena's granule).
        budget_bytes: the most bytes the slots may hold together (all bindings); default:
            on VMM what the arena can commit, on the eager path every slot at max_len.
        prefix_store: reserve a prefix store (VMM only) of as many blocks as all slots hold.
            A block is the fewest tokens that fill whole granules (`block_tokens`); the store
            maps blocks of the slots' granules (no copy), and maps them into other slots.
        mesh: a jax.sharding.Mesh with a "tp" axis (jax_kv.parallel): each array's Hkv axis
            is split over it, every device holding its KV heads of every slot. On VMM the
            arena is a MeshArena (one VmmArena per device, default MeshArena(mesh)): a slot's
            granules are committed on every device or on none. Byte counts (granule,
            token_bytes, held, committed) are totals over the devices.
    """

    layout = Layout.SEQ_MAJOR

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        max_len: int,
        arena: Any = None,
        granule_bytes: int | None = None,
        budget_bytes: int | None = None,
        prefix_store: bool = False,
        mesh: Any = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_len", max_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.num_layers, self.num_slots = int(num_layers), int(num_slots)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.dtype = jnp.dtype(dtype)
        self.max_len = int(max_len)
        self.token_bytes = self.num_kv_heads * self.head_dim * self.dtype.itemsize
        self.mesh = mesh
        self.arena = arena_for(arena, mesh, self.num_kv_heads)
        self.is_vmm = isinstance(self.arena, VmmArena | MeshArena)
        if self.is_vmm:
            self.granule = int(self.arena.granule)
            # A slot spans whole granules and whole tokens (S * token_bytes a multiple of
            # both), so no granule is shared by two slots.
            step = math.lcm(self.granule, self.token_bytes)
            self.slot_bytes = -(-self.max_len * self.token_bytes // step) * step  # per binding
        else:  # dense rows of max_len; granules are only counted (at most one slot's bytes)
            self.slot_bytes = self.max_len * self.token_bytes
            granule = granule_bytes
            if granule is None:
                granule = min(DEFAULT_GRANULE_BYTES, self.slot_bytes)
            if isinstance(granule, bool) or not isinstance(granule, int) or granule < 1:
                raise ValueError(f"granule_bytes: expected an int >= 1, got {granule_bytes!r}")
            self.granule = int(granule)
        self.slot_tokens = self.slot_bytes // self.token_bytes  # S of the arrays
        self.bindings = 2 * self.num_layers
        # XLA's CPU client copies a donated DLPack-imported buffer instead of aliasing it: on
        # the host driver (CI's stand-in for the CUDA arena) a step runs without donation and
        # its output caches are written back into the slots' committed granules. Never on
        # CUDA, where the step writes the arena's memory in place.
        self.writes_back = self.is_vmm and self.arena.driver.kind == "cpu"
        self.write_back_bytes = 0
        self._synchronize = True  # False inside beside_step()
        self.closed = False
        self.lengths = np.zeros((self.num_slots,), np.int32)  # live tokens per slot
        self.granules = np.zeros((self.num_slots,), np.int64)  # per binding, per slot
        self.regions: list[Region] = []
        self._control: Region | None = None
        # The prefix store (VMM): blocks of whole granules, held from a slot that wrote them
        # (the arena keeps their handles, unmapped) and mapped into slots that start with the
        # same tokens. Physical granules are counted once.
        step_tokens = math.lcm(self.granule, self.token_bytes) // self.token_bytes
        self.block_tokens = step_tokens
        self.block_granules = step_tokens * self.token_bytes // self.granule
        if prefix_store and not self.is_vmm:
            raise ValueError("prefix_store: the prefix store needs a VmmArena (shared granules)")
        # A block costs memory while it is cached, so the store needs no more blocks than the
        # arena's memory could back.
        self.store_blocks = 0
        if prefix_store:
            backed = self.arena.capacity_bytes // (self.bindings * step_tokens * self.token_bytes)
            self.store_blocks = min(self.num_slots * self.slot_tokens // step_tokens, backed)
        # store block -> per binding, the handles it holds (VmmArena.hold; on a MeshArena, per
        # device); _held_ids: id() of every held handle, for committed_bytes.
        self.store_held: dict[int, list[Any]] = {}
        self._held_ids: set[int] = set()
        self._store_free = list(range(self.store_blocks - 1, -1, -1))
        self.store_owner: dict[int, tuple[int, int]] = {}  # store block -> (slot, block) it maps
        self.store_refs = np.zeros((self.store_blocks,), np.int64)  # slots mapping each block
        self.slot_cached: list[dict[int, int]] = [{} for _ in range(self.num_slots)]
        self.slot_shared: list[list[int]] = [[] for _ in range(self.num_slots)]
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []
        self.committed: jax.Array | None = None
        # Arguments before any memory: a refusal then leaves nothing to free.
        if budget_bytes is None:
            # Every slot at max_len, in whole granules as admission counts a slot's bytes.
            dense = self.bindings * self.num_slots * self.granules_for(self.slot_tokens)
            self.budget_bytes = None if self.is_vmm else dense * self.granule
        else:
            if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
                raise ValueError(f"budget_bytes: expected an int or None, got {budget_bytes!r}")
            self.budget_bytes = int(budget_bytes)
        with closed_on_failure(self, "SlotCache"):
            self._start()

    # -- construction and teardown -------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layout.cache_shape(
            self.num_slots, self.slot_tokens, self.num_kv_heads, self.head_dim
        )

    def _start(self) -> None:
        if self.is_vmm:
            # Every region first, the views last: a refusal (address space, memory) then leaves
            # no exported view behind, and each view is on self.k / self.v, where close()
            # deletes it, the moment it exists.
            for _ in range(self.bindings):
                self.regions.append(self._allocate(self.num_slots * self.slot_bytes))
            self._control = self._allocate(self.num_slots * 4, replicated=True)
            self._control.commit(self.num_slots * 4)
            self._control.write(0, np.zeros((self.num_slots,), np.int32).tobytes())
            # Its address (held by a recorded CUDA graph) never changes: the host rewrites it.
            self.committed = self._control.export((self.num_slots,), jnp.int32)
            for i, r in enumerate(self.regions):
                (self.k if i < self.num_layers else self.v).append(r.export(self.shape, self.dtype))
        else:
            sharding = cache_sharding(self.mesh, self.layout)
            for i in range(self.bindings):
                array = self.arena.zeros(self.shape, self.dtype, sharding)
                (self.k if i < self.num_layers else self.v).append(array)
            self._write_committed()

    def close(self) -> None:
        """Drops the arrays and frees the memory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        arrays = [*self.k, *self.v]
        if self.committed is not None:
            arrays.append(self.committed)
        self.k, self.v, self.committed = [], [], None
        for a in arrays:
            if not a.is_deleted():
                a.block_until_ready()
                if not self.is_vmm and a.ndim == 4:
                    self.arena.release(a)  # the EagerArena tracks (and deletes) its buffers
                else:
                    a.delete()
        arrays.clear()
        if self.is_vmm:
            regions = [*self.regions, *([self._control] if self._control else [])]
            try:
                self.arena.wait_unviewed(regions)
            except BaseException:
                self.closed = False  # e.g. a view still referenced: drop it and close again
                raise
            for s in list(self.store_held):
                self._release_held(s)
            for r in regions:
                r.free()
            self.regions, self._control = [], None

    def __enter__(self) -> SlotCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ArenaError(f"{what}: this SlotCache is closed")

    def _check_slot(self, what: str, b: Any) -> int:
        if isinstance(b, bool) or not isinstance(b, int | np.integer):
            raise ValueError(f"{what}: slot expected an int, got {b!r}")
        if not 0 <= b < self.num_slots:
            raise ValueError(f"{what}: slot expected in [0, {self.num_slots}), got {b}")
        return int(b)

    # -- accounting ----------------------------------------------------------------------------

    def _check_tokens(self, what: str, b: int, tokens: int) -> None:
        if not 0 <= tokens <= self.max_len:
            raise CapacityError(
                f"{what}: {tokens} tokens outside [0, max_len={self.max_len}] (slot {b})"
            )

    def granules_for(self, tokens: int) -> int:
        """Granules per binding a slot of `tokens` tokens needs."""
        return -(-int(tokens) * self.token_bytes // self.granule)

    def tokens_within(self, nbytes: int) -> int:
        """The most tokens one slot can hold in `nbytes` bytes (all bindings), at most
        max_len: the largest t with bytes_for(t) <= nbytes."""
        granules = int(nbytes) // (self.bindings * self.granule)
        return min(self.max_len, granules * self.granule // self.token_bytes)

    @property
    def block_bytes(self) -> int:
        """One prefix block over all bindings: what a slot's private copy of one holds."""
        return self.bindings * self._block_bytes()

    def bytes_for(self, tokens: int) -> int:
        """Bytes (all bindings) a slot of `tokens` tokens holds."""
        return self.bindings * self.granules_for(tokens) * self.granule

    def committed_tokens(self) -> np.ndarray:
        """int32 [B]: the tokens of each slot backed by its granules (0: a free slot)."""
        backed = self.granules * self.granule // self.token_bytes
        return np.minimum(backed, self.slot_tokens).astype(np.int32)

    @property
    def held_bytes(self) -> int:
        """Bytes the slots' and the store's granules take, all bindings, a shared granule
        once: what admission counts."""
        # Per binding: each slot's own granules (not mapped from the store), and the store's
        # blocks no slot owns (an owned one is the same memory as its slot's granules).
        shared = sum(len(blocks) for blocks in self.slot_shared) * self.block_granules
        used = self.store_blocks - len(self._store_free)
        store_only = (used - len(self.store_owner)) * self.block_granules
        return (int(self.granules.sum()) - shared + store_only) * self.bindings * self.granule

    @property
    def committed_bytes(self) -> int:
        """Physical KV bytes: the regions' distinct granules on VMM (read from the arena),
        the dense buffers otherwise."""
        if self.is_vmm:
            return self.arena.physical_bytes(self.regions, self._held_ids)
        return sum(a.nbytes for a in (*self.k, *self.v))

    @property
    def cached_only_bytes(self) -> int:
        """Bytes of store blocks no slot maps or owns: what evicting them gives back."""
        used = set(range(self.store_blocks)) - set(self._store_free)
        n = sum(1 for s in used if s not in self.store_owner and not self.store_refs[s])
        return n * self.block_granules * self.bindings * self.granule

    @property
    def store_bytes(self) -> int:
        """Bytes of every block in the prefix store, all bindings, each once: those slots
        wrote and own, those slots map (shared), and those no slot maps (cached_only_bytes).
        What Engine(prefix_cache_bytes) caps."""
        used = self.store_blocks - len(self._store_free)
        return used * self.block_granules * self.bindings * self.granule

    @property
    def live_unique_bytes(self) -> int:
        """KV bytes of the live tokens, all bindings, a token of a shared block once."""
        tokens = sum(self.own_tokens(b) for b in range(self.num_slots))
        shared = {s for blocks in self.slot_shared for s in blocks}
        tokens += len(shared - set(self.store_owner)) * self.block_tokens
        return tokens * self.token_bytes * self.bindings

    def own_tokens(self, b: int) -> int:
        """Live tokens of slot b past the blocks it maps from the store."""
        return max(0, int(self.lengths[b]) - len(self.slot_shared[b]) * self.block_tokens)

    @property
    def live_bytes(self) -> int:
        return int(self.lengths.astype(np.int64).sum()) * self.token_bytes * self.bindings

    def available_bytes(self) -> int:
        """Bytes more the slots may take now: the budget's rest, and on VMM what the arena can
        still commit."""
        room = [] if self.budget_bytes is None else [self.budget_bytes - self.held_bytes]
        if self.is_vmm:
            room.append(int(self.arena.available_bytes()))
        return max(0, min(room))

    def floor_bytes(self, slots_in_use: int) -> int:
        """The waste the invariant allows: one granule per (binding, slot in use)."""
        return self.bindings * self.granule * int(slots_in_use)

    def stats(self) -> dict[str, Any]:
        return dict(
            arena="vmm" if self.is_vmm else "eager",
            num_slots=self.num_slots,
            max_len=self.max_len,
            slot_tokens=self.slot_tokens,
            granule=self.granule,
            held_bytes=self.held_bytes,
            committed_bytes=self.committed_bytes,
            live_bytes=self.live_bytes,
            budget_bytes=self.budget_bytes,
        )

    # -- slots ---------------------------------------------------------------------------------

    def ensure_slot(self, b: int, tokens: int) -> int:
        """Commits what slot b needs to hold `tokens` tokens; returns the granules it
        committed per binding (0: it had them).

        Raises:
            CapacityError: tokens > max_len.
            ArenaExhausted: the budget or the arena cannot give the granules; nothing changed.
        """
        self._check_open("ensure_slot")
        b = self._check_slot("ensure_slot", b)
        self._check_tokens("ensure_slot", b, tokens)
        need = self.granules_for(tokens)
        have = int(self.granules[b])
        if need <= have:
            return 0
        extra = (need - have) * self.granule * self.bindings
        if extra > self.available_bytes():
            raise ArenaExhausted(
                f"ensure_slot: slot {b} needs {extra} more bytes for {tokens} tokens; the slots "
                f"hold {self.held_bytes} bytes and {self.available_bytes()} more are available"
            )
        if self.is_vmm:
            base = b * self.slot_bytes
            self.arena.commit(
                [(r, base + have * self.granule, base + need * self.granule) for r in self.regions]
            )
        self.granules[b] = need
        self._write_committed()
        return need - have

    def release_slot(self, b: int) -> int:
        """Returns slot b's granules (its data reads as zeros after); returns the bytes freed.
        No step may be in flight that reads or writes slot b: on VMM the device is synchronized
        first, except inside beside_step()."""
        self._check_open("release_slot")
        b = self._check_slot("release_slot", b)
        held = int(self.granules[b])
        self.lengths[b] = 0
        if held == 0:
            return 0
        freed = held - self._drop_store_links(b)
        self.granules[b] = 0
        self._write_committed()  # the bound first: no later step may write the slot
        if self.is_vmm:
            base = b * self.slot_bytes
            self.arena.decommit_now(
                [(r, base, base + held * self.granule) for r in self.regions],
                synchronize=self._synchronize,
            )
        return freed * self.granule * self.bindings

    def _drop_store_links(self, b: int) -> int:
        """Unlinks slot b from the prefix store (the blocks it maps lose a reference, the
        blocks it wrote become the store's alone); returns the granules per binding those
        were, which are not slot b's to free."""
        linked = (len(self.slot_shared[b]) + len(self.slot_cached[b])) * self.block_granules
        for s in self.slot_shared[b]:
            self.store_refs[s] -= 1
        for s in self.slot_cached[b].values():
            del self.store_owner[s]  # the store's hold keeps those granules
        self.slot_shared[b], self.slot_cached[b] = [], {}
        return linked

    def links_within(self, b: int, tokens: int) -> tuple[bool, list[int]]:
        """Slot b's links to the prefix store among the granules `tokens` tokens take (the
        ones hand_over keeps): whether it maps store blocks there, and the store blocks it
        wrote there (the store holds them)."""
        keep = min(int(self.granules[b]), self.granules_for(tokens))
        blocks = -(-keep // self.block_granules) if self.block_granules else 0
        wrote = [s for k, s in self.slot_cached[b].items() if k < blocks]
        return keep > 0 and bool(self.slot_shared[b]), wrote

    def hands_over_in_place(self, b: int, tokens: int) -> bool:
        """Whether hand_over(b, tokens) keeps the granules as they are: none of those it keeps
        is linked to the prefix store (else fresh ones replace them)."""
        shared, wrote = self.links_within(b, tokens)
        return not shared and not wrote

    def hand_over(self, b: int, tokens: int) -> int:
        """Gives slot b, as it is, to a new request that needs `tokens` tokens: the granules those
        take stay mapped (no unmap, no map, no zero fill: ~7 driver calls per granule and binding
        saved against release_slot then ensure_slot), the rest are released. Where the prefix store
        holds or maps some of its granules (they hold the old request's tokens, cached), the
        granules the new request takes are replaced in place by fresh ones instead
        (VmmArena.recommit: no zero granule mapped between, ~3 calls per granule and binding saved),
        and the slot's store mappings are dropped as release_slot drops them; links past those
        granules (links_within) leave the kept ones in place. Returns the bytes freed (negative
        where fresh granules were committed). The old request's bytes past the new one's tokens stay
        until it writes them: the ops never read past a row's length. No step may be in flight that
        reads or writes slot b: as for release_slot, the device is synchronized first (once), except
        inside beside_step().

        Raises:
            CapacityError: tokens > max_len.
            ArenaExhausted: the fresh granules could not be committed; slot b is then
                released (as release_slot leaves it).
        """
        self._check_open("hand_over")
        b = self._check_slot("hand_over", b)
        self._check_tokens("hand_over", b, tokens)
        held = int(self.granules[b])
        keep = min(held, self.granules_for(tokens))
        in_place = self.hands_over_in_place(b, tokens)
        own = held - self._drop_store_links(b)
        self.lengths[b] = 0
        self.granules[b] = keep
        self._write_committed()
        if self.is_vmm:
            base, g = b * self.slot_bytes, self.granule
            synchronize = self._synchronize  # once: the first of the two unmaps waits
            if keep < held:
                self.arena.decommit_now(
                    [(r, base + keep * g, base + held * g) for r in self.regions],
                    synchronize=synchronize,
                )
                synchronize = False
            if not in_place and keep:
                try:
                    self.arena.recommit(
                        [(r, base, base + keep * g) for r in self.regions], synchronize=synchronize
                    )
                except BaseException:
                    self.granules[b] = 0  # recommit left the range decommitted
                    self._write_committed()
                    raise
        return (own - keep) * self.granule * self.bindings  # own == held where owned

    @contextlib.contextmanager
    def beside_step(self) -> Iterator[None]:
        """Inside it, release_slot unmaps without synchronizing the device, so the unmaps
        overlap a step in flight. For a caller whose step in flight leaves every slot released
        here idle (evict unmaps nothing: the store holds handles, and a block a slot maps is
        never evicted).
        Idle: length 0 and, for a decode row, write bound 0; for a prefill call's row, no
        packed tokens. A prefill call takes `committed` as its bound, and release_slot
        rewrites it in place while the call runs: the kernel reads a row's bound only for its
        packed tokens, and the other rows' values are rewritten unchanged."""
        previous, self._synchronize = self._synchronize, False
        try:
            yield
        finally:
            self._synchronize = previous

    # -- the prefix store (VMM) ----------------------------------------------------------------

    def _block_bytes(self) -> int:
        return self.block_granules * self.granule

    def cache_block(self, b: int, k: int) -> int | None:
        """Puts slot b's block k (whole granules it committed and wrote) in a free store
        block: the arena holds its handles (no copy, no mapping, no driver call), so they
        outlive the slot's release. Returns the store block, or None if the store is full."""
        if not self._store_free:
            return None
        if (k + 1) * self.block_granules > int(self.granules[b]) or k < len(self.slot_shared[b]):
            raise ValueError(f"cache_block: block {k} of slot {b} is not its own and committed")
        s, n = self._store_free[-1], self._block_bytes()
        held: list[Any] = []
        try:
            for slot_region in self.regions:
                held.append(self.arena.hold(slot_region, b * self.slot_bytes + k * n, n))
        except BaseException:
            for handles in held:
                self.arena.release_held(handles)
            raise
        self.store_held[s] = held
        self._held_ids.update(map(id, _flat(held)))
        self._store_free.pop()
        self.store_owner[s] = (b, k)
        self.slot_cached[b][k] = s
        return s

    def map_cached(self, b: int, blocks: list[int]) -> None:
        """Maps store blocks (in order) as the first blocks of free slot b, read-only: the
        slot then starts with their tokens, computed once by another request."""
        if self.granules[b] or not blocks:
            raise ValueError(f"map_cached: slot {b} must be free and blocks non-empty")
        n = self._block_bytes()
        done: list[tuple[Region, int, int]] = []
        try:
            for i, s in enumerate(blocks):
                for slot_region, handles in zip(self.regions, self.store_held[s], strict=True):
                    dst = b * self.slot_bytes + i * n
                    self.arena.map_held(handles, slot_region, dst)
                    done.append((slot_region, dst, dst + n))
        except BaseException:
            self.arena.decommit_now(done)
            raise
        for s in blocks:
            self.store_refs[s] += 1
        self.slot_shared[b] = list(blocks)
        self.granules[b] = len(blocks) * self.block_granules
        self._write_committed()

    def map_partial(self, b: int, k: int, s: int) -> int:
        """Makes slot b's block k a private copy of store block s (a partly filled block
        another request wrote): the store's handles are mapped there, then copied on write,
        so the slot appends to its own granules. Slot b holds exactly k blocks (those mapped
        by map_cached, or none). Returns the granules copied."""
        if int(self.granules[b]) != k * self.block_granules:
            raise ValueError(f"map_partial: slot {b} must hold exactly {k} blocks")
        copy = self.block_bytes
        if copy > self.available_bytes():  # the copy is the slot's own memory: budgeted
            raise ArenaExhausted(
                f"map_partial: slot {b}'s copy of block {s} needs {copy} bytes; the slots hold "
                f"{self.held_bytes} bytes and {self.available_bytes()} more are available"
            )
        n = self._block_bytes()
        dst = b * self.slot_bytes + k * n
        done: list[tuple[Region, int, int]] = []
        copies = 0
        try:
            for slot_region, handles in zip(self.regions, self.store_held[s], strict=True):
                self.arena.map_held(handles, slot_region, dst)
                done.append((slot_region, dst, dst + n))
            for slot_region in self.regions:
                # Inside beside_step the slot is idle in the call in flight: nothing reads
                # the mapping being replaced, so the copy need not wait for the call.
                copies += self.arena.copy_on_write(
                    slot_region, dst, n, synchronize=self._synchronize
                )
        except BaseException:
            self.arena.decommit_now(done)
            raise
        self.granules[b] = (k + 1) * self.block_granules
        self._write_committed()
        return copies

    def evict(self, s: int) -> int:
        """Drops store block s (no slot may map it); returns the physical bytes freed (0 when
        the slot that wrote it still holds them). No driver call but cuMemRelease of handles
        past the arena's pool target."""
        if self.store_refs[s]:
            raise ValueError(f"evict: store block {s} is mapped by {self.store_refs[s]} slot(s)")
        freed = self._release_held(s)
        self._store_free.append(s)
        owner = self.store_owner.pop(s, None)
        if owner is not None:
            del self.slot_cached[owner[0]][owner[1]]
        return freed

    def _release_held(self, s: int) -> int:
        held = self.store_held.pop(s)
        self._held_ids.difference_update(map(id, _flat(held)))
        return sum(self.arena.release_held(handles) for handles in held)

    def _write_committed(self) -> None:
        values = np.ascontiguousarray(self.committed_tokens(), np.int32)
        if self._control is not None:  # on every device under a mesh
            self._control.write(0, values.tobytes())
        else:
            self.committed = put_replicated(values, self.mesh)

    def _allocate(self, nbytes: int, replicated: bool = False) -> Any:
        """A region of the arena; under a mesh laid out as the cache arrays (Hkv split) or,
        for the per-row control values, replicated on every device."""
        return allocate(self.arena, nbytes, REPLICATED if replicated else cache_spec(self.layout))

    # -- the step protocol ---------------------------------------------------------------------

    def accept(self, k: list[jax.Array], v: list[jax.Array], *, verify: bool = True) -> None:
        """Takes a step's output caches (the inputs were donated). On VMM they must be the
        arena's memory (a moved pointer: the cache was not donated)."""
        self._check_open("accept")
        if self.writes_back:
            self._write_back([*k, *v])
            return
        if verify:
            if len(k) != self.num_layers or len(v) != self.num_layers:
                raise ValueError(
                    f"accept: expected {self.num_layers} K and V arrays, got {len(k)}, {len(v)}"
                )
            for i, a in enumerate((*k, *v)):
                if tuple(a.shape) != self.shape or a.dtype != self.dtype:
                    raise ValueError(
                        f"accept: array {i} expected {self.dtype.name} {list(self.shape)}, got "
                        f"{a.dtype} {list(a.shape)}"
                    )
                if self.is_vmm and not self.regions[i].holds(a):
                    a.block_until_ready()  # a failed step's error is the cause: raised here
                    raise ArenaError(
                        f"accept: output cache {i} is not the arena's memory (it moved): "
                        f"donate the cache arrays to the step so XLA updates them in place"
                    )
        self.k, self.v = list(k), list(v)

    def _write_back(self, outputs: list[jax.Array]) -> None:
        """The host driver's path (see `writes_back`): each slot's committed bytes of the
        step's outputs go back into its granules; the outputs are dropped, the views stay."""
        spans = []
        for b in np.flatnonzero(self.granules):
            # The leading shared blocks are mapped read-only and no step writes them.
            skip = len(self.slot_shared[b]) * self._block_bytes()
            lo = int(b) * self.slot_bytes + skip
            spans.append((lo, int(self.granules[b]) * self.granule - skip))
        for region, out in zip(self.regions, outputs, strict=True):
            self.write_back_bytes += region.write_spans(out, spans)
            out.delete()


def _flat(held: list[Any]) -> Iterator[Any]:
    """The handles of one store block: per binding, VmmArena.hold's tuple of handles, or
    MeshArena.hold's list of them (one tuple per device)."""
    for handles in held:
        for part in handles if isinstance(handles, list) else (handles,):
            yield from part


__all__ = ["DEFAULT_GRANULE_BYTES", "SlotCache"]
