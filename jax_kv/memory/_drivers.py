"""Physical-memory back ends of the VMM arena: the CUDA driver (cuda-python) and a host
stand-in with the same contract (a read-only anonymous reservation that reads as zeros,
mprotect as commit) so the arena's bookkeeping, view rules, zero granule and the cache's
growth paths run in CPU tests.

A driver maps one granule-sized physical handle at a time and grants read-write or read-only
access per contiguous range; it knows nothing of regions or views (jax_kv/memory/arena.py
does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from typing import Any

# The device whose primary context this module last made current, per thread. A context is
# current per thread, and the Engine's driver, a server's warm-up or a user's thread reach an
# arena from threads that never made one current (cuMemGetInfo then fails with
# CUDA_ERROR_INVALID_CONTEXT); one thread may also drive the arenas of several devices.
_CURRENT = threading.local()


class ArenaError(RuntimeError):
    """The arena refused an operation (live view over the bytes, closed arena, driver error)."""


class ArenaExhausted(ArenaError):
    """Physical memory or reserved address space ran out; the arena's state is unchanged."""


class CudaDriver:
    """CUDA driver VMM on the primary context of one device (cuda.bindings.driver).

    Imported lazily: constructing one is the first point that loads libcuda.
    """

    kind = "cuda"

    def __init__(self, device: Any) -> None:
        from cuda.bindings import driver as cu  # lazy: CPU-only installs never import it

        self._cu = cu
        self.device_id = int(device.id)
        self.ordinal = int(getattr(device, "local_hardware_id", device.id))
        self._check(cu.cuInit(0), "cuInit")
        self._dev = self._check(cu.cuDeviceGet(self.ordinal), "cuDeviceGet")
        # XLA runs on the primary context; retaining it (not creating one) makes our mappings
        # visible to XLA's kernels and our copies ordered against nothing but our own syncs.
        self._ctx = self._check(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self.make_current()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self._prop = prop
        self.granule = int(
            self._check(
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.ordinal
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._desc = [desc]
        read_only = cu.CUmemAccessDesc()
        read_only.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        read_only.location.id = self.ordinal
        read_only.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self._desc_read_only = [read_only]
        self._stream = self._check(
            cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate"
        )
        self.total_memory = int(self._check(cu.cuDeviceTotalMem(self._dev), "cuDeviceTotalMem"))
        self.capacity_bytes = self.total_memory  # the most physical memory handles can hold

    def _check(self, result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            _, name = self._cu.cuGetErrorName(err)
            text = name.decode() if isinstance(name, bytes) else str(err)
            cls = (
                ArenaExhausted if err == self._cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY else ArenaError
            )
            raise cls(f"{what} failed: {text}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def make_current(self) -> None:
        self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        _CURRENT.ordinal = self.ordinal

    def _drive(self, name: str, *args: Any) -> Any:
        """Calls driver function `name` on this device's primary context, made current first
        where this module did not already make it current on the calling thread. (The arena
        also calls make_current at each operation's start, against other libraries that
        switch a thread's context.)"""
        if getattr(_CURRENT, "ordinal", None) != self.ordinal:
            self.make_current()
        return self._check(getattr(self._cu, name)(*args), name)

    def free_memory(self) -> int:
        free, _ = self._drive("cuMemGetInfo")
        return int(free)

    def reserve(self, nbytes: int) -> int:
        ptr = self._drive("cuMemAddressReserve", nbytes, 0, 0, 0)
        return int(ptr)

    def free_va(self, base: int, nbytes: int) -> None:
        self._drive("cuMemAddressFree", base, nbytes)

    def create(self, granules: int = 1) -> Any:
        return self._drive("cuMemCreate", granules * self.granule, self._prop, 0)

    def release(self, handle: Any) -> None:
        self._drive("cuMemRelease", handle)

    def map(self, va: int, handle: Any, granules: int = 1) -> None:
        """Maps the whole of `handle` (`granules` granules: the size it was created with)."""
        self._drive("cuMemMap", va, granules * self.granule, 0, handle, 0)

    def unmap(self, va: int, nbytes: int) -> None:
        self._drive("cuMemUnmap", va, nbytes)

    def set_access(self, va: int, nbytes: int, read_only: bool = False) -> None:
        desc = self._desc_read_only if read_only else self._desc
        self._drive("cuMemSetAccess", va, nbytes, desc, 1)

    def write(self, dst: int, data: bytes) -> None:
        """Host bytes to device memory on the driver's stream, then waits for the copy."""
        self._drive("cuMemcpyHtoDAsync", dst, data, len(data), self._stream)
        self.finish_copies()

    def zero(self, va: int, nbytes: int) -> None:
        """Zeroes mapped read-write bytes on the driver's stream (`finish_copies` waits)."""
        self._drive("cuMemsetD8Async", va, 0, nbytes, self._stream)

    def synchronize(self) -> None:
        self._drive("cuCtxSynchronize")

    def copy2d(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int
    ) -> None:
        """Device-to-device strided copy on the driver's stream (no host bounce)."""
        cu = self._cu
        c = cu.CUDA_MEMCPY2D()
        c.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.srcDevice, c.srcPitch = src, src_pitch
        c.dstDevice, c.dstPitch = dst, dst_pitch
        c.WidthInBytes, c.Height = width, height
        self._drive("cuMemcpy2DAsync", c, self._stream)

    def finish_copies(self) -> None:
        self._drive("cuStreamSynchronize", self._stream)

    def close(self) -> None:
        errors = []
        for fn, args in (
            (self._cu.cuStreamDestroy, (self._stream,)),
            (self._cu.cuDevicePrimaryCtxRelease, (self._dev,)),
        ):
            try:
                self._check(fn(*args), fn.__name__)
            except ArenaError as e:
                errors.append(str(e))
        if errors:
            raise ArenaError("; ".join(errors))


class HostDriver:
    """Host memory with VMM semantics, for CPU tests and CPU "VMM" caches.

    The reservation is read-only anonymous address space (MAP_NORESERVE): reading bytes that
    were never committed returns zeros (the kernel's shared zero page, as the GPU arena's zero
    granule), writing them faults. A physical handle is one granule of a memfd; `map` maps it
    MAP_SHARED at an address (no access until `set_access`), so one handle mapped at several
    addresses shows the same bytes everywhere, as cuMemMap of one handle does; `unmap` puts
    read-only anonymous memory back; `release` punches the handle's granule out of the file.
    A handle of several granules (`create(granules)`) is that many consecutive granules of the
    file, mapped whole. As CUDA does, a new mapping has no access until `set_access` (a read
    faults), `map` refuses an address already mapped and `unmap` a range that would split a
    mapping, so CI catches what the GPU would refuse.
    `limit_bytes` caps the physical handles that can exist, to test exhaustion;
    `inject_failure` makes the next calls of one operation fail, to test the arena's failure
    paths.
    """

    kind = "cpu"

    def __init__(
        self,
        *,
        granule: int = 64 << 10,
        total_memory: int = 1 << 30,
        limit_bytes: int | None = None,
        max_reserve_bytes: int | None = None,
    ) -> None:
        if granule < mmap.PAGESIZE or granule % mmap.PAGESIZE:
            raise ValueError(f"granule: expected a multiple of the page size, got {granule}")
        self.granule = granule
        self.total_memory = total_memory
        self.limit_bytes = total_memory if limit_bytes is None else limit_bytes
        self.capacity_bytes = self.limit_bytes
        self.max_reserve_bytes = max_reserve_bytes
        self.device_id = 0
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._libc.mmap.restype = ctypes.c_void_p
        self._libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self._libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self._fd = os.memfd_create("jax_kv_host_arena", os.MFD_CLOEXEC)
        self._file_handles = 0  # handles the file is sized for
        self._free_handles: list[int] = []  # released handles, their storage punched out
        self._live_handles: set[int] = set()
        self._blocks: dict[int, int] = {}  # handle -> granules, for handles of more than one
        # The mappings, as CUDA keeps them: start address -> bytes, and the start of the
        # mapping each mapped granule belongs to (a map over one, or an unmap of part of one,
        # is refused).
        self._mappings: dict[int, int] = {}
        self._owner: dict[int, int] = {}
        self._failures: dict[str, list[int]] = {}

    def inject_failure(self, op: str, times: int = 1, after: int = 0) -> None:
        """Test hook: after `after` more successful calls of `op` ("map", "unmap",
        "set_access", "create", "release"), the next `times` calls raise ArenaError before
        doing anything."""
        self._failures[op] = [after, times]

    def _maybe_fail(self, op: str) -> None:
        plan = self._failures.get(op)
        if plan is None:
            return
        if plan[0] > 0:
            plan[0] -= 1
            return
        plan[1] -= 1
        if plan[1] <= 0:
            del self._failures[op]
        raise ArenaError(f"host driver: injected {op} failure")

    def make_current(self) -> None:
        pass

    def _live_granules(self) -> int:
        return len(self._live_handles) + sum(n - 1 for n in self._blocks.values())

    def free_memory(self) -> int:
        return self.limit_bytes - self._live_granules() * self.granule

    def reserve(self, nbytes: int) -> int:
        if self.max_reserve_bytes is not None and nbytes > self.max_reserve_bytes:
            raise ArenaExhausted(f"host driver: reserve of {nbytes} bytes refused (test limit)")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        ptr = self._libc.mmap(None, nbytes, mmap.PROT_READ, flags, -1, 0)
        if ptr in (None, ctypes.c_void_p(-1).value):
            raise ArenaExhausted(
                f"mmap reserve of {nbytes} bytes failed: errno {ctypes.get_errno()}"
            )
        return int(ptr)

    def free_va(self, base: int, nbytes: int) -> None:
        if self._libc.munmap(base, nbytes) != 0:
            raise ArenaError(f"munmap failed: errno {ctypes.get_errno()}")
        for va in range(base, base + nbytes, self.granule):
            start = self._owner.pop(va, None)
            if start is not None:
                self._mappings.pop(start, None)

    def create(self, granules: int = 1) -> int:
        self._maybe_fail("create")
        live = self._live_granules()
        if (live + granules) * self.granule > self.limit_bytes:
            raise ArenaExhausted(
                f"host driver: physical limit {self.limit_bytes} bytes reached "
                f"({live} granules of {self.granule} live)"
            )
        if granules == 1 and self._free_handles:
            handle = self._free_handles.pop()
        else:  # a block takes fresh consecutive granules at the file's end
            handle = self._file_handles
            self._file_handles += granules
            os.ftruncate(self._fd, self._file_handles * self.granule)
        if granules > 1:
            self._blocks[handle] = granules
        self._live_handles.add(handle)
        return handle

    def release(self, handle: int) -> None:
        self._maybe_fail("release")
        self._live_handles.remove(handle)
        granules = self._blocks.pop(handle, 1)
        # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: the storage goes (a reuse reads zeros).
        self._libc.fallocate(self._fd, 0x02 | 0x01, handle * self.granule, granules * self.granule)
        self._free_handles.extend(range(handle, handle + granules))

    @property
    def live_handles(self) -> int:
        return len(self._live_handles)

    def _mmap_fixed(
        self, va: int, nbytes: int, flags: int, fd: int, offset: int, prot: int = mmap.PROT_READ
    ) -> None:
        flags |= 0x10  # MAP_FIXED: replaces whatever is mapped there
        if self._libc.mmap(va, nbytes, prot, flags, fd, offset) != va:
            raise ArenaError(f"mmap at {va:#x} failed: errno {ctypes.get_errno()}")

    def map(self, va: int, handle: int, granules: int = 1) -> None:
        """Maps the whole of `handle` (`granules` granules: the size it was created with)."""
        self._maybe_fail("map")
        if granules != self._blocks.get(handle, 1):
            raise ArenaError(
                f"host driver: map of {granules} granules of a handle of "
                f"{self._blocks.get(handle, 1)} (a handle is mapped whole)"
            )
        nbytes = granules * self.granule
        spots = range(va, va + nbytes, self.granule)
        if any(a in self._owner for a in spots):
            raise ArenaError(f"host driver: map at {va:#x} over a mapping (cuMemMap refuses it)")
        # No access until set_access, as a new CUDA mapping: a read before it faults.
        prot = getattr(mmap, "PROT_NONE", 0)
        self._mmap_fixed(va, nbytes, mmap.MAP_SHARED, self._fd, handle * self.granule, prot)
        self._mappings[va] = nbytes
        for a in spots:
            self._owner[a] = va

    def unmap(self, va: int, nbytes: int) -> None:
        self._maybe_fail("unmap")
        end = va + nbytes
        spots = range(va, end, self.granule)
        starts = {self._owner[a] for a in spots if a in self._owner}
        for start in starts:
            size = self._mappings[start]
            if start < va or end < start + size:
                raise ArenaError(
                    f"host driver: unmap of [{va:#x}, +{nbytes}) splits the mapping at "
                    f"{start:#x} of {size} bytes (cuMemUnmap refuses it too)"
                )
        for start in starts:
            for a in range(start, start + self._mappings.pop(start), self.granule):
                del self._owner[a]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        self._mmap_fixed(va, nbytes, flags, -1, 0)  # read-only anonymous: reads zeros

    def set_access(self, va: int, nbytes: int, read_only: bool = False) -> None:
        self._maybe_fail("set_access")
        prot = mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
        if self._libc.mprotect(va, nbytes, prot) != 0:
            raise ArenaError(f"mprotect({prot}) failed: errno {ctypes.get_errno()}")

    def zero(self, va: int, nbytes: int) -> None:
        ctypes.memset(va, 0, nbytes)

    def write(self, dst: int, data: bytes) -> None:
        ctypes.memmove(dst, data, len(data))

    def synchronize(self) -> None:
        pass

    def copy2d(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int
    ) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)

    def finish_copies(self) -> None:
        pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def host_view(self, ptr: int, nbytes: int) -> memoryview:
        """Test helper: the bytes at `ptr` (must be committed)."""
        return memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)).cast("B")
