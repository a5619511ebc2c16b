"""A host-driver arena's bytes, written and read through the driver's host view (the memory
tests' way to see what a mapping holds without a kernel)."""

from __future__ import annotations

import numpy as np


def fill(arena, region, offset, nbytes, value):
    arena.driver.host_view(region.ptr + offset, nbytes)[:] = bytes([value]) * nbytes


def read(arena, region, offset, nbytes) -> np.ndarray:
    return np.frombuffer(bytes(arena.driver.host_view(region.ptr + offset, nbytes)), np.uint8)
