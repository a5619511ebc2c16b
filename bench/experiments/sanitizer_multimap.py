"""Does compute-sanitizer survive the VMM patterns of the prefix cache, without jax_kv?

The engine's prefix test crashed compute-sanitizer 2025.3.1 itself (SIGSEGV in its own
process, at the same address every time) within seconds, while smaller prefix tests passed
clean. This probe replays the driver patterns one by one with cuda-python and reads every
mapping with a CuPy kernel, printing each step before it runs, so the last line printed under
the sanitizer names the pattern it does not survive:
  1. one physical granule mapped read-write at one address and read-only at 2, 3, 4 more;
  2. one mapping of it unmapped while the others stay, then the handle released while mapped;
  3. the zero-granule pattern: one granule mapped read-only at 8 consecutive granules of one
     reservation, one cuMemSetAccess over the 8, then one of them replaced by a fresh granule;
  4. the arena's scale: a reservation of PROBE_RESERVE_GIB (1,024: the arena reserves up to 16x
     device memory) with the zero granule mapped at 64, 512, 4,096 and 16,384 granules (the
     4-slot prefix test maps thousands), each read by a kernel; then freed and reserved again.

    python3 bench/experiments/sanitizer_multimap.py
    compute-sanitizer --tool memcheck python3 bench/experiments/sanitizer_multimap.py
"""

import os

import cupy as cp
from cuda.bindings import driver as cu


def check(result):
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(cu.cuGetErrorString(err)[1].decode())
    return values[0] if len(values) == 1 else values


def step(text):
    print(text, flush=True)


def main():
    cp.zeros(1).sum()  # CuPy's runtime makes the primary context current
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    g = int(
        check(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            )
        )
    )

    def access(va, nbytes, read_only):
        d = cu.CUmemAccessDesc()
        d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = 0
        d.flags = (
            cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if read_only
            else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        check(cu.cuMemSetAccess(va, nbytes, [d], 1))

    def view(va, nbytes):
        mem = cp.cuda.UnownedMemory(int(va), nbytes, owner=None)
        return cp.ndarray((nbytes // 4,), cp.float32, cp.cuda.MemoryPointer(mem, 0))

    step(f"granule {g} bytes")
    handle = check(cu.cuMemCreate(g, prop, 0))
    vas = [int(check(cu.cuMemAddressReserve(g, 0, 0, 0))) for _ in range(5)]
    check(cu.cuMemMap(vas[0], g, 0, handle, 0))
    access(vas[0], g, read_only=False)
    view(vas[0], g).fill(1.0)  # a kernel writes through the read-write mapping
    for k in range(1, 5):
        step(f"1. map the granule read-only at a {k + 1}th address, read all {k + 1}")
        check(cu.cuMemMap(vas[k], g, 0, handle, 0))
        access(vas[k], g, read_only=True)
        sums = [float(view(va, g).sum()) for va in vas[: k + 1]]
        assert all(s == g // 4 for s in sums), sums
    step("2. unmap the 2nd mapping, read the others")
    check(cu.cuMemUnmap(vas[1], g))
    assert float(view(vas[2], g).sum()) == g // 4
    step("2. release the handle while 4 addresses map it, read them")
    check(cu.cuMemRelease(handle))
    assert all(float(view(va, g).sum()) == g // 4 for va in vas[2:] + vas[:1])
    for va in vas[:1] + vas[2:]:
        check(cu.cuMemUnmap(va, g))
    for va in vas:
        check(cu.cuMemAddressFree(va, g))

    step("3. one zeroed granule read-only at 8 consecutive granules, one access call")
    zero = check(cu.cuMemCreate(g, prop, 0))
    scratch = int(check(cu.cuMemAddressReserve(g, 0, 0, 0)))
    check(cu.cuMemMap(scratch, g, 0, zero, 0))
    access(scratch, g, read_only=False)
    view(scratch, g).fill(0.0)
    base = int(check(cu.cuMemAddressReserve(8 * g, 0, 0, 0)))
    for i in range(8):
        check(cu.cuMemMap(base + i * g, g, 0, zero, 0))
    access(base, 8 * g, read_only=True)
    assert float(view(base, 8 * g).sum()) == 0.0
    step("3. replace the 4th by a fresh read-write granule, write it, read all 8")
    fresh = check(cu.cuMemCreate(g, prop, 0))
    check(cu.cuMemUnmap(base + 3 * g, g))
    check(cu.cuMemMap(base + 3 * g, g, 0, fresh, 0))
    access(base + 3 * g, g, read_only=False)
    view(base + 3 * g, g).fill(2.0)
    assert float(view(base, 8 * g).sum()) == 2.0 * (g // 4)
    step("3. unmap all, release")
    for i in range(8):
        check(cu.cuMemUnmap(base + i * g, g))
    check(cu.cuMemUnmap(scratch, g))
    for h in (zero, fresh):
        check(cu.cuMemRelease(h))
    check(cu.cuMemAddressFree(base, 8 * g))
    check(cu.cuMemAddressFree(scratch, g))
    big = int(os.environ.get("PROBE_RESERVE_GIB", "1024")) << 30
    zero = check(cu.cuMemCreate(g, prop, 0))
    for again in range(2):
        base = int(check(cu.cuMemAddressReserve(big, 0, 0, 0)))
        mapped = 0
        for n in (64, 512, 4096, 16384):
            step(
                f"4. reservation {big >> 30} GiB{' (again)' if again else ''}: the zero granule "
                f"at {n} granules, one access call, a kernel reads them"
            )
            for i in range(mapped, n):
                check(cu.cuMemMap(base + i * g, g, 0, zero, 0))
            access(base + mapped * g, (n - mapped) * g, read_only=True)
            mapped = n
            assert float(view(base, n * g)[:: 1 << 12].sum()) == 0.0
        step(f"4. unmap {mapped} granules, free the reservation")
        for i in range(mapped):
            check(cu.cuMemUnmap(base + i * g, g))
        check(cu.cuMemAddressFree(base, big))
    check(cu.cuMemRelease(zero))
    step("done: every pattern ran")


if __name__ == "__main__":
    main()
