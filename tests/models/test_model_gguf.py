"""GGUF loading on tiny files written here with gguf.GGUFWriter from random transformers
models, the way llama.cpp's converter writes them (q/k rows permuted for llama, llama3
scaling as rope_freqs.weight, no output.weight when tied)."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_ref import TOL, make_hf_model, quiet, torch_logits, write_gguf

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.models import llama, loading

Q = gguf.GGMLQuantizationType


def _logits(model, tokens):
    B, T = tokens.shape
    caches = llama.init_caches(model.config, B, T, layout=Layout.SEQ_MAJOR)
    logits, _ = llama.prefill_jit(
        model.params,
        model.config,
        jnp.asarray(tokens),
        None,
        caches,
        jnp.zeros((B,), jnp.int32),
        layout=Layout.SEQ_MAJOR,
    )
    return np.asarray(logits)


@pytest.mark.parametrize("name", ["llama-tied-llama3", "qwen2-untied"])
def test_f32_gguf_logits_match_transformers(ref, tmp_path, name):
    """Permutation undone, names mapped, llama3 factors and tying read back: F32 GGUF logits
    equal the original transformers model's."""
    hf_model = make_hf_model(ref, name)
    written = write_gguf(tmp_path / "m.gguf", hf_model, mixed=False)
    model = jm.load(tmp_path / "m.gguf")
    assert model.config.tie_word_embeddings == written.tie_word_embeddings
    assert (model.config.rope_scaling is not None) == (written.rope_scaling is not None)
    assert model.tokenizer is None and "tokenizer.ggml.model" in model.tokenizer_error
    tokens = np.random.default_rng(0).integers(0, 384, (2, 16)).astype(np.int32)
    want = torch_logits(ref, hf_model, tokens)
    got = _logits(model, tokens)
    assert np.abs(got - want).max() <= TOL["float32"] * np.abs(want).max()


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-untied"])
def test_quantized_gguf_matches_transformers_reading_it(ref, tmp_path, name):
    """Every supported tensor type in one file; transformers dequantizes the same bytes."""
    path = tmp_path / "q.gguf"
    write_gguf(path, make_hf_model(ref, name), mixed=True)
    reader = gguf.GGUFReader(str(path))
    types = {Q(t.tensor_type).name for t in reader.tensors}
    assert set(loading.GGUF_TYPES[:8]) <= types
    model = jm.load(path)
    with quiet():
        hf_model = ref.transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=ref.torch.float32
        ).eval()
    tokens = np.random.default_rng(1).integers(0, 384, (2, 16)).astype(np.int32)
    want = torch_logits(ref, hf_model, tokens)
    got = _logits(model, tokens)
    assert np.abs(got - want).max() <= TOL["float32"] * np.abs(want).max()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gguf_dtype_argument(ref, tmp_path, dtype):
    write_gguf(tmp_path / "m.gguf", make_hf_model(ref, "llama-untied"), mixed=True)
    model = jm.load(tmp_path / "m.gguf", dtype=dtype)
    assert {x.dtype for x in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(dtype)}
