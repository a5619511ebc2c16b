"""grow_cache on CPU: the live prefix moves, the rest of the new cache is zero, both layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inputs import DTYPES, randn
from reference import grow_cache_ref

from jax_kv import Layout, grow_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
@pytest.mark.parametrize("new_capacity", [48, 96])
def test_grow_matches_reference(rng, layout, dtype, new_capacity):
    B, S, Hkv, D = 5, 48, 3, 64
    cache = randn(rng, layout.cache_shape(B, S, Hkv, D), dtype)
    lengths = np.array([0, 1, S, 17, int(rng.integers(0, S + 1))], np.int32)
    grown = jax.jit(lambda c, n: grow_cache(c, n, new_capacity, layout=layout))(
        cache, jnp.asarray(lengths)
    )
    assert grown.shape == layout.cache_shape(B, new_capacity, Hkv, D)
    assert grown.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(grown, np.float64),
        grow_cache_ref(cache, lengths, new_capacity, layout=int(layout)),
    )
