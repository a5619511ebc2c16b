"""The continuous-batching engine: requests come and go on a SlotCache, memory follows them,
the compiled decode step never changes (DESIGN.md, Serving)."""

from jax_kv.engine.engine import Engine, EngineError, EngineStats, QueueFull, StepRecord
from jax_kv.engine.lockstep import Lockstep
from jax_kv.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Delta,
    Request,
    RequestError,
    TextStream,
)

__all__ = [
    "FINISH_CANCELLED",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Completion",
    "Delta",
    "Engine",
    "EngineError",
    "EngineStats",
    "Lockstep",
    "QueueFull",
    "Request",
    "RequestError",
    "StepRecord",
    "TextStream",
]
