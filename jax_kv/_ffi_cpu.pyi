"""Stub of the nanobind module _ffi_cpu (ffi/module_cpu.cc): CPU reference XLA FFI handlers
and the DLPack export of arena memory."""

from collections.abc import Sequence
from typing import Any

def registrations() -> dict[str, Any]:
    """Target name -> PyCapsule of the CPU handler (jax_kv_gqa_decode, _prefill,
    _prefill_packed, _grow_cache)."""

def export_view(
    ptr: int, shape: Sequence[int], dtype: str, device_type: str, device_id: int, owner: object
) -> Any:
    """A DLPack-capable view [shape] of `ptr` (256-byte aligned); `owner` stays alive until
    the last consumer (XLA) releases the view."""

def supported_head_dims() -> list[int]:
    """The head dims the handlers and kernels are built for (cuda/head_dims.h), increasing;
    jax_kv.ops._common.SUPPORTED_HEAD_DIMS must equal it."""
