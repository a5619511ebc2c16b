"""jax_kv: a static-shape KV cache that costs only the memory it uses, and GQA attention
kernels that read only the live tokens, usable inside jax.jit."""

from jax_kv.cache import GrowthEvent, KvCache
from jax_kv.layout import KvStrides, Layout
from jax_kv.ops import gqa_decode, gqa_prefill, grow_cache

__version__ = "0.1.0.dev0"

__all__ = [
    "GrowthEvent",
    "KvCache",
    "KvStrides",
    "Layout",
    "gqa_decode",
    "gqa_prefill",
    "grow_cache",
    "__version__",
]
