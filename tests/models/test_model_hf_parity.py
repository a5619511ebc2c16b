"""jax_kv's Llama / Qwen2 against transformers (PyTorch CPU, float32) on tiny random-weight
checkpoints written to disk with save_pretrained and read back with jax_kv.models.load."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from model_ref import TINY, TOL, quiet, torch_logits

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.models import llama

B, T, S = 2, 24, 32


def _tokens(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


def _prefill_logits(model, tokens, layout, new_lengths=None, lengths=None):
    caches = llama.init_caches(model.config, B, S, layout=layout, dtype=model.dtype)
    lengths = jnp.zeros((B,), jnp.int32) if lengths is None else lengths
    nl = None if new_lengths is None else jnp.asarray(new_lengths, jnp.int32)
    logits, caches = llama.prefill_jit(
        model.params, model.config, jnp.asarray(tokens), nl, caches, lengths, layout=layout
    )
    return np.asarray(logits), caches


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(TINY))
def test_full_prompt_logits_match_transformers(ref, hf_checkpoint, name, dtype):
    path, hf_model = hf_checkpoint(name)
    model = jm.load(path, dtype=dtype)
    assert model.config.tie_word_embeddings == ("tied" in name and "untied" not in name)
    assert ("lm_head" in model.params) != model.config.tie_word_embeddings
    assert model.config.qkv_bias == name.startswith("qwen2")
    assert (model.config.rope_scaling is not None) == ("llama3" in name)
    tokens = _tokens(model.config.vocab_size)
    want = torch_logits(ref, hf_model, tokens)
    got, _ = _prefill_logits(model, tokens, Layout.SEQ_MAJOR)
    err = _rel_err(got, want)
    print(
        f"{name} {dtype}: max |logit diff| = {np.abs(got - want).max():.3g} "
        f"(max |logit| {np.abs(want).max():.3g})"
    )
    assert err <= TOL[dtype]


@pytest.mark.parametrize("layout", [Layout.HEAD_MAJOR, Layout.SEQ_MAJOR], ids=lambda x: x.name)
@pytest.mark.parametrize("name", ["llama-untied-llama3", "qwen2-tied"])
def test_chunked_prefill_and_decode_match_transformers(ref, hf_checkpoint, name, layout):
    """Prefill 10 tokens, prefill 10 more at lengths=10, then 4 decode steps: each logit row
    equals transformers' full-prompt logits at the same position (RoPE at lengths + t)."""
    path, hf_model = hf_checkpoint(name)
    model = jm.load(path)
    tokens = _tokens(model.config.vocab_size, seed=1)
    want = torch_logits(ref, hf_model, tokens)
    caches = llama.init_caches(model.config, B, S, layout=layout)
    lengths = jnp.zeros((B,), jnp.int32)
    got = []
    for lo, hi in ((0, 10), (10, 20)):
        logits, caches = llama.prefill_jit(
            model.params,
            model.config,
            jnp.asarray(tokens[:, lo:hi]),
            None,
            caches,
            lengths,
            layout=layout,
        )
        lengths = lengths + (hi - lo)
        got.append(np.asarray(logits))
    for t in range(20, T):
        logits, caches = llama.decode_step_jit(
            model.params,
            model.config,
            jnp.asarray(tokens[:, t]),
            caches,
            lengths,
            layout=layout,
        )
        lengths = lengths + 1
        got.append(np.asarray(logits)[:, None])
    assert _rel_err(np.concatenate(got, axis=1), want) <= TOL["float32"]


def test_ragged_batch_rows_match_single_prompts(ref, hf_checkpoint):
    """Row 1 holds 15 real tokens then padding: its first 15 logits equal transformers' on
    those 15 tokens alone; last_only picks each row's last real token."""
    path, hf_model = hf_checkpoint("qwen2-untied")
    model = jm.load(path)
    tokens = _tokens(model.config.vocab_size, seed=2)
    want0 = torch_logits(ref, hf_model, tokens[:1])[0]
    want1 = torch_logits(ref, hf_model, tokens[1:, :15])[0]
    got, _ = _prefill_logits(model, tokens, Layout.HEAD_MAJOR, new_lengths=[T, 15])
    assert _rel_err(got[0], want0) <= TOL["float32"]
    assert _rel_err(got[1, :15], want1) <= TOL["float32"]
    caches = llama.init_caches(model.config, B, S, layout=Layout.HEAD_MAJOR)
    last, _ = llama.prefill_jit(
        model.params,
        model.config,
        jnp.asarray(tokens),
        jnp.asarray([T, 15], jnp.int32),
        caches,
        jnp.zeros((B,), jnp.int32),
        layout=Layout.HEAD_MAJOR,
        last_only=True,
    )
    # The last_only program is compiled apart (other fusions): equal to f32 rounding, while a
    # wrong row would differ at O(1).
    want_last = np.stack([got[0, T - 1], got[1, 14]])
    np.testing.assert_allclose(
        np.asarray(last), want_last, rtol=0, atol=1e-5 * np.abs(want_last).max()
    )


def test_sharded_checkpoint_loads_like_a_single_file(hf_checkpoint):
    single, _ = hf_checkpoint("llama-untied")
    sharded, _ = hf_checkpoint("llama-untied", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = jm.load(single), jm.load(sharded)
    assert a.config == b.config
    for x, y in zip(jax_leaves(a.params), jax_leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_greedy_tokens_match_transformers_generate(ref, hf_checkpoint):
    path, hf_model = hf_checkpoint("llama-tied-llama3")
    model = jm.load(path)
    prompt = _tokens(model.config.vocab_size, seed=3)[0, :7].tolist()
    config = ref.transformers.GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with ref.torch.no_grad(), quiet():
        out = hf_model.generate(ref.torch.tensor([prompt]), generation_config=config)
    want = out[0, len(prompt) :].tolist()
    assert len(want) == 12
    assert model.generate_greedy(prompt, 12, stop_at_eos=False) == want
