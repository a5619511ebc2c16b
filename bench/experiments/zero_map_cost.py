"""What do the zero granule's read-only mappings cost the device, per mapping?

An Engine at 256 slots x 32k (Llama-3-8B geometry: 524,288 granules of 2 MiB) failed on the
H100 with CUDA_ERROR_OUT_OF_MEMORY in cuMemSetAccess while mapping the zero granule over its
regions; 64 slots x 32k (131,072) fit. This probe measures, with cuda-python only:
  1. device memory used (cuMemGetInfo) after mapping one 2 MiB handle read-only at N
     consecutive granules of one reservation (one cuMemSetAccess over each run of RUN
     granules, as the arena does), for growing N, until the driver refuses;
  2. the same address space covered by a ZERO_BLOCK-granule handle mapped N / ZERO_BLOCK
     times: does the cost follow the mappings or the bytes mapped?
  3. whether cuMemUnmap accepts a sub-range of a multi-granule mapping (the arena would need
     it to commit one granule inside a zero block), and whether cuMemMap maps a prefix of a
     larger handle (size < the handle's, offset 0). Run first: on the H100 (2026-12-06) the
     probe's 60 s limit cut it when it ran last.
Prints one line per measurement; the last line printed names where it stopped.

    python3 bench/experiments/zero_map_cost.py
"""

import os
import time

from cuda.bindings import driver as cu
from vmm_setup import access, check, open_device


def free_bytes() -> int:
    free, _total = check(cu.cuMemGetInfo())
    return int(free)


def main():
    prop, g = open_device()
    run = int(os.environ.get("RUN", "64"))  # granules per set-access (a layer's K of a slot)
    block = int(os.environ.get("ZERO_BLOCK", "16"))
    reads = access(read_only=True)
    total = int(check(cu.cuMemGetInfo())[1])
    print(f"granule {g >> 20} MiB, device {total / 2**30:.1f} GiB, run {run}", flush=True)

    def cover(n_granules: int, per_map: int) -> None:
        """Maps a handle of per_map granules over n_granules granules of a fresh reservation,
        prints the device memory the mappings took, then frees everything."""
        size = n_granules * g
        handle = check(cu.cuMemCreate(per_map * g, prop, 0))
        base = int(check(cu.cuMemAddressReserve(size, 0, 0, 0)))
        free0 = free_bytes()
        t0 = time.perf_counter()
        mapped = 0
        try:
            for start in range(0, n_granules, run):
                count = min(run, n_granules - start)
                for i in range(start, start + count, per_map):
                    check(cu.cuMemMap(base + i * g, per_map * g, 0, handle, 0))
                    mapped += 1
                check(cu.cuMemSetAccess(base + start * g, count * g, reads, 1))
            used = free0 - free_bytes()
            print(
                f"  {n_granules:>8} granules ({size / 2**30:7.0f} GiB) as {mapped:>7} maps of"
                f" {per_map} granule(s): device memory {used / 2**20:9.1f} MiB"
                f" ({used / mapped:8.0f} B per map, {used / n_granules:6.0f} B per granule),"
                f" {time.perf_counter() - t0:6.2f} s",
                flush=True,
            )
        except RuntimeError as e:
            print(
                f"  {n_granules} granules, {per_map} per map: refused after {mapped} maps: {e}",
                flush=True,
            )
            raise
        finally:
            for i in range(0, mapped * per_map, per_map):
                cu.cuMemUnmap(base + i * g, per_map * g)
            check(cu.cuMemAddressFree(base, size))
            check(cu.cuMemRelease(handle))

    print("3. cuMemUnmap of one granule inside a 4-granule mapping", flush=True)
    handle = check(cu.cuMemCreate(4 * g, prop, 0))
    base = int(check(cu.cuMemAddressReserve(4 * g, 0, 0, 0)))
    check(cu.cuMemMap(base, 4 * g, 0, handle, 0))
    err = cu.cuMemUnmap(base + g, g)[0]
    print(f"  unmap [1, 2) of [0, 4): {err.name}", flush=True)
    err = cu.cuMemUnmap(base, 4 * g)[0]
    print(f"  unmap [0, 4): {err.name}", flush=True)
    err = cu.cuMemMap(base, 2 * g, 0, handle, 0)[0]  # a prefix of the handle
    print(f"  map granules [0, 2) of a 4-granule handle: {err.name}", flush=True)
    if err == cu.CUresult.CUDA_SUCCESS:
        print(f"  unmap it: {cu.cuMemUnmap(base, 2 * g)[0].name}", flush=True)
    check(cu.cuMemAddressFree(base, 4 * g))
    check(cu.cuMemRelease(handle))
    print("1. one 2 MiB handle mapped at every granule", flush=True)
    for n in (16_384, 65_536, 131_072, 262_144, 524_288):
        try:
            cover(n, 1)
        except RuntimeError:
            break
    print(f"2. a {block}-granule handle mapped at every {block}th granule", flush=True)
    for n in (131_072, 524_288):
        try:
            cover(n, block)
        except RuntimeError:
            break
    print("done", flush=True)


if __name__ == "__main__":
    main()
