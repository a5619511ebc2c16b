"""ModelConfig: presets against the published parameter counts, config.json spellings of
transformers 4.x and 5.x, validation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_kv.models as jm
from jax_kv.models import llama

# Published parameter counts of the models the presets describe.
PUBLISHED = {
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    config = jm.preset(name)
    assert config.num_params == PUBLISHED[name]
    shapes = jax.tree_util.tree_leaves(
        llama.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    assert sum(int(np.prod(s)) for s in shapes) == PUBLISHED[name]
    assert hash(config) == hash(jm.preset(name))  # static under jit


def test_random_model_matches_its_shapes():
    model = jm.random_model("tiny-qwen2")
    shapes = llama.param_shapes(model.config)
    got = jax.tree_util.tree_map(lambda x: tuple(x.shape), model.params)
    assert got == shapes


def test_transformers4_spelling():
    config = jm.from_hf_config(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=10,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=2,
            rope_theta=5e5,
            rope_scaling=dict(type="linear", factor=2.0),
            eos_token_id=[3, 4],
            torch_dtype="bfloat16",
        )
    )
    assert config.rope_theta == 5e5 and config.rope_scaling == jm.RopeScaling("linear", 2.0)
    assert (config.num_kv_heads, config.head_dim, config.eos_token_ids) == (2, 64, (3, 4))
    assert not config.qkv_bias and not config.tie_word_embeddings


def test_llama3_inverse_frequencies_match_transformers(ref):
    """rope_inv_freq against transformers' own llama3 rope init."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = ref.transformers.LlamaConfig(
        head_dim=128,
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = llama.rope_inv_freq(jm.from_hf_config(hf.to_dict()))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_q_heads=6, num_kv_heads=4), "num_q_heads: expected a multiple of"),
        (dict(hidden_size=0), "hidden_size: expected an int > 0"),
        (dict(architecture="gpt2"), "architecture: expected one of"),
        (dict(head_dim=63), "head_dim: expected an even number"),
    ],
)
def test_invalid_config(changes, message):
    with pytest.raises(ValueError, match=message):
        jm.preset("tiny-llama").replace(**changes)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset: expected one of"):
        jm.preset("gpt-5")
