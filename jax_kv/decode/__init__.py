"""The generation loop: Generator, its counters, and on-device sampling."""

from jax_kv.decode.generator import (
    Decision,
    GenerationResult,
    GenerationStats,
    Generator,
    StepKey,
    StepStatusError,
)
from jax_kv.decode.protocol import DecoderModel
from jax_kv.decode.sampling import GREEDY, Sampling, sample

__all__ = [
    "GREEDY",
    "DecoderModel",
    "Decision",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "Sampling",
    "StepKey",
    "StepStatusError",
    "sample",
]
