"""Params stacked over the layers (llama.stack_layers, Model.stack_layers): one [num_layers,
...] array per weight, read as a static slice inside the step. The same model in a dozen
parameter leaves: prefill and decode logits equal the per-layer form's bit for bit (float32,
both projection forms, either order of fusing and stacking), the Generator's and the Engine's
greedy tokens equal, a jitted step's argument count stops following the layer count, and the
per-layer arrays are freed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.engine import Engine
from jax_kv.layout import Layout
from jax_kv.memory import EagerArena
from jax_kv.models import llama


def four_layers(name, seed):
    """The preset with 4 layers: a stacked weight's slices must come back in order."""
    return jm.random_model(dataclasses.replace(jm.PRESETS[name], num_layers=4), seed=seed)


def logits_of(model, layout=Layout.SEQ_MAJOR):
    """Prefill logits of 2 prompts of 9 tokens, then one decode step's, [2, 9, V] and [2, V]."""
    caches = llama.init_caches(model.config, 2, 32, layout=layout)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)
    lengths = jnp.zeros((2,), jnp.int32)
    first, caches = llama.prefill_jit(
        model.params, model.config, tokens, None, caches, lengths, layout=layout
    )
    step, _ = llama.decode_step_jit(
        model.params, model.config, tokens[:, 0], caches, lengths + 9, layout=layout
    )
    return np.asarray(first), np.asarray(step)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("order", ["stack", "fuse-then-stack", "stack-then-fuse"])
def test_stacked_params_compute_the_same_logits_bit_for_bit(name, order):
    want = logits_of(four_layers(name, 3))
    model = four_layers(name, 3)
    n_layers = model.config.num_layers
    old = model.params["layers"][1]["wo"]
    steps = {"stack": ["stack"], "fuse-then-stack": ["fuse", "stack"],
             "stack-then-fuse": ["stack", "fuse"]}[order]  # fmt: skip
    for s in steps:
        model.stack_layers() if s == "stack" else model.fuse_projections()
    layers = model.params["layers"]
    assert isinstance(layers, dict) and old.is_deleted()
    assert layers["wo"].shape == (n_layers, *old.shape)
    if "fuse" in steps:
        assert "wqkv" in layers and "w_gate_up" in layers and "wq" not in layers
    before = jax.tree_util.tree_leaves(model.params)
    model.stack_layers()  # idempotent: the same arrays
    assert all(a is b for a, b in zip(before, jax.tree_util.tree_leaves(model.params), strict=True))
    for w, g in zip(want, logits_of(model), strict=True):
        assert np.isfinite(g).all() and np.abs(w).max() > 1.0
        np.testing.assert_array_equal(g, w)


def test_a_stacked_step_takes_a_dozen_parameters_whatever_the_layer_count():
    """What the stacking is for: jit's per-call work follows the argument count."""
    counts = {}
    for layers in (2, 7):
        config = dataclasses.replace(jm.PRESETS["tiny-llama"], num_layers=layers)
        model = jm.random_model(config, seed=0)
        per_layer = len(jax.tree_util.tree_leaves(model.params))
        model.stack_layers()
        counts[layers] = (per_layer, len(jax.tree_util.tree_leaves(model.params)))
    (two, two_stacked), (seven, seven_stacked) = counts[2], counts[7]
    per_layer_weights = (seven - two) // 5
    assert two_stacked == seven_stacked == two - per_layer_weights
    assert seven_stacked < seven / 4


def test_layers_that_differ_are_refused_by_name():
    params = jm.random_model("tiny-llama", seed=0).params
    del params["layers"][1]["wo"]
    with pytest.raises(ValueError, match="params: expected every layer to hold the same"):
        llama.stack_layers(params)


@pytest.mark.parametrize("fuse", [False, True])
def test_generator_and_engine_on_stacked_params_equal_the_per_layer_model(rng, fuse):
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 70, 1, 33)]
    plain = four_layers("tiny-qwen2", 5)
    want = [
        Generator(plain, arena=EagerArena(), max_len=256)
        .generate([p], 12, stop_tokens=[])
        .tokens[0]
        for p in prompts
    ]
    model = four_layers("tiny-qwen2", 5)
    model.stack_layers()
    gen = Generator(model, arena=EagerArena(), max_len=256, fuse_projections=fuse)
    assert isinstance(gen.params["layers"], dict)
    assert [gen.generate([p], 12, stop_tokens=[]).tokens[0] for p in prompts] == want
    with Engine(model, max_slots=3, max_len=256, prefill_chunk_tokens=32, arena=EagerArena(),
                fuse_projections=fuse, decode_row_buckets=True) as eng:  # fmt: skip
        reqs = [eng.submit(p, 12, stop_token_ids=[]) for p in prompts]
        eng.run_until_idle()
        assert [r.result().tokens for r in reqs] == want
