"""Stub of the nanobind module _ffi_cuda (ffi/module_cuda.cc): CUDA XLA FFI handlers. Which
kernel a call runs is a function of the call (its dtype and head dim, and the `kernel`,
`cta_shape`, `split_counters` and `splits` attributes): the module holds no kernel setting."""

from typing import Any

def registrations() -> dict[str, Any]:
    """Target name -> PyCapsule of the CUDA handler (jax_kv_gqa_decode, _prefill,
    _prefill_packed, _grow_cache)."""

def decode_plan(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    kernel: int,
    cta_shape: int,
    splits: int = 0,
) -> dict[str, Any]:
    """A decode call's plan on the current device, for the `kernel`, `cta_shape` and `splits`
    attribute values (positions in jax_kv.ops._common.DECODE_KERNELS / CTA_SHAPES; 0 = auto;
    splits n > 0 fixes the split count, and the auto CTA shape at narrow):
    {"kernel": "mma" or "simt", the kernel it runs; "num_splits", "chunk_multiple",
    "min_chunk": its splits, each a multiple of chunk_multiple tokens and at least min_chunk;
    "workspace_floats": the float32 workspace that plan needs (partials and counters, 0
    without splits; never a function of the capacity S)}. ValueError where the handler would
    refuse the call."""

def prefill_uses_wgmma(head_dim: int, itemsize: int, kernel: int) -> bool:
    """Whether the prefill handler launches the wgmma kernel for this head dim, item size and
    `kernel` attribute value (0 = auto, 1 = mma) on the current device."""

def host_calls() -> dict[str, int]:
    """Host-code runs of each CUDA handler since import or the last reset_host_calls()."""

def reset_host_calls() -> None: ...
def _take_counter_region(n: int) -> int:
    """Tests only: the word offset of the pool region a decode launch needing n split counters
    would get, or -1 where it would zero workspace counters instead."""

split_counter_pool_words: int
