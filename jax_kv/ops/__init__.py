"""GQA attention and KV-growth ops over XLA FFI custom calls (CPU reference and CUDA)."""

from jax_kv.ops.gqa_decode import gqa_decode
from jax_kv.ops.gqa_prefill import gqa_prefill, gqa_prefill_packed
from jax_kv.ops.grow_cache import grow_cache

__all__ = ["gqa_decode", "gqa_prefill", "gqa_prefill_packed", "grow_cache"]
