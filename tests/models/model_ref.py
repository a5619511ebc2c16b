"""Helpers of the model tests: transformers (PyTorch, CPU, float32) as the independent
reference, and the tiny random checkpoints it writes."""

from __future__ import annotations

import contextlib
import math
import os
import types
import warnings

import gguf
import numpy as np
import pytest

import jax_kv.models as jm
from jax_kv.models import llama

# Max |logit diff| vs transformers float32, relative to max |logit| of the reference
# (tuned once; the jax_kv model's dtype is the key).
TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 2.5e-2}


@contextlib.contextmanager
def quiet():
    """transformers' own deprecation chatter is not ours to fail on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def import_reference() -> types.SimpleNamespace:
    try:
        with quiet():
            import torch
            import transformers
    except ImportError:
        # In CI a missing reference must fail: a green run that compared nothing would lie.
        if os.environ.get("CI"):
            raise
        pytest.skip("needs torch and transformers: pip install -e '.[test]'")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return types.SimpleNamespace(torch=torch, transformers=transformers)


def randomize_(model, seed: int) -> None:
    """Weights that all matter: matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights
    1 + N(0, 0.1), biases N(0, 0.1) (transformers' N(0, 0.02) init leaves logits flat)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


TINY = {  # name -> (transformers config class, kwargs)
    "llama-untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied-llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-untied-llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            ),
        ),
    ),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2-untied": ("Qwen2Config", dict(tie_word_embeddings=False)),
}


def make_hf_model(ref, name: str, seed: int = 0):
    """A tiny random transformers model (float32, eval mode) of TINY[name]."""
    cls, extra = TINY[name]
    kwargs = dict(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(extra)
    with quiet():
        config = getattr(ref.transformers, cls)(**kwargs)
        config._attn_implementation = "eager"
        model_cls = (
            ref.transformers.LlamaForCausalLM
            if cls == "LlamaConfig"
            else ref.transformers.Qwen2ForCausalLM
        )
        model = model_cls(config).eval()
    randomize_(model, seed)
    return model


def torch_logits(ref, model, tokens: np.ndarray) -> np.ndarray:
    """float32 [B, T, V] logits of the transformers model."""
    with ref.torch.no_grad(), quiet():
        out = model(ref.torch.from_numpy(np.asarray(tokens, np.int64)))
    return out.logits.float().numpy()


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
