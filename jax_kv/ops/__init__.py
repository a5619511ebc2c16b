"""GQA attention and KV-growth ops over XLA FFI custom calls (CPU reference and CUDA)."""

from jax_kv.ops.gqa_decode import gqa_decode
from jax_kv.ops.gqa_prefill import gqa_prefill
from jax_kv.ops.grow_cache import grow_cache

__all__ = ["gqa_decode", "gqa_prefill", "grow_cache"]
