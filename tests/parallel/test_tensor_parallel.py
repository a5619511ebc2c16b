"""Tensor parallelism over KV heads (issue 28, items 1-3) on forced host devices: the ops run per
shard under shard_map (each device its KV heads and their query heads, caches updated in place
per shard), the params are sharded Megatron-style (one all-reduce after wo and after down, no
other collective), each device's KV memory is its own VMM arena (MeshArena: commits on every
device or on none, one global array over the per-device views, zero-copy), and the engine's
greedy tokens at tp=2 and tp=4 equal tp=1's.

Needs 4 devices: `make test` runs this file a second time with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be set before JAX starts, so
the suite's own run skips it)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kv.models as jm
from jax_kv import Sampling
from jax_kv.cache import KvCache
from jax_kv.decode import Generator
from jax_kv.engine import Engine
from jax_kv.layout import Layout
from jax_kv.memory import ArenaError, ArenaExhausted, EagerArena, MeshArena, host_arena
from jax_kv.models import llama
from jax_kv.ops import gqa_decode, gqa_prefill, gqa_prefill_packed
from jax_kv.parallel import cache_sharding, head_sharded, shard_params, tp_mesh

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 (make test)",
)

B, S, HQ, HKV, D = 3, 48, 8, 4, 64
LAYOUTS = [Layout.SEQ_MAJOR, Layout.HEAD_MAJOR]


def pointers(a):
    return [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]


def sharded(mesh, layout, *caches):
    return [jax.device_put(c, cache_sharding(mesh, layout)) for c in caches]


def op_inputs(rng, layout, tokens):
    shape = layout.cache_shape(B, S, HKV, D)
    q = rng.standard_normal((tokens, HQ, D), np.float32)
    k, v = (rng.standard_normal((tokens, HKV, D), np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal(shape, np.float32) for _ in range(2))
    return q, k, v, kc, vc


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_decode_per_shard_equals_the_whole_op(rng, tp, layout):
    mesh = tp_mesh(tp)
    q, k, v, kc, vc = op_inputs(rng, layout, B)
    lengths = jnp.array([0, 17, S - 1], jnp.int32)
    committed = jnp.array([S, S, S - 1], jnp.int32)  # row 2 refused: its length is not backed
    # Traced lengths (jit): the refused row latches instead of a Python refusal.
    whole = jax.jit(functools.partial(gqa_decode, layout=layout, return_status=True))
    want = whole(q, k, v, kc, vc, lengths, committed=committed)
    step = jax.jit(
        functools.partial(head_sharded(gqa_decode, mesh), layout=layout, return_status=True),
        donate_argnums=(3, 4),
    )
    kc2, vc2 = sharded(mesh, layout, kc, vc)
    before = pointers(kc2)
    got = step(q, k, v, kc2, vc2, lengths, committed=committed)
    assert pointers(got[1]) == before, "the cache moved: not updated in place per shard"
    assert got[1].sharding.is_equivalent_to(cache_sharding(mesh, layout), 4)
    assert np.asarray(got[3]).tolist() == [0, 0, 1]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_packed_and_padded_prefill_per_shard_equal_the_whole_op(rng, tp, layout):
    mesh = tp_mesh(tp)
    q, k, v, kc, vc = op_inputs(rng, layout, 24)
    lengths = jnp.array([0, 9, 30], jnp.int32)
    cu = jnp.array([0, 7, 7, 20], jnp.int32)  # 7 new, none, 13 new; rows 20..23 padding
    want = gqa_prefill_packed(q, k, v, kc, vc, lengths, cu, layout=layout)
    call = head_sharded(gqa_prefill_packed, mesh)
    got = jax.jit(functools.partial(call, layout=layout), donate_argnums=(3, 4))(
        q, k, v, *sharded(mesh, layout, kc, vc), lengths, cu
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # The padded form, with new_lengths (a per-row keyword): [B, T, H, D].
    qp, kp, vp = (x[:18].reshape(B, 6, *x.shape[1:]) for x in (q, k, v))
    new = jnp.array([6, 0, 4], jnp.int32)
    want = gqa_prefill(qp, kp, vp, kc, vc, lengths, new_lengths=new, layout=layout)
    got = jax.jit(functools.partial(head_sharded(gqa_prefill, mesh), layout=layout))(
        qp, kp, vp, *sharded(mesh, layout, kc, vc), lengths, new_lengths=new
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_q_heads=HQ, num_kv_heads=HKV, hidden_size=128
    )
    return jm.random_model(config, seed=1)


def test_megatron_params_need_one_all_reduce_per_row_parallel_projection(model):
    """The decode step at tp=4: two all-reduces per layer (after wo, after down) and no other
    collective; each shard's attention call sees its 2 query heads and its 1 KV head."""
    mesh, layout, config = tp_mesh(4), Layout.SEQ_MAJOR, model.config
    params = shard_params(model, mesh)
    assert params["layers"][0]["wq"].sharding.spec == P("tp", None)
    assert params["layers"][0]["wo"].sharding.spec == P(None, "tp")
    assert params["embed"].sharding.spec == P()
    plain = llama.init_caches(config, B, S, layout=layout)
    caches = [tuple(sharded(mesh, layout, *kv)) for kv in plain]
    step = jax.jit(
        functools.partial(
            llama.decode_step, config=config, layout=layout,
            attention=head_sharded(gqa_decode, mesh),
        ),
        donate_argnames=("caches",),
    )  # fmt: skip
    zeros = jnp.zeros((B,), jnp.int32)
    text = step.lower(params, tokens=zeros, caches=caches, lengths=zeros).compile().as_text()
    ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    count = {op: len(re.findall(rf"= \S+ {op}\(", text)) for op in ops}
    assert count == {
        "all-reduce": 2 * config.num_layers, "all-gather": 0, "all-to-all": 0,
        "collective-permute": 0, "reduce-scatter": 0,
    }, count  # fmt: skip
    calls = [line for line in text.splitlines() if "custom-call(" in line]
    assert calls and all(f"[{B},{HQ // 4},{D}]" in line for line in calls), calls[:1]


@pytest.mark.parametrize("buckets", [False, True], ids=["all-rows", "row-buckets"])
def test_engine_tokens_at_tp_2_and_4_equal_tp_1_and_the_generator(model, rng, buckets):
    """With decode row buckets too (3 slots: buckets 1 and 3): the step's gather and scatter
    of the bucket's rows around the per-shard attention op."""
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 70, 1, 33, 130, 9)]

    def serve(mesh):
        with Engine(model, max_slots=3, max_len=256, prefill_chunk_tokens=64,
                    arena=EagerArena(), mesh=mesh,
                    decode_row_buckets=buckets) as eng:  # fmt: skip
            reqs = [eng.submit(p, 20, stop_token_ids=[]) for p in prompts]
            eng.run_until_idle()
            assert (
                eng.stats.decode_compiles
                == len(eng.stats.decode_bucket_calls)
                <= len(eng.decode_buckets())
            )
            if mesh is not None:
                want_sharding = cache_sharding(mesh, Layout.SEQ_MAJOR)
                assert eng.cache.k[0].sharding.is_equivalent_to(want_sharding, 4)
            return [r.result().tokens for r in reqs]

    alone = Generator(model, arena=EagerArena(), max_len=256)
    want = [alone.generate([p], 20, stop_tokens=[]).tokens[0] for p in prompts]
    assert serve(None) == want
    for tp in (2, 4):
        assert serve(tp_mesh(tp)) == want, f"tp={tp}"


@pytest.mark.parametrize(
    ("arena", "buckets"), [("eager", False), ("mesh-vmm", False), ("eager", True)]
)
def test_a_sharded_engine_compiles_nothing_after_warm_up(model, rng, arena, buckets):
    """Every compiled step and picker is compiled once per signature in warm_up (per decode
    bucket, with decode row buckets: 1 and 3 at 3 slots), and a burst of requests of every
    length adds none, by jit's own cache and by EngineStats (which counts it: a retrace
    counter misses a recompile for a new argument sharding). The caches the eager path feeds
    back carry the step's output sharding, spelled as the input's (cache_spec)."""
    mesh = tp_mesh(2)
    made = EagerArena() if arena == "eager" else mesh_arena(2)
    with Engine(model, max_slots=3, max_len=256, prefill_chunk_tokens=32, mesh=mesh,
                arena=made, decode_row_buckets=buckets) as eng:  # fmt: skip
        eng.warm_up()
        steps = (eng._prefill, eng._decode, eng._greedy, eng._sampler)
        before = [f._cache_size() for f in steps]
        rows = len(eng.decode_buckets())
        assert rows == (2 if buckets else 1)
        assert before == [len(eng.stats.prefill_buckets), rows, rows, rows]
        counted = (eng.stats.prefill_compiles, eng.stats.decode_compiles)
        assert counted == tuple(before[:2]) and eng.stats.sampler_compiles == 2 * rows
        for i, n in enumerate(rng.integers(1, 200, 12)):
            prompt = [int(t) for t in rng.integers(3, 500, n)]
            sampling = Sampling(temperature=0.9, seed=i) if i % 2 else None
            eng.submit(prompt, 8, sampling, stop_token_ids=[])
        eng.run_until_idle()
        assert [f._cache_size() for f in steps] == before
        assert (eng.stats.prefill_compiles, eng.stats.decode_compiles) == counted


def test_refusals_name_the_argument(model):
    with pytest.raises(ValueError, match=r"tp: expected an int >= 1, got 0"):
        tp_mesh(0)
    with pytest.raises(ValueError, match=r"tp: 5 devices asked for, 4 present"):
        tp_mesh(5, jax.devices()[:4])
    odd = jm.random_model("tiny-llama", seed=2)  # 2 KV heads
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_kv_heads=2"):
        Engine(odd, max_slots=2, max_len=64, arena=EagerArena(), mesh=tp_mesh(4))
    with pytest.raises(ValueError, match=r"fuse_projections: tensor parallelism shards"):
        Engine(model, max_slots=2, max_len=64, arena=EagerArena(), mesh=tp_mesh(2),
               fuse_projections=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"params: layer weight 'wqkv' is fused"):
        llama.partition_specs(model.fused_params())


def test_a_one_device_vmm_arena_under_a_mesh_is_refused(model):
    arena = host_arena(reserve_bytes=64 << 20)
    try:
        with pytest.raises(ValueError, match=r"arena: a VmmArena holds one device's memory"):
            Engine(model, max_slots=2, max_len=64, arena=arena, mesh=tp_mesh(2))
        assert arena.committed_bytes == 0
    finally:
        arena.close()


# -- per-device VMM arenas (MeshArena) ------------------------------------------------------


def mesh_arena(tp, **kw):
    arenas = [
        host_arena(reserve_bytes=64 << 20, granule=G, device=d, **kw) for d in jax.devices()[:tp]
    ]  # fmt: skip
    return MeshArena(tp_mesh(tp), arenas)


G = 64 << 10
SPLIT = P(None, None, "tp", None)


def test_mesh_arena_exports_one_global_array_over_the_devices_zero_copy():
    arena = mesh_arena(4)
    region = arena.allocate(8 * G, SPLIT)  # 2 device granules per device
    assert region.reserved_bytes == 8 * G and arena.granule == 4 * G
    region.commit(8 * G)
    for i, part in enumerate(region.parts):  # device i's shard: its KV heads, value i
        arena.arenas[i].write(part.ptr, np.full((2 * G // 4,), i, np.float32).tobytes())
    x = region.export((4, 128, 4, 64), jnp.float32)  # [B, S, Hkv, D]: one KV head per device
    assert x.sharding.is_equivalent_to(NamedSharding(arena.mesh, SPLIT), 4)
    assert [s.data.unsafe_buffer_pointer() for s in x.addressable_shards] == [
        p.ptr for p in region.parts
    ]  # fmt: skip
    assert region.holds(x)
    host = np.asarray(x)
    assert all((host[:, :, h] == h).all() for h in range(4))
    assert arena.committed_bytes == arena.physical_bytes([region]) == 8 * G
    del x, host
    arena.wait_unviewed([region])
    region.free()
    arena.close()


def test_mesh_arena_commits_on_every_device_or_on_none():
    """Device 2 can hold 1 granule: a commit of 2 per device fails there, and the devices
    that had committed are rolled back; a commit of 1 per device succeeds everywhere."""
    arenas = [
        host_arena(
            reserve_bytes=64 << 20, granule=G, device=d, limit_bytes=(2 if i == 2 else 64) * G
        )  # 1 + the zero granule  # fmt: skip
        for i, d in enumerate(jax.devices()[:4])
    ]
    arena = MeshArena(tp_mesh(4), arenas)
    region = arena.allocate(16 * G, SPLIT)
    with pytest.raises(Exception, match=r"(?i)exhaust|limit|memory"):
        arena.commit([(region, 0, 8 * G)])
    assert arena.committed_bytes == 0, [a.committed_bytes for a in arenas]
    arena.commit([(region, 0, 4 * G)])
    assert [a.committed_bytes for a in arenas] == [G] * 4
    region.free()
    arena.close()


def test_mesh_arena_shares_and_copies_on_every_device():
    arena = mesh_arena(2)
    src, dst = arena.allocate(4 * G, SPLIT), arena.allocate(4 * G, SPLIT)
    src.commit(4 * G)  # 2 device granules each
    arena.share(src, 0, dst, 0, 4 * G)
    assert arena.committed_bytes == 4 * G  # shared: counted once
    assert arena.physical_bytes([dst]) == 4 * G and arena.physical_bytes([src, dst]) == 4 * G
    assert arena.copy_on_write(dst, 2 * G, 2 * G) == 2  # one granule per device
    assert arena.committed_bytes == 6 * G
    arena.decommit_now([(dst, 0, 4 * G)])
    assert arena.committed_bytes == 4 * G
    for r in (src, dst):
        r.free()
    arena.close()


def test_mesh_arena_holds_maps_and_recommits_on_every_device():
    arena = mesh_arena(2)
    src, dst = arena.allocate(4 * G, SPLIT), arena.allocate(4 * G, SPLIT)
    src.commit(4 * G)  # 2 device granules each
    held = arena.hold(src, 0, 4 * G)
    assert [len(h) for h in held] == [2, 2]
    arena.decommit_now([(src, 0, 4 * G)])
    assert arena.committed_bytes == 4 * G  # held, mapped nowhere
    arena.map_held(held, dst, 0)
    ids = {id(h) for part in held for h in part}
    assert arena.physical_bytes([dst]) == arena.physical_bytes([dst], ids) == 4 * G
    arena.recommit([(dst, 0, 4 * G)])  # fresh granules in place of the held ones
    assert arena.committed_bytes == 8 * G and arena.physical_bytes([dst]) == 4 * G
    assert arena.release_held(held) == 4 * G
    assert arena.committed_bytes == 4 * G
    for r in (src, dst):
        r.free()
    arena.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_engine_on_per_device_vmm_arenas_equals_tp_1(model, rng, tp):
    """Slots are VMM ranges on every device: the memory invariant holds after every step (the
    arenas' physical bytes are what the cache counts), the exported caches are the arenas'
    memory on every device, greedy tokens equal the one-device engine's (the prefix cache on,
    blocks shared by two requests with a common prefix), and closing returns every byte."""
    prefix = [int(t) for t in rng.integers(3, 500, 300)]
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 70, 1, 33, 130)]
    prompts += [prefix + [7, 8], prefix + [9]]

    def serve(mesh, arena):
        eng = Engine(model, max_slots=3, max_len=512, prefill_chunk_tokens=64, arena=arena,
                     mesh=mesh)  # fmt: skip
        reqs = [eng.submit(p, 20, stop_token_ids=[]) for p in prompts]
        while eng.has_work():
            eng.step()
            eng.check_memory()
        assert (
            eng.stats.decode_compiles
            == len(eng.stats.decode_bucket_calls)
            <= len(eng.decode_buckets())
        )
        regions = eng.cache.regions
        if mesh is not None:
            assert all(r.holds(a) for r, a in zip(regions, eng.cache.k, strict=False))
        hits = eng.prefix.stats.hit_tokens
        assert eng.stats.slots_handed_over > 0  # slots linked to the store, handed over
        eng.close()
        return [r.result().tokens for r in reqs], hits

    one = host_arena(reserve_bytes=64 << 20, granule=G)
    want, _ = serve(None, one)
    one.close()
    arena = mesh_arena(tp)
    got, hits = serve(tp_mesh(tp), arena)
    assert got == want
    assert hits > 0  # the common prefix was mapped, not recomputed
    assert arena.committed_bytes == 0
    arena.close()


# -- the Generator and its KvCache under a mesh ---------------------------------------------


def test_generator_at_tp_2_and_4_equals_tp_1(model, rng):
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 70, 33)]
    want = Generator(model, arena=EagerArena(), min_bucket=16).generate(prompts, 40, stop_tokens=[])
    for tp in (2, 4):
        gen = Generator(model, arena=EagerArena(), min_bucket=16, mesh=tp_mesh(tp))
        got = gen.generate(prompts, 40, stop_tokens=[])  # grows from 16 through 128 tokens
        assert got.tokens == want.tokens, f"tp={tp}"


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_cache_on_a_mesh_arena_grows_on_every_device_and_keeps_the_step(tp):
    """Seq-major on per-device arenas: every growth commits on each device (the same bytes
    on each, their sum what the cache counts), moves 0 bytes, keeps every shard's pointer
    (so the compiled step is kept on every device), and close returns every byte."""
    mesh = tp_mesh(tp)
    arena = mesh_arena(tp)
    cache = KvCache(num_layers=2, batch=3, num_kv_heads=HKV, head_dim=D, dtype=jnp.float32,
                    arena=arena, max_len=4096, min_bucket=64, mesh=mesh)  # fmt: skip
    assert cache.k[0].sharding.is_equivalent_to(cache_sharding(mesh, Layout.SEQ_MAJOR), 4)
    before = cache.pointers()
    assert len(before) == 2 * 2 * tp  # one per array and device
    events = [cache.ensure_capacity(n) for n in (100, 700, 2000)]
    assert all(e.keeps_compiled_step and e.bytes_moved == 0 for e in events)
    assert cache.pointers() == before
    per_device = [a.committed_bytes for a in arena.arenas]
    assert len(set(per_device)) == 1 and sum(per_device) == cache.committed_bytes + tp * G
    cache.close()  # (+ each device's committed control granule, freed with the cache)
    assert arena.committed_bytes == 0
    with pytest.raises(ValueError, match=r"layout: a head-major cache on a MeshArena"):
        KvCache(num_layers=1, batch=1, num_kv_heads=HKV, head_dim=D, arena=arena,
                layout=Layout.HEAD_MAJOR, max_len=256, mesh=mesh)  # fmt: skip
    assert arena.committed_bytes == 0
    arena.close()


def test_a_growth_one_device_refuses_raises_its_cause_and_rolls_back():
    """Device 1 has no memory for a growth device 0 already committed: the caller sees
    ArenaExhausted and device 0 gives back what it mapped. The rollback used to decommit the
    same byte ranges, which for a seq-major cache are token ranges, not granule-aligned: its
    own ArenaError replaced the cause and device 0 kept the granules."""
    mesh = tp_mesh(2)
    d0, d1 = mesh.devices.flat
    g = 64 << 10
    a0 = host_arena(reserve_bytes=64 << 20, granule=g, device=d0)
    a1 = host_arena(reserve_bytes=64 << 20, granule=g, device=d1, limit_bytes=8 * g)
    arena = MeshArena(mesh, arenas=[a0, a1])
    cache = KvCache(
        num_layers=1, batch=1, num_kv_heads=2, head_dim=64, dtype=jnp.float32, arena=arena,
        mesh=mesh, max_len=4096, min_bucket=16, commit_ahead=16,
    )  # fmt: skip
    try:
        before = [a0.committed_bytes, a1.committed_bytes]
        with pytest.raises(ArenaExhausted):
            cache.ensure_capacity(4096)
        assert cache.capacity == 16
        assert [a0.committed_bytes, a1.committed_bytes] == before
    finally:
        cache.close()
        arena.close()


def test_mesh_arena_close_closes_every_arena_when_one_fails():
    """As VmmArena.close does its steps: every device's arena is closed, also past one that
    fails, and the failures are raised together (it stopped at the first)."""
    mesh = tp_mesh(2)
    d0, d1 = mesh.devices.flat
    a0 = host_arena(reserve_bytes=64 << 20, device=d0)
    a1 = host_arena(reserve_bytes=64 << 20, device=d1)
    arena = MeshArena(mesh, arenas=[a0, a1])
    a0.driver.inject_failure("release")  # device 0's teardown cannot release a handle
    with pytest.raises(ArenaError, match="MeshArena.close: .*injected release failure"):
        arena.close()
    assert a0.closed and a1.closed and a1.stats().handles_live == 0
