"""Zero blocks on CUDA, the driver calls the arena makes and the ones it must not (review of
dd28ad5): whole multi-granule handles mapped side by side, one set-access over several mappings,
set-access or unmap over part of a mapping, a map over a mapped granule, a prefix of a handle,
and a read after remapping. Prints each call's result (OK or the error name).

    python3 bench/experiments/zero_block_probe.py
"""

from cuda.bindings import driver as cu
from vmm_setup import access, open_device


def c(r):
    e, *v = r if isinstance(r, tuple) else (r,)
    return (cu.cuGetErrorName(e)[1].decode() if e else "OK"), (v[0] if len(v) == 1 else v)


def k(r):
    e, v = c(r)
    assert e == "OK", e
    return v


p, g = open_device()


def D(ro):
    return access(bool(ro))


def R(n):
    return k(cu.cuMemCreate(n * g, p, 0))


va = int(k(cu.cuMemAddressReserve(64 * g, 0, 0, 0)))
print("granule", g, "va%g", va % g, "va%(4g)", va % (4 * g))


def M(o, h, n):
    return c(cu.cuMemMap(va + o * g, n * g, 0, h, 0))[0]


def U(o, n):
    return c(cu.cuMemUnmap(va + o * g, n * g))[0]


def A(o, n, ro=1):
    return c(cu.cuMemSetAccess(va + o * g, n * g, D(ro), 1))[0]


b4, b2, b1 = R(4), R(2), R(1)
print("map block4@0", M(0, b4, 4), "piece2@4", M(4, b2, 2), "single@6", M(6, b1, 1))
print("set_access over block+piece+single (7g)", A(0, 7))
print("set_access over part of block (1g@1)", A(1, 1))
print("map single over mapped block granule 1", M(1, b1, 1))
print("unmap part of block (1g@1)", U(1, 1), "| unmap first 2g of block", U(0, 2))
print("unmap block+piece in one call (6g@0)", U(0, 6))
print("unmap single", U(6, 1))
print("map prefix 2g of a 4g handle", M(8, b4, 2))
print("cleanup", U(0, 4), U(4, 2), U(8, 2))
print(
    "remap block4@0",
    M(0, b4, 4),
    "set_access",
    A(0, 4),
    "dtoh read:",
    c(cu.cuMemcpyDtoH(bytearray(16), va, 16))[0],
)
v2 = int(k(cu.cuMemAddressReserve(4 * g, 0, 0, 0)))
print("piece va%g", v2 % g, "map", c(cu.cuMemMap(v2, 4 * g, 0, b4, 0))[0])
print("free_va with a live mapping:", c(cu.cuMemAddressFree(v2, 4 * g))[0])
print("release mapped handle", c(cu.cuMemRelease(b4))[0])
print(
    "unmap v2 after",
    c(cu.cuMemUnmap(v2, 4 * g))[0],
    "free after",
    c(cu.cuMemAddressFree(v2, 4 * g))[0],
)
print("sync", c(cu.cuCtxSynchronize())[0])
print(
    "map piece2@12 without set_access",
    M(12, b2, 2),
    "dtoh read:",
    c(cu.cuMemcpyDtoH(bytearray(16), va + 12 * g, 16))[0],
    "sync",
    c(cu.cuCtxSynchronize())[0],
)
