"""KV memory: VmmArena (CUDA driver VMM through cuda-python, or host memory for CPU tests)
and EagerArena (ordinary XLA buffers).

Importing this package never imports CUDA: `VmmArena()` loads cuda-python when constructed.
"""

from jax_kv.memory._drivers import ArenaError, ArenaExhausted, CudaDriver, HostDriver
from jax_kv.memory.arena import (
    ArenaStats,
    CommitReport,
    Region,
    VmmArena,
    host_arena,
    reservation_ladder,
)
from jax_kv.memory.eager import EagerArena, EagerStats
from jax_kv.memory.mesh import MeshArena, MeshRegion

__all__ = [
    "ArenaError",
    "ArenaExhausted",
    "ArenaStats",
    "CommitReport",
    "CudaDriver",
    "EagerArena",
    "EagerStats",
    "HostDriver",
    "MeshArena",
    "MeshRegion",
    "Region",
    "VmmArena",
    "host_arena",
    "reservation_ladder",
]
