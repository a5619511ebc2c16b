"""The generation loop: Generator, its counters, and on-device sampling."""

from jax_kv.decode.generator import (
    Decision,
    GenerationResult,
    GenerationStats,
    Generator,
    StepKey,
)
from jax_kv.decode.sampling import GREEDY, Sampling, sample

__all__ = [
    "GREEDY",
    "Decision",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "Sampling",
    "StepKey",
    "sample",
]
