"""The plain-JAX comparator implements the same contract as the ops: checked against the
float64 reference like the handlers are."""

import jax.numpy as jnp
import numpy as np
import pytest
from inputs import caches, randn
from reference import assert_close, gqa_attention_ref

from jax_kv import Layout
from jax_kv.ops.xla_attention import xla_gqa_decode, xla_gqa_prefill


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.name)
def test_xla_prefill_and_decode_match_reference(rng, layout):
    B, T, Hq, Hkv, D, S = 3, 5, 8, 2, 64, 24
    kc, vc = caches(rng, layout, B, S, Hkv, D, jnp.float32)
    q, k, v = (
        randn(rng, (B, T, Hq, D), jnp.float32),
        *(randn(rng, (B, T, Hkv, D), jnp.float32) for _ in range(2)),
    )
    lengths, new = np.array([0, 4, S - T], np.int32), np.array([5, 2, 0], np.int32)
    out, kc2, vc2 = xla_gqa_prefill(
        q, k, v, kc, vc, jnp.asarray(lengths), new_lengths=jnp.asarray(new), layout=layout, window=3
    )
    ref, ref_kc, ref_vc = gqa_attention_ref(
        q, k, v, kc, vc, lengths, new, layout=int(layout), window=3
    )
    assert_close(out, ref, "float32")
    np.testing.assert_array_equal(np.asarray(kc2, np.float64), ref_kc)
    np.testing.assert_array_equal(np.asarray(vc2, np.float64), ref_vc)
    lengths = np.array([1, 6, S - 1], np.int32)
    out, _, _ = xla_gqa_decode(
        q[:, 0], k[:, 0], v[:, 0], kc, vc, jnp.asarray(lengths), layout=layout, softcap=2.0
    )
    ref, _, _ = gqa_attention_ref(
        q[:, :1], k[:, :1], v[:, :1], kc, vc, lengths, layout=int(layout), softcap=2.0
    )
    assert_close(out, ref[:, 0], "float32")
