"""Loads the FFI extension modules and registers their targets with XLA, once per process.

The CPU module is always built. The CUDA module is optional and imported only here, lazily,
so a CPU-only install never loads libcudart.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

import jax


@functools.cache
def register() -> None:
    from jax_kv import _ffi_cpu

    for name, capsule in _ffi_cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    cuda = cuda_module()
    if cuda is not None:
        for name, capsule in cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


@functools.cache
def cuda_module() -> ModuleType | None:
    """The CUDA FFI module, or None where it was not built or no CUDA backend exists."""
    if importlib.util.find_spec("jax_kv._ffi_cuda") is None:
        return None
    try:
        jax.devices("cuda")
    except RuntimeError:
        return None
    return importlib.import_module("jax_kv._ffi_cuda")
