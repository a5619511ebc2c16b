"""The engine's prefix cache: full blocks of requests' tokens, held once in the SlotCache's
store and mapped into every slot whose tokens start the same way (no page table: a slot is a
virtual range, so a shared block is ordinary cache memory to the kernels).

A block is `SlotCache.block_tokens` tokens (the fewest that fill whole granules: 1,024 for
Llama-3-8B's 8x128 bf16 heads, 8,192 for Qwen2.5-0.5B's 2x64, on a 2 MiB granule). Blocks are
indexed by a chained hash (block k's key hashes block k-1's key with its own tokens), and a hit
is confirmed by comparing the tokens and the parent block, never by the hash alone. Blocks no
running slot maps are evicted partial blocks first, then least recently used first among the
chains' leaves, so a prefix loses its tail before its root (SGLang's radix cache evicts its
leaves least recently used, with no partial-first tier; vLLM caches full blocks only).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection

from jax_kv.cache import SlotCache


@dataclasses.dataclass(eq=False)
class Block:
    key: int
    tokens: tuple[int, ...]
    parent: Block | None
    store: int  # the SlotCache store block holding its K/V
    children: list[Block] = dataclasses.field(default_factory=list)
    # A block its writer ended in, with fewer tokens than a block holds: a request that
    # continues it maps a private copy of it (copy on write) and appends there.
    partial: bool = False


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    cached_blocks: int = 0  # blocks put in the store
    evicted_blocks: int = 0
    partial_hits: int = 0  # hits that ended in a partial block (each one copy on write)


class PrefixCache:
    def __init__(self, cache: SlotCache) -> None:
        self.cache = cache
        self.block_tokens = cache.block_tokens
        self.index: dict[int, list[Block]] = {}
        self.by_store: collections.OrderedDict[int, Block] = collections.OrderedDict()  # LRU
        self.partials: dict[int, list[Block]] = {}  # by their parent's key (0: none)
        self.stats = PrefixStats()

    @staticmethod
    def _key(parent: Block | None, tokens: tuple[int, ...]) -> int:
        return hash((0 if parent is None else parent.key, tokens))

    def _find(self, parent: Block | None, tokens: tuple[int, ...]) -> Block | None:
        for block in self.index.get(self._key(parent, tokens), ()):
            if block.parent is parent and block.tokens == tokens:
                return block
        return None

    def lookup(self, token_at: Callable[[int], int], most: int) -> tuple[list[Block], Block | None]:
        """The longest chain of cached full blocks the first `most` tokens start with, and
        the longest partial block continuing it within them (or None); marks them used. The
        stats count them when an admission used them (`count_hits`), not here: a request
        that waits for memory looks up again each step."""
        chain: list[Block] = []
        bt = self.block_tokens
        for k in range(most // bt):
            tokens = tuple(token_at(i) for i in range(k * bt, (k + 1) * bt))
            block = self._find(chain[-1] if chain else None, tokens)
            if block is None:
                break
            chain.append(block)
        start = len(chain) * bt
        partial = None
        for block in self.partials.get(chain[-1].key if chain else 0, ()):
            n = len(block.tokens)
            if block.parent is (chain[-1] if chain else None) and start + n <= most:
                if (partial is None or n > len(partial.tokens)) and all(
                    token_at(start + i) == t for i, t in enumerate(block.tokens)
                ):
                    partial = block
        for block in [*chain, *([partial] if partial else [])]:
            self.by_store.move_to_end(block.store)
        return chain, partial

    def count_hits(self, chain: list[Block], partial: Block | None) -> None:
        """Counts one admission's lookup and the blocks it was admitted with."""
        self.stats.lookups += 1
        self.stats.hit_blocks += len(chain)
        self.stats.hit_tokens += len(chain) * self.block_tokens + (
            len(partial.tokens) if partial else 0
        )
        self.stats.partial_hits += partial is not None

    def insert(self, slot: int, k: int, parent: Block | None, tokens: tuple[int, ...]) -> Block:
        """Caches block k of `slot` (its own, written), child of `parent`; returns the block
        (an equal one already cached is returned instead, and the slot's stays its own)."""
        found = self._find(parent, tokens)
        if found is not None:
            self.by_store.move_to_end(found.store)
            return found
        store = self.cache.cache_block(slot, k)
        if store is None and self._evict_one():
            store = self.cache.cache_block(slot, k)
        if store is None:
            return None  # type: ignore[return-value]  # the store is full of mapped blocks
        block = Block(self._key(parent, tokens), tokens, parent, store)
        self.index.setdefault(block.key, []).append(block)
        self.by_store[store] = block
        if parent is not None:
            parent.children.append(block)
        self.stats.cached_blocks += 1
        return block

    def insert_partial(
        self, slot: int, k: int, parent: Block | None, tokens: tuple[int, ...]
    ) -> Block | None:
        """Caches block k of `slot`, which holds only `tokens` (its writer ends there)."""
        key = 0 if parent is None else parent.key
        for block in self.partials.get(key, ()):
            if block.parent is parent and block.tokens[: len(tokens)] == tokens:
                self.by_store.move_to_end(block.store)
                return block  # as long or longer: nothing to add
        store = self.cache.cache_block(slot, k)
        if store is None and self._evict_one():
            store = self.cache.cache_block(slot, k)
        if store is None:
            return None
        block = Block(self._key(parent, tokens), tokens, parent, store, partial=True)
        self.partials.setdefault(key, []).append(block)
        self.by_store[store] = block
        if parent is not None:
            parent.children.append(block)
        self.stats.cached_blocks += 1
        return block

    def _evictable(self, block: Block) -> bool:
        return not self.cache.store_refs[block.store]

    def _drop(self, block: Block) -> int:
        """Evicts `block` and every block cached after it (children first)."""
        freed = 0
        for child in list(block.children):
            freed += self._drop(child)
        freed += self.cache.evict(block.store)
        del self.by_store[block.store]
        table, key = (
            (self.partials, 0 if block.parent is None else block.parent.key)
            if block.partial
            else (self.index, block.key)
        )
        same = table[key]
        same.remove(block)
        if not same:
            del table[key]
        if block.parent is not None:
            block.parent.children.remove(block)
        self.stats.evicted_blocks += 1
        return freed

    def _victim(self, also: Callable[[Block], bool]) -> Block | None:
        """The evictable block passing `also` to drop next: the least recently used partial
        block, else the least recently used leaf; never a block with children.

        A partial block costs a whole block's memory for fewer tokens and serves only the
        request that continues its writer exactly (a chat turn); a full block serves every
        request that shares the prefix up to it. Measured (H100, 64 groups x 4 prompts at 4
        requests/s, cache capped at one copy of every group's system prompt): in plain LRU
        order the ended requests' partial blocks pushed the system prompts out between a
        group's requests, and 10.7% of the prompts' tokens hit. The cost: under a cap that is
        reached, a chat's next turn prefills again the partial block its previous turn ended
        in (up to block_tokens - 1 tokens: 1,023 for Llama-3-8B, 8,191 for Qwen2.5-0.5B).
        Among full blocks only a leaf goes: a chain's root is touched before its tail but is
        worth more (every longer prefix needs it), and dropping a block drops every block
        cached after it. A block with children is not a victim: an evictable subtree has an
        evictable leaf, and a block whose children fail `also` may have a running request's
        own blocks below it (found in review: a request that found another's equal block
        writes its next ones as that block's children), which dropping it would cut off from
        every lookup while they still count in the store."""
        leaf = None
        for block in self.by_store.values():
            if self._evictable(block) and also(block):
                if block.partial:
                    return block
                if leaf is None and not block.children:
                    leaf = block
        return leaf

    def _evict_one(self) -> bool:
        victim = self._victim(lambda b: True)
        if victim is None:
            return False
        self._drop(victim)
        return True

    def evict_partials(self, stores: list[int]) -> int:
        """Evicts those of the store blocks `stores` (one slot wrote them) that are partial
        blocks no slot maps, so that the slot's granules can be reused in place; returns how
        many. A partial block is a request's own tail, of use only to a request continuing
        that one; a full block may start many (a system prompt) and is kept."""
        dropped = 0
        for s in stores:
            block = self.by_store.get(s)
            if block is not None and block.partial and self._evictable(block):
                self._drop(block)
                dropped += 1
        return dropped

    def trim_to(self, nbytes: int, ended: Collection[int] = ()) -> int:
        """Evicts blocks no slot maps (in `_victim`'s order) until the store holds at most
        `nbytes` (cache.store_bytes) or none is left to evict; returns how many. The blocks
        of the `ended` slots (requests that ended, their slots not yet released) count as
        no slot's: a partial block an ending request just cached goes before a full block
        another request may share."""
        owner, dropped = self.cache.store_owner, 0
        while self.cache.store_bytes > nbytes:
            victim = self._victim(lambda b: b.store not in owner or owner[b.store][0] in ended)
            if victim is None:
                break
            self._drop(victim)
            dropped += 1
        return dropped

    def evict_for(self, nbytes: int) -> int:
        """Evicts blocks no slot maps (in `_victim`'s order) until `nbytes` of physical memory
        are freed (or none is left to evict); returns the bytes freed. Blocks whose slot still
        holds their granules free nothing and are kept."""
        freed = 0
        while freed < nbytes:
            victim = self._victim(lambda b: b.store not in self.cache.store_owner)
            if victim is None:
                break
            freed += self._drop(victim)
        return freed
