"""Runtime configuration: `JAX_KV_*` environment variables read once into a frozen RuntimeConfig.

Explicit arguments always win; the environment only fills what a caller left out. The first
call to `runtime_config()` freezes the values. Every later call re-reads the same variables and
raises `ConfigChangedError`, naming the variable with its frozen and current values, if any of
them changed: a knob set after the freeze would otherwise be silently ignored (the seed engine
lost days to exactly that). Tests that need other values run in a separate process.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(ValueError):
    """A JAX_KV_* variable holds a value outside its contract."""


class ConfigChangedError(RuntimeError):
    """A JAX_KV_* variable changed after runtime_config() froze it."""


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None


def _parse_bytes(name: str, raw: str) -> int:
    text = raw.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
    number = text[: len(text) - len(unit)]
    try:
        value = int(number, 10) * _UNITS[unit]
    except ValueError:
        raise ConfigError(
            f"{name}: expected a byte count like 68719476736 or 64G, got {raw!r}"
        ) from None
    if value <= 0:
        raise ConfigError(f"{name}: expected a byte count > 0, got {raw!r}")
    return value


def _min_bucket(name: str, raw: str) -> int:
    value = _parse_int(name, raw)
    if value < 1 or value & (value - 1):
        raise ConfigError(f"{name}: expected a power of two >= 1, got {raw!r}")
    return value


def _arena(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("vmm", "eager", "auto"):
        raise ConfigError(f"{name}: expected vmm, eager or auto, got {raw!r}")
    return value


def _commit_ahead(name: str, raw: str) -> int:
    value = _parse_int(name, raw)
    if value < 1:
        raise ConfigError(f"{name}: expected a token count >= 1, got {raw!r}")
    return value


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ConfigError(f"{name}: expected 0 or 1, got {raw!r}")
    return value in ("1", "true")


def _pool_bytes(name: str, raw: str) -> int:
    if raw.strip() == "0":
        return 0
    return _parse_bytes(name, raw)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Process-wide defaults; every field can be overridden by an explicit argument.

    min_bucket: JAX_KV_MIN_BUCKET, smallest capacity bucket in tokens (power of two, 256).
    arena: JAX_KV_ARENA, "vmm" (CUDA virtual memory), "eager" (XLA buffers) or "auto" (vmm
        where a CUDA device and cuda-python are present, else eager).
    reserve_bytes: JAX_KV_RESERVE_BYTES, the VMM virtual reservation ("64G"); None tries the
        ladder 16x device memory halving down to 64 GiB.
    commit_ahead: JAX_KV_COMMIT_AHEAD, tokens a seq-major VMM cache commits past the live
        prefix at each growth (None: one min_bucket).
    pool_bytes: JAX_KV_POOL_BYTES, physical memory the VMM arena keeps created ahead of need
        (64 MiB); it is device memory in use, reported as pooled_bytes.
    excess_precision: JAX_KV_EXCESS_PRECISION (0), whether XLA may skip the roundings of a
        fusion's intermediate values in the steps jax_kv compiles (step_compiler_options).
    batch_invariant: JAX_KV_BATCH_INVARIANT (0), whether a row's logits may depend on the
        rows computed beside it. 1 is meant to make them a function of the row alone: the
        steps' matmuls run cuBLAS's heuristic choice without Triton GEMMs or autotuning
        (step_compiler_options), a one-row matmul is computed on two rows
        (jax_kv.models.projection.matmul_rows) and every product is kept from the add after it,
        RMSNorm's mean of squares sums in one fixed order (jax_kv.ops.norm), and the CUDA
        decode kernel cuts a row's positions by its length alone (jax_kv.ops.gqa_decode's
        BATCH_INVARIANT_SPLITS). Greedy tokens then equal a request's tokens generated alone
        (trained SmolLM2-135M, 100 of 100 chat prompts on the CPU and on an H100); it costs
        speed: +1% on the 8B decode step, +11% on a step with a 512-token prompt piece (H100;
        bench/NOTES.md, "Device session 2026-12-08 (seventeenth)").
    """

    min_bucket: int = 256
    arena: str = "auto"
    reserve_bytes: int | None = None
    commit_ahead: int | None = None
    pool_bytes: int = 64 << 20
    excess_precision: bool = False
    batch_invariant: bool = False


# variable -> (field, parser). The one table both from_env and the freeze guard read, so the
# set of variables the guard watches cannot drift from the fields that are parsed.
_VARIABLES: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "JAX_KV_MIN_BUCKET": ("min_bucket", _min_bucket),
    "JAX_KV_ARENA": ("arena", _arena),
    "JAX_KV_RESERVE_BYTES": ("reserve_bytes", _parse_bytes),
    "JAX_KV_COMMIT_AHEAD": ("commit_ahead", _commit_ahead),
    "JAX_KV_POOL_BYTES": ("pool_bytes", _pool_bytes),
    "JAX_KV_EXCESS_PRECISION": ("excess_precision", _flag),
    "JAX_KV_BATCH_INVARIANT": ("batch_invariant", _flag),
}

# Variables jax_kv no longer reads, and why: set, they are refused by name rather than ignored.
_RETIRED: dict[str, str] = {
    "JAX_KV_DECODE_KERNEL": "the CUDA decode kernel is chosen from the call's dtype and head "
    "dim (issue 20)",
    "JAX_KV_PREFILL_KERNEL": "the CUDA prefill kernel is chosen from the call's dtype, head dim "
    "and GPU (issue 20)",
}


def from_env(environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    """A RuntimeConfig parsed from `environ` (default os.environ), without freezing anything."""
    environ = os.environ if environ is None else environ
    for name, why in _RETIRED.items():
        if environ.get(name, "").strip() != "":
            raise ConfigError(f"{name} was removed: {why}. Unset it.")
    values = {}
    for name, (field, parse) in _VARIABLES.items():
        raw = environ.get(name)
        if raw is not None and raw.strip() != "":
            values[field] = parse(name, raw)
    return RuntimeConfig(**values)


_lock = threading.Lock()
_frozen: tuple[RuntimeConfig, dict[str, str | None]] | None = None


def runtime_config() -> RuntimeConfig:
    """The process-wide RuntimeConfig, frozen on first call.

    Raises:
        ConfigChangedError: a JAX_KV_* variable differs from the value frozen at first read.
        ConfigError: a variable holds an invalid value (at first read).
    """
    global _frozen
    with _lock:
        if _frozen is None:
            snapshot = {name: os.environ.get(name) for name in _VARIABLES}
            _frozen = (from_env(), snapshot)
            return _frozen[0]
        config, snapshot = _frozen
    for name, frozen_value in snapshot.items():
        current = os.environ.get(name)
        if current != frozen_value:
            raise ConfigChangedError(
                f"{name} changed after jax_kv froze its runtime config: frozen value "
                f"{frozen_value!r}, current value {current!r}. The config is read once per "
                f"process; pass the value as an argument, or set it before the first use "
                f"(tests: run in a separate process)."
            )
    return config


def step_compiler_options() -> dict[str, Any]:
    """XLA options of every step the Generator and the Engine compile (and their token
    pickers). By default XLA may keep a fusion's intermediate values in float32 where the
    program rounds them to bfloat16 (xla_allow_excess_precision), so one op rounds apart in two
    programs that fuse it differently: the Engine's mixed prefill step against the Generator's
    packed prefill, a bucketed decode step against a scanned one. Greedy bf16 tokens then part
    between them far more often than batching alone explains: on the H100, a 1-slot Engine
    equal to the Generator alone in 27 of 48 requests' first 32 tokens with it, 47 without
    (bench/experiments/bf16_agreement.py, SmolLM2-135M shape, random weights; bench/NOTES.md).
    JAX_KV_EXCESS_PRECISION=1 gives XLA that freedom back.

    With JAX_KV_BATCH_INVARIANT=1 the GEMMs are cuBLAS's heuristic choice, no Triton GEMM
    fusion and no autotuning (and excess precision stays off): XLA's defaults pick a kernel
    (and a split-K) per M, so a row's bits changed with the rows beside it from M = 64-128 on
    for Llama-3-8B's projections, and with these two options (set through XLA_FLAGS) every M
    probed from 2 to 768 gave the same bits in its first 8 rows on the H100
    (bench/experiments/gemm_row_invariance.py, bench/NOTES.md)."""
    config = runtime_config()
    # The batch-invariant mode rounds every op as written whatever JAX_KV_EXCESS_PRECISION
    # says: a fusion's excess precision follows how XLA fuses, which can follow the shape.
    excess = config.excess_precision and not config.batch_invariant
    options: dict[str, Any] = {"xla_allow_excess_precision": excess}
    if config.batch_invariant:
        options.update(xla_gpu_enable_triton_gemm=False, xla_gpu_autotune_level=0)
    return options


def variables() -> tuple[str, ...]:
    """Names of the JAX_KV_* variables the config reads."""
    return tuple(_VARIABLES)


__all__ = [
    "ConfigChangedError",
    "ConfigError",
    "RuntimeConfig",
    "from_env",
    "runtime_config",
    "step_compiler_options",
    "variables",
]
