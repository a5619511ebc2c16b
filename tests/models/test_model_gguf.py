"""GGUF loading on tiny files written here with gguf.GGUFWriter from random transformers
models, the way llama.cpp's converter writes them (q/k rows permuted for llama, llama3
scaling as rope_freqs.weight, no output.weight when tied)."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_ref import TOL, make_hf_model, quiet, torch_logits

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.models import llama, loading

Q = gguf.GGMLQuantizationType

# HF name (layer part) -> GGUF name, and the quantization each gets in the mixed-type file:
# together they cover F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K.
LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", Q.Q4_K),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.Q4_0),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.Q4_1),
    "self_attn.q_proj.bias": ("attn_q.bias", Q.F32),
    "self_attn.k_proj.bias": ("attn_k.bias", Q.F32),
    "self_attn.v_proj.bias": ("attn_v.bias", Q.F32),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.BF16),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.F16),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q8_0),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q6_K),
}
TOP = {
    "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
    "model.norm.weight": ("output_norm.weight", Q.F32),
    "lm_head.weight": ("output.weight", Q.Q6_K),
}


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half -> GGML)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def k_quant_bytes(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks (gguf quantizes neither in NumPy): random codes,
    small finite float16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (f16) first
        raw[..., 0:2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    else:  # Q6_K: d (f16) last
        raw[..., 208:210] = np.frombuffer(np.float16(5e-5).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path, hf_model, *, mixed: bool, seed: int = 0):
    """Writes hf_model as a GGUF: all F32, or (mixed) the types of LAYER / TOP."""
    cfg = hf_model.config
    arch = cfg.model_type
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    config = jm.from_hf_config(cfg.to_dict())
    if config.rope_scaling is not None:  # llama3: factors = default / scaled frequencies
        base = llama.rope_inv_freq(config.replace(rope_scaling=None))
        factors = (base / llama.rope_inv_freq(config)).astype(np.float32)
        w.add_tensor("rope_freqs.weight", factors)
    names = {k: v for k, v in TOP.items()}
    for i in range(cfg.num_hidden_layers):
        for hf, (gg, qt) in LAYER.items():
            names[f"model.layers.{i}.{hf}"] = (f"blk.{i}.{gg}", qt)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name not in names or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        gg, qtype = names[hf_name]
        x = tensor.float().numpy()
        if arch == "llama" and gg.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gg else cfg.num_key_value_heads
            x = permute(x, heads)
        if not mixed or x.ndim == 1:
            w.add_tensor(gg, x.astype(np.float32))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(gg, k_quant_bytes(rng, qtype, *x.shape), raw_dtype=qtype)
        elif qtype == Q.F16:
            w.add_tensor(gg, x.astype(np.float16))
        else:
            w.add_tensor(gg, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config


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
