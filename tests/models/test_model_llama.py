"""The decoder's cache plumbing on a seeded random model: donated caches stay in place,
ragged batches decode like single prompts, both layouts agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_loop import greedy_static

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.models import llama


@pytest.mark.parametrize("layout", [Layout.HEAD_MAJOR, Layout.SEQ_MAJOR], ids=lambda x: x.name)
def test_donated_caches_keep_their_pointer(layout):
    model = jm.random_model("tiny-llama")
    caches = llama.init_caches(model.config, 2, 16, layout=layout)
    lengths = jnp.zeros((2,), jnp.int32)
    _, caches = llama.prefill_jit(
        model.params,
        model.config,
        jnp.ones((2, 4), jnp.int32),
        None,
        caches,
        lengths,
        layout=layout,
    )
    lengths = lengths + 4
    pointers = [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in caches]
    for step in range(3):
        _, caches = llama.decode_step_jit(
            model.params,
            model.config,
            jnp.full((2,), step, jnp.int32),
            caches,
            lengths,
            layout=layout,
        )
        lengths = lengths + 1
        assert [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in caches] == (
            pointers
        )


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_ragged_batch_and_layouts_agree_with_single_prompts(name):
    model = jm.random_model(name, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (7, 3)]
    batch = greedy_static(model.params, model.config, prompts, 6, layout=Layout.HEAD_MAJOR)
    for prompt, got in zip(prompts, batch, strict=True):
        assert model.generate_greedy(prompt, 6, layout=Layout.SEQ_MAJOR) == got


def test_stop_tokens_end_a_row():
    model = jm.random_model("tiny-llama", seed=2)
    free = model.generate_greedy([5, 6, 7], 8)
    stop = free[3]
    first = free.index(stop)
    got = greedy_static(model.params, model.config, [[5, 6, 7]], 8, stop_tokens=[stop])
    assert got == [free[: first + 1]]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_fused_projections_compute_the_same_model(name):
    """One q/k/v and one gate/up matmul per layer: the logits of prefill and of a decode step
    match the separate weights' (float32), the fused layer has no separate weights left, the
    separate arrays are freed, and fusing twice changes nothing."""
    model = jm.random_model(name, seed=3)
    fused = jm.random_model(name, seed=3)
    old = fused.params["layers"][0]["wq"]
    fused.fuse_projections()
    layer = fused.params["layers"][0]
    assert "wqkv" in layer and "w_gate_up" in layer and "wq" not in layer and "w_up" not in layer
    assert ("bqkv" in layer) == model.config.qkv_bias
    assert old.is_deleted()
    before = jax.tree_util.tree_leaves(fused.params)
    fused.fuse_projections()
    assert all(a is b for a, b in zip(before, jax.tree_util.tree_leaves(fused.params), strict=True))

    def run(m):
        caches = llama.init_caches(m.config, 2, 32, layout=Layout.SEQ_MAJOR)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)
        lengths = jnp.zeros((2,), jnp.int32)
        first, caches = llama.prefill_jit(
            m.params, m.config, tokens, None, caches, lengths, layout=Layout.SEQ_MAJOR
        )
        step, _ = llama.decode_step_jit(
            m.params, m.config, tokens[:, 0], caches, lengths + 9, layout=Layout.SEQ_MAJOR
        )
        return np.asarray(first), np.asarray(step)

    for want, got in zip(run(model), run(fused), strict=True):
        scale = np.abs(want).max()
        assert np.isfinite(got).all() and scale > 1.0
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
