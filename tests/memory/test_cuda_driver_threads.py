"""CudaDriver makes its device's context current on whichever thread calls it.

A CUDA context is current per thread. The server warms its engine up on a thread of its own
and the Engine's driver steps on another; on the H100 (2026-12-05) the server's warm-up failed
with `cuMemGetInfo failed: CUDA_ERROR_INVALID_CONTEXT` because only the constructing thread had
the context current. These tests run the real CudaDriver over a stand-in for
`cuda.bindings.driver` that keeps a current context per thread and refuses calls made without
the right one, as the driver API does, so CI (no GPU) checks the rule.
"""

from __future__ import annotations

import enum
import sys
import threading
import types
from types import SimpleNamespace
from unittest import mock

import pytest

from jax_kv.memory._drivers import ArenaError, CudaDriver


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201


def fake_driver_module() -> types.ModuleType:
    """The subset of cuda.bindings.driver CudaDriver uses; free memory reads 1000 + ordinal
    of the device whose context is current on the calling thread."""
    cu = types.ModuleType("cuda.bindings.driver")
    current = threading.local()
    ok, invalid = CUresult.CUDA_SUCCESS, CUresult.CUDA_ERROR_INVALID_CONTEXT

    def context():
        return getattr(current, "ctx", None)

    def set_current(ctx):
        current.ctx = ctx
        return (ok,)

    cu.CUresult = CUresult
    cu.cuGetErrorName = lambda err: (ok, err.name.encode())
    cu.cuInit = lambda flags: (ok,)
    cu.cuDeviceGet = lambda ordinal: (ok, ordinal)
    cu.cuDevicePrimaryCtxRetain = lambda dev: (ok, ("primary", dev))
    cu.cuDevicePrimaryCtxRelease = lambda dev: (ok,)
    cu.cuCtxSetCurrent = set_current
    cu.cuDeviceTotalMem = lambda dev: (ok, 1 << 30)
    cu.cuMemGetAllocationGranularity = lambda prop, flags: (ok, 2 << 20)
    cu.cuStreamCreate = lambda flags: (ok, "stream") if context() else (invalid, None)
    cu.cuStreamDestroy = lambda stream: (ok,)
    cu.cuMemGetInfo = lambda: (ok, 1000 + context()[1], 1 << 30) if context() else (invalid, 0, 0)
    cu.cuCtxSynchronize = lambda: (ok,) if context() else (invalid,)
    for struct in ("CUmemAllocationProp", "CUmemAccessDesc"):
        setattr(cu, struct, mock.MagicMock)
    for enum_name in (
        "CUmemAllocationType",
        "CUmemLocationType",
        "CUmemAllocationHandleType",
        "CUmemAllocationGranularity_flags",
        "CUmemAccess_flags",
        "CUstream_flags",
    ):
        setattr(cu, enum_name, mock.MagicMock())
    return cu


@pytest.fixture
def fake_cuda(monkeypatch):
    cu = fake_driver_module()
    package = types.ModuleType("cuda.bindings")
    package.driver = cu
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", cu)
    return cu


def device(ordinal: int) -> SimpleNamespace:
    return SimpleNamespace(id=ordinal, local_hardware_id=ordinal)


def on_new_thread(fn):
    """fn() on a fresh thread: (its result, the exception it raised)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box.get("result"), box.get("error")


def test_a_thread_that_never_made_the_context_current_can_call_the_driver(fake_cuda):
    driver = CudaDriver(device(0))
    assert driver.free_memory() == 1000
    free, error = on_new_thread(driver.free_memory)
    assert error is None, f"a second thread's call failed: {error!r}"
    assert free == 1000
    _, error = on_new_thread(driver.synchronize)
    assert error is None, f"a second thread's synchronize failed: {error!r}"


def test_one_thread_driving_two_devices_reaches_each_devices_context(fake_cuda):
    first, second = CudaDriver(device(0)), CudaDriver(device(1))

    def alternate():
        return [d.free_memory() for d in (first, second, first, second, first)]

    assert alternate() == [1000, 1001, 1000, 1001, 1000]
    values, error = on_new_thread(alternate)
    assert error is None, f"{error!r}"
    assert values == [1000, 1001, 1000, 1001, 1000]


def test_the_stand_in_refuses_a_call_without_a_current_context(fake_cuda):
    """The stand-in's own rule, so the tests above can fail: a call made directly, without
    the driver's context, is refused as the driver API refuses it."""
    driver = CudaDriver(device(0))
    result, error = on_new_thread(fake_cuda.cuMemGetInfo)
    assert error is None and result[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT
    with pytest.raises(ArenaError, match="cuMemGetInfo failed: CUDA_ERROR_INVALID_CONTEXT"):
        driver._check(result, "cuMemGetInfo")


@pytest.mark.gpu
def test_cuda_arena_operations_from_a_fresh_thread():
    """The real driver: a thread that never touched CUDA commits, writes, reads, shares,
    decommits and asks for free memory (the server's warm-up thread failed at the last)."""
    import gc

    import jax.numpy as jnp
    import numpy as np

    from jax_kv.memory import VmmArena

    arena = VmmArena(reserve_bytes=1 << 30)
    g = arena.granule
    n = g // 4

    def work():
        assert arena.available_bytes() > 0
        src, dst = arena.allocate(g), arena.allocate(g)
        src.commit(g)
        arena.write(src.ptr, np.arange(n, dtype=np.float32).tobytes())
        arena.share(src, 0, dst, 0, g)
        view = dst.export((n,), jnp.float32)
        values = np.asarray(view).copy()
        del view
        gc.collect()
        src.decommit(0)
        arena.flush()
        src.free()
        dst.free()
        return values

    values, error = on_new_thread(work)
    assert error is None, f"{error!r}"
    np.testing.assert_array_equal(values, np.arange(n, dtype=np.float32))
    arena.close()
    assert arena.stats().handles_live == 0
