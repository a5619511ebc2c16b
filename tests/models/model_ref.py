"""Helpers of the model tests: transformers (PyTorch, CPU, float32) as the independent
reference, and the tiny random checkpoints it writes."""

from __future__ import annotations

import contextlib
import math
import os
import types
import warnings

import numpy as np
import pytest

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
