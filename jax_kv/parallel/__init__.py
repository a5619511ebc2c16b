"""Tensor parallelism over KV heads (issue 28): a mesh axis splits every layer's KV heads (and
the query heads that read them) over devices, as jax-llm-examples, MaxText and vLLM do.

- `tp_mesh(tp)`: a one-axis `Mesh` named "tp" over the first tp devices.
- `head_sharded(op, mesh)`: an attention op (`gqa_decode`, `gqa_prefill`, `gqa_prefill_packed`)
  run under `shard_map`, each device on its own heads. Its contract is the op's: q, k, v and
  the caches are global arrays whose head axes are split over the mesh; per-row values
  (lengths, cu_seqlens, committed, new_lengths) are replicated; the caches are updated in
  place per shard (donate them); the status, where asked, is the maximum over shards.
- `cache_sharding(mesh, layout)`: the `NamedSharding` of a cache `[B, S, Hkv, D]` (seq-major)
  or `[B, Hkv, S, D]` (head-major) with Hkv split.
- `check_tp(num_kv_heads, tp)`: refuses a split that breaks a KV head, by name.
- `put_replicated(values, mesh)`: per-row host values as the step's input, whole on every
  device of the mesh (every process passes the same values).
- `shard_params(model, mesh)`: the model's params laid out by its `partition_specs`.
- `params_and_attention(model, mesh, fuse_projections)`: what a loop (Generator, Engine) steps
  with, with or without a mesh.

The projections are sharded Megatron-style through `jax_kv.models.llama.partition_specs`:
each shard computes its own heads' q/k/v and its part of the MLP's hidden units; the output and
down projections are row-parallel and XLA adds one all-reduce after each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kv.config import runtime_config
from jax_kv.layout import Layout

TP_AXIS = "tp"

# Per-row arrays an op may take by keyword: replicated on every shard.
_ROW_KEYWORDS = ("new_lengths", "committed")


def tp_mesh(tp: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh of `tp` devices on the axis "tp" (default: the first tp of jax.devices())."""
    if isinstance(tp, bool) or not isinstance(tp, int | np.integer) or tp < 1:
        raise ValueError(f"tp: expected an int >= 1, got {tp!r}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp:
        raise ValueError(f"tp: {tp} devices asked for, {len(devices)} present")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[TP_AXIS])


def check_tp(num_kv_heads: int, tp: int) -> None:
    """Refuses a split that would break a KV head (the query heads follow: Hq is a multiple
    of Hkv, so whole KV heads per device carry whole groups of query heads)."""
    if num_kv_heads % tp:
        raise ValueError(
            f"mesh: tp={tp} does not divide num_kv_heads={num_kv_heads}; KV heads are split "
            f"over the tp axis, whole"
        )


def put_replicated(values: Any, mesh: Mesh | None) -> jax.Array:
    """Host values (per-row lengths, bounds, sampling) on the device, or whole on every
    device of `mesh`: one kind of array per input, so a step compiles once."""
    if mesh is None:
        return jnp.asarray(values)
    return jax.device_put(values, NamedSharding(mesh, P()))


def cache_spec(layout: Layout | str | int) -> P:
    """The PartitionSpec of a cache array: its Hkv axis on "tp". No trailing None: a
    compiled step's outputs carry their spec without one, and a cache array fed back with
    another spelling of the same sharding is another jit signature (one more compile)."""
    if Layout.parse(layout) == Layout.SEQ_MAJOR:
        return P(None, None, TP_AXIS)  # [B, S, Hkv, D]
    return P(None, TP_AXIS)  # [B, Hkv, S, D]


def cache_sharding(mesh: Mesh | None, layout: Layout | str | int) -> NamedSharding | None:
    """The NamedSharding of a cache array over `mesh` (None without a mesh)."""
    return None if mesh is None else NamedSharding(mesh, cache_spec(layout))


def shard_params(model: Any, mesh: Mesh) -> Any:
    """A copy of model.params laid out over mesh's "tp" axis as the model's
    `partition_specs(axis)` says (Megatron-style for jax_kv.models: column-parallel q/k/v and
    gate/up, row-parallel wo and down, the rest replicated)."""
    specs_of = getattr(model, "partition_specs", None)
    if specs_of is None:
        raise ValueError(
            f"mesh: {type(model).__name__} has no partition_specs(axis): tensor parallelism "
            f"needs the model's layout of its params over the tp axis"
        )
    specs = specs_of(TP_AXIS)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    return jax.tree.map(_put, model.params, shardings)


def _put(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """x laid out as `sharding`. Under a multi-process mesh (devices of other processes in it)
    each process gives its own devices' shards, cut from its full copy of x."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def params_and_attention(
    model: Any, mesh: Mesh | None, fuse_projections: bool | None
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """What a loop (Generator, Engine) steps with: (params, {"prefill": kwargs, "decode":
    kwargs}) where the kwargs name the attention the model's step should call.

    Without a mesh: the fused params (default) or the model's own, the ops as they are. Under a
    mesh: the params sharded by `shard_params` (unfused: fused rows would split across the
    wrong boundary) and the ops per shard (`head_sharded`)."""
    if mesh is None:
        fuse = True if fuse_projections is None else bool(fuse_projections)
        return (model.fused_params() if fuse else model.params), {"prefill": {}, "decode": {}}
    if fuse_projections:
        raise ValueError(
            "fuse_projections: tensor parallelism shards the unfused q/k/v and gate/up "
            "weights; leave it None or False with a mesh"
        )
    from jax_kv.ops import gqa_decode, gqa_prefill_packed

    check_tp(model.config.num_kv_heads, mesh_size(mesh))
    if runtime_config().batch_invariant and mesh_size(mesh) > 2:
        # The row-parallel projections' all-reduce sums tp partials in an order its algorithm
        # picks by message size, so by the rows of the call; two partials add in one order.
        raise ValueError(
            f"mesh: the batch-invariant mode (JAX_KV_BATCH_INVARIANT=1) takes a tp axis of at "
            f"most 2 devices, got {mesh_size(mesh)}: the all-reduce of more partials sums them "
            f"in an order that follows the batch"
        )
    attention = {
        "prefill": {"attention": head_sharded(gqa_prefill_packed, mesh)},
        "decode": {"attention": head_sharded(gqa_decode, mesh)},
    }
    return shard_params(model, mesh), attention


def head_sharded(op: Callable[..., tuple], mesh: Mesh) -> Callable[..., tuple]:
    """`op` with its contract, run per shard of mesh's "tp" axis on that shard's heads.

    q, k, v carry heads on their second-to-last axis ([B, Hq, D], [N, Hq, D], [B, T, Hq, D]);
    the caches as `cache_spec(layout)`. Positional arguments after the caches (lengths,
    cu_seqlens) and the keywords new_lengths / committed are per-row values, replicated.
    Every shard sees the same rows, so each computes the same status; it is reduced with a
    max over the axis all the same, so a shard that latched is never hidden.
    """
    tp = mesh_size(mesh)

    def call(q, k, v, k_cache, v_cache, *rows, layout, return_status=False, **kwargs):
        layout = Layout.parse(layout)
        check_tp(k.shape[-2], tp)  # the op itself checks the head ratio
        arrays = {n: kwargs.pop(n) for n in _ROW_KEYWORDS if kwargs.get(n) is not None}
        heads = P(*([None] * (q.ndim - 2)), TP_AXIS, None)
        cache = cache_spec(layout)
        names = tuple(arrays)

        def body(q, k, v, k_cache, v_cache, *rest):
            per_row = dict(zip(names, rest[len(rows) :], strict=True))
            out = op(
                q, k, v, k_cache, v_cache, *rest[: len(rows)], layout=layout,
                return_status=return_status, **per_row, **kwargs,
            )  # fmt: skip
            if return_status:
                return (*out[:3], jax.lax.pmax(out[3], TP_AXIS))
            return out

        in_specs = (heads, heads, heads, cache, cache) + (P(),) * (len(rows) + len(names))
        out_specs = (heads, cache, cache) + ((P(),) if return_status else ())
        sharded = jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return sharded(q, k, v, k_cache, v_cache, *rows, *arrays.values())

    call.__name__ = f"head_sharded_{getattr(op, '__name__', 'op')}"
    call.__doc__ = f"{getattr(op, '__name__', 'op')} split over the tp axis of {mesh}."
    return call


__all__ = [
    "TP_AXIS",
    "cache_sharding",
    "cache_spec",
    "check_tp",
    "head_sharded",
    "mesh_size",
    "put_replicated",
    "params_and_attention",
    "shard_params",
    "tp_mesh",
]
