"""jax_kv: a static-shape KV cache that costs only the memory it uses, GQA attention kernels
that read only the live tokens, and a generation loop whose compiled step survives growth."""

from jax_kv.cache import GrowthEvent, KvCache
from jax_kv.decode import GenerationResult, GenerationStats, Generator, Sampling
from jax_kv.engine import Engine
from jax_kv.layout import KvStrides, Layout
from jax_kv.ops import gqa_decode, gqa_prefill, gqa_prefill_packed, grow_cache

__version__ = "0.1.0.dev0"

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "GrowthEvent",
    "KvCache",
    "KvStrides",
    "Layout",
    "Sampling",
    "gqa_decode",
    "gqa_prefill",
    "gqa_prefill_packed",
    "grow_cache",
    "__version__",
]
