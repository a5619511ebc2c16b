"""grow_cache: out-of-place growth of one cache array (XLA FFI target jax_kv_grow_cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kv import _ffi
from jax_kv.layout import Layout
from jax_kv.ops import _common


def grow_cache(
    cache: jax.Array,
    lengths: jax.Array,
    new_capacity: int,
    *,
    layout: Layout | str | int,
) -> jax.Array:
    """A copy of `cache` with capacity `new_capacity`, moving only the live prefix.

    The path without VMM (and head-major, whose per-head stride is the capacity): bytes moved
    are the live bytes, sum(lengths) * Hkv * D * itemsize. Positions past lengths[b] in the
    new cache are zeros.

    Args:
        cache: [B, Hkv, S, D] (HEAD_MAJOR) or [B, S, Hkv, D] (SEQ_MAJOR).
        lengths: int32 [B], live tokens per sequence, 0 <= lengths <= S.
        new_capacity: S_new >= S (a static int).
        layout: the cache's Layout.

    Returns:
        the grown cache, [B, Hkv, S_new, D] or [B, S_new, Hkv, D].
    """
    _ffi.register()
    layout = Layout.parse(layout)
    if jnp.dtype(cache.dtype) not in _common.SUPPORTED_DTYPES:
        raise ValueError(
            f"cache: expected dtype bfloat16, float16 or float32, got {_common.describe(cache)}"
        )
    B, S, Hkv, D = layout.dims_of(cache.shape)
    if isinstance(new_capacity, bool) or int(new_capacity) != new_capacity or new_capacity < S:
        raise ValueError(
            f"new_capacity: expected an int >= the current capacity S={S}, got {new_capacity!r}"
        )
    if new_capacity > 2**31 - 1:
        raise ValueError(f"new_capacity: expected <= 2**31 - 1, got {new_capacity}")
    known = _common.check_lengths("lengths", lengths, B)
    if known is not None:
        for b, x in enumerate(known):
            if not 0 <= x <= S:
                raise ValueError(
                    f"lengths: expected 0 <= lengths[b] <= capacity S={S}, "
                    f"got lengths[{b}]={int(x)}"
                )
    new_shape = layout.cache_shape(B, int(new_capacity), Hkv, D)
    call = jax.ffi.ffi_call(
        "jax_kv_grow_cache",
        (jax.ShapeDtypeStruct(new_shape, cache.dtype), jax.ShapeDtypeStruct((B,), jnp.int32)),
        vmap_method="sequential",
    )
    new_cache, _ = call(
        cache, lengths, layout=_common.attention_attrs(layout, D, None, None, None)["layout"]
    )
    return new_cache
