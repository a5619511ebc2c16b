"""KvCache: per-layer K and V arrays, host-side lengths, and growth with a named reason.

capacity.py plans capacities (hard max, VMM reservation, buckets); events.py holds
GrowthEvent and its reasons; growth.py holds the three strategies below, one chosen when
a cache is built; kv_cache.py holds KvCache, the protocol they share. slots.py holds
SlotCache, the engine's cache: one slot per request, memory committed and returned per slot.

Three growth paths (DESIGN.md, Layout and Memory):

| path | arrays | bytes moved | pointer | shape | compiled step |
|---|---|---|---|---|---|
| seq-major on VMM | reserved at max_len, exported once | 0 | same | same | kept |
| head-major on VMM | re-strided in place on the device | live bytes | same | grows | invalidated |
| any layout, EagerArena | new buffers via grow_cache | live bytes | new | grows | invalidated |

Seq-major under VMM commits memory in steps of `commit_ahead` tokens (default one min_bucket),
following the live prefix; the shape-changing paths grow by power-of-two buckets (floor
min_bucket, default 256), so recompiles stay logarithmic in the length.
"""

from jax_kv.cache.capacity import (
    INT32_MAX,
    CapacityError,
    CapacityPlan,
    bucket_for,
    resolve_capacity,
)
from jax_kv.cache.events import (
    REASON_EAGER,
    REASON_HEAD_VMM,
    REASON_NONE,
    REASON_SEQ_VMM,
    GrowthEvent,
    GrowthReason,
)
from jax_kv.cache.growth import (
    EagerGrowth,
    GrowthStrategy,
    HeadMajorVmmGrowth,
    SeqMajorVmmGrowth,
)
from jax_kv.cache.kv_cache import CacheClosedError, KvCache
from jax_kv.cache.slots import SlotCache

__all__ = [
    "INT32_MAX",
    "REASON_EAGER",
    "REASON_HEAD_VMM",
    "REASON_NONE",
    "REASON_SEQ_VMM",
    "CacheClosedError",
    "CapacityError",
    "CapacityPlan",
    "EagerGrowth",
    "GrowthEvent",
    "GrowthReason",
    "GrowthStrategy",
    "HeadMajorVmmGrowth",
    "KvCache",
    "SeqMajorVmmGrowth",
    "SlotCache",
    "bucket_for",
    "resolve_capacity",
]
