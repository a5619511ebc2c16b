"""ModelConfig: the frozen, hashable shape of a Llama / Qwen2 decoder, its named presets, and
the reading of a Hugging Face config.json into it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ARCHITECTURES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "factors")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    rope_type:
        "linear": every inverse frequency divided by `factor`.
        "llama3": Llama-3.1's band-wise scaling (`factor`, `low_freq_factor`,
            `high_freq_factor`, `original_max_position_embeddings`), as in transformers.
        "factors": inverse frequency i divided by `factors[i]` ([D/2] values); this is how
            llama.cpp stores llama3 scaling in a GGUF (the `rope_freqs.weight` tensor).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(
                f"rope_scaling: rope_type must be one of {ROPE_TYPES[1:]}, got {self.rope_type!r}"
            )
        if self.rope_type == "factors" and not self.factors:
            raise ValueError("rope_scaling: rope_type 'factors' needs factors")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and hyperparameters of a Llama-3 or Qwen2/Qwen2.5 decoder.

    Frozen and hashable: pass it as a static argument to `jax.jit`.
    `qkv_bias` is Qwen2's bias on the q/k/v projections (Llama has none).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture: expected one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected an int > 0, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads: expected a multiple of num_kv_heads="
                f"{self.num_kv_heads}, got {self.num_q_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (RoPE), got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.factors is not None:
            if len(self.rope_scaling.factors) != self.head_dim // 2:
                raise ValueError(
                    f"rope_scaling.factors: expected head_dim/2="
                    f"{self.head_dim // 2} values, "
                    f"got {len(self.rope_scaling.factors)}"
                )

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        H, D, I = self.hidden_size, self.head_dim, self.intermediate_size  # noqa: E741
        q, kv = self.num_q_heads * D, self.num_kv_heads * D
        attn = H * (q + 2 * kv) + q * H + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * H * I + 2 * H
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        return self.vocab_size * H + self.num_layers * layer + H + head


_LLAMA31_ROPE = RopeScaling(
    "llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

PRESETS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): the embedded default model.
    "smollm2-135m": ModelConfig(
        "llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        "qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_q_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    "llama-3-8b": ModelConfig(
        "llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    # Seconds-fast shapes for tests; head_dim 64 is one the ops support.
    "tiny-llama": ModelConfig(
        "llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64),
        max_position_embeddings=2048,
    ),
    "tiny-qwen2": ModelConfig(
        "qwen2",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
}
# Siblings: the same family with the sizes (or the RoPE) that differ.
PRESETS["qwen2.5-1.5b"] = PRESETS["qwen2.5-0.5b"].replace(
    hidden_size=1536, intermediate_size=8960, num_layers=28, num_q_heads=12, head_dim=128
)
PRESETS["llama-3.1-8b"] = PRESETS["llama-3-8b"].replace(
    rope_scaling=_LLAMA31_ROPE,
    max_position_embeddings=131072,
    eos_token_ids=(128001, 128008, 128009),
)


def preset(name: str) -> ModelConfig:
    """The named preset (see PRESETS)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}") from None


_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def from_hf_config(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (transformers 4.x or 5.x spelling).

    Raises ValueError naming `source` and the field for an unsupported architecture or
    option, a field of the wrong type, or values that do not make a ModelConfig.
    """
    if not isinstance(hf, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    names = hf.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{source}: architectures: expected a list of strings, got {names!r}")
    names = list(names)
    model_type = hf.get("model_type")
    arch = next((_HF_ARCHITECTURES[n] for n in names if n in _HF_ARCHITECTURES), None)
    if arch is None and not names and model_type in ARCHITECTURES:
        arch = model_type
    if arch is None:
        raise ValueError(
            f"{source}: unsupported architecture {names or model_type!r} "
            f"(supported: {sorted(_HF_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{source}: missing required field {key!r}")
        return hf[key]

    def integer(key: str, value: Any) -> int:
        # JSON has one number type: 64.0 is accepted as 64, 64.5, "64" and true are not.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{source}: {key}: expected an integer, got {value!r}")
        return value

    def real(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{source}: {key}: expected a number, got {value!r}")
        return float(value)

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{source}: unsupported hidden_act {hf['hidden_act']!r} (supported: 'silu')"
        )
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: unsupported mlp_bias=true")
    if arch == "llama" and hf.get("attention_bias"):
        raise ValueError(f"{source}: unsupported attention_bias=true for llama")
    if arch == "qwen2" and hf.get("use_sliding_window"):
        raise ValueError(f"{source}: unsupported use_sliding_window=true")

    # transformers 5 writes rope_parameters = {rope_type, rope_theta, ...}; 4.x writes
    # rope_theta and rope_scaling = {rope_type | type, ...} or null.
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"{source}: {rope_key}: expected an object or null, got {rope!r}")
    rope = dict(rope)

    def rope_field(key: str, default: Any = ...) -> Any:
        if key not in rope and default is ...:
            raise ValueError(f"{source}: {rope_key}.{key}: missing (rope type {rope_type!r})")
        return rope.get(key, default)

    theta = real("rope_theta", rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            "llama3",
            factor=real(f"{rope_key}.factor", rope_field("factor")),
            low_freq_factor=real(f"{rope_key}.low_freq_factor", rope_field("low_freq_factor", 1.0)),
            high_freq_factor=real(
                f"{rope_key}.high_freq_factor", rope_field("high_freq_factor", 4.0)
            ),
            original_max_position_embeddings=integer(
                f"{rope_key}.original_max_position_embeddings",
                rope_field("original_max_position_embeddings"),
            ),
        )
    elif rope_type == "linear":
        scaling = RopeScaling("linear", factor=real(f"{rope_key}.factor", rope_field("factor")))
    elif rope_type != "default":
        raise ValueError(
            f"{source}: unsupported rope type {rope_type!r} (supported: default, linear, llama3)"
        )

    hidden = integer("hidden_size", need("hidden_size"))
    heads = integer("num_attention_heads", need("num_attention_heads"))
    if heads < 1:
        raise ValueError(f"{source}: num_attention_heads: expected an integer >= 1, got {heads}")
    kv_heads = hf.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else integer("num_key_value_heads", kv_heads)
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"{source}: num_key_value_heads: expected an integer >= 1 dividing "
            f"num_attention_heads={heads}, got {kv_heads}"
        )
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{source}: head_dim: missing, and hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={heads}"
            )
        head_dim = hidden // heads
    head_dim = integer("head_dim", head_dim)
    eos = hf.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    eos_ids = tuple(integer("eos_token_id", e) for e in eos_list)
    bos = hf.get("bos_token_id")
    try:
        return ModelConfig(
            arch,
            vocab_size=integer("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size", need("intermediate_size")),
            num_layers=integer("num_hidden_layers", need("num_hidden_layers")),
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=real("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=integer(
                "max_position_embeddings", hf.get("max_position_embeddings", 8192)
            ),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            bos_token_id=None if bos is None else integer("bos_token_id", bos),
            eos_token_ids=eos_ids,
        )
    except ValueError as e:  # ModelConfig's own checks name the field, not the file
        raise ValueError(f"{source}: {e}") from None


__all__ = ["ARCHITECTURES", "PRESETS", "ModelConfig", "RopeScaling", "from_hf_config", "preset"]
