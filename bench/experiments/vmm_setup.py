"""The cuda-python set-up the VMM probes in this folder share: a driver call's result checked,
the device's primary context made current, the pinned device allocation properties with their
granule, and access descriptors."""

from cuda.bindings import driver as cu


def check(result):
    """A driver call's values, or RuntimeError with the error's text."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(cu.cuGetErrorString(err)[1].decode())
    return values[0] if len(values) == 1 else (values or None)


def open_device(ordinal: int = 0):
    """Makes the device's primary context current -> (allocation properties, granule bytes)."""
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(ordinal))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(dev))))
    return pinned_prop(ordinal)


def pinned_prop(ordinal: int = 0):
    """(pinned device allocation properties, their minimum granule in bytes)."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return prop, int(check(cu.cuMemGetAllocationGranularity(prop, flag)))


def access(read_only: bool, ordinal: int = 0) -> list:
    """The one-descriptor list cuMemSetAccess takes: read-only or read-write on the device."""
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = ordinal
    d.flags = (
        cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        if read_only
        else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )
    return [d]
