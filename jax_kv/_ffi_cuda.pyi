"""Stub of the nanobind module _ffi_cuda (ffi/module_cuda.cc): CUDA XLA FFI handlers."""

from typing import Any

def registrations() -> dict[str, Any]:
    """Target name -> PyCapsule of the CUDA handler (jax_kv_gqa_decode, _prefill, _grow_cache)."""

def workspace_floats(
    op: str, batch: int, num_tokens: int, num_q_heads: int, head_dim: int, capacity: int
) -> int:
    """float32 workspace elements `op` ("decode" or "prefill") needs on the current device;
    independent of `capacity` (the split count comes from the SM count)."""

def host_calls() -> dict[str, int]:
    """Host-code runs of each CUDA handler since import or the last reset_host_calls()."""

def reset_host_calls() -> None: ...
def num_splits(batch: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Split count decode kernel 1 uses on the current device."""

def set_decode_kernel(kernel: int) -> None:
    """Selects the decode kernel (1, 2 or 3) the handler launches from now on; ValueError
    otherwise."""

def decode_kernel() -> int:
    """The decode kernel (1, 2 or 3) the handler launches."""

def set_decode_v2_ctas(shape: str) -> None:
    """Decode kernel 2's CTA shape: "auto" (wide CTAs where B * Hkv is under the SM count),
    "narrow" (4 warps) or "wide" (16, or 8 at group 8); ValueError otherwise."""

def decode_v2_ctas() -> str:
    """Decode kernel 2's CTA shape setting: "auto", "narrow" or "wide"."""

def set_split_counters(where: str) -> None:
    """Where decode kernels 2 and 3 keep their split counters: "pool" (default: device memory
    the kernels keep at zero, no zeroing node per launch) or "workspace" (zeroed by a kernel
    node before each launch); ValueError otherwise."""

def split_counters() -> str:
    """Where decode kernels 2 and 3 keep their split counters: "pool" or "workspace"."""

def _take_counter_region(n: int) -> int:
    """Tests only: the word offset of the pool region a decode launch needing n split counters
    would get, or -1 where it would zero workspace counters instead."""

split_counter_pool_words: int

def decode_plan(
    batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> tuple[int, int, int]:
    """(num_splits, chunk_multiple, min_chunk) of the selected decode kernel."""

def set_prefill_kernel(kernel: str) -> None:
    """Selects the prefill kernel from now on: "auto" (wgmma for bf16/f16 at head dims 64 and
    128 on a compute-capability 9.0 GPU, mma.sync otherwise) or "mma" (mma.sync always); a CUDA
    graph recorded earlier keeps its kernel."""

def prefill_kernel() -> str:
    """The prefill kernel setting: "auto" or "mma"."""

def prefill_uses_wgmma(head_dim: int, itemsize: int) -> bool:
    """Whether the prefill handler launches the wgmma kernel for this head dim and item size."""
