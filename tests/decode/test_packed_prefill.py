"""Prefill computes the real tokens only, in memory bounded by a chunk (issue 30): the model's
packed prefill equals its padded prefill; the Generator prefills in packed calls of at most
`prefill_chunk_tokens` real tokens, with the same tokens as the static reference loop at every
chunk boundary; its prefill's temporary memory does not depend on the longest prompt; its
counters say what was computed; a failure inside generate is the failure the caller sees, with
the arena back where it was."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_loop import greedy_static

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.decode import Generator
from jax_kv.decode.generator import PREFILL_MIN_TOKENS
from jax_kv.memory import EagerArena
from jax_kv.models import llama

LAYOUTS = [Layout.SEQ_MAJOR, Layout.HEAD_MAJOR]


@pytest.fixture(scope="module")
def model():
    return jm.random_model("tiny-llama", seed=7)


def caches_of(config, batch, capacity, layout, rng):
    """Per-layer caches of random past values (a wrong write or read shows)."""
    caches = llama.init_caches(config, batch, capacity, layout=layout, dtype=jnp.float32)
    return [
        tuple(jnp.asarray(rng.standard_normal(c.shape), jnp.float32) for c in pair)
        for pair in caches
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_prefill_equals_padded_prefill(model, layout, rng):
    """Rows with past and without, a row with no new tokens, padding past the real tokens:
    the last real token's logits and every cache agree with the padded [B, T] form."""
    config, S = model.config, 64
    past = np.array([0, 9, 4, 0], np.int32)
    new = np.array([5, 0, 17, 1], np.int32)
    T, N = int(new.max()), 32  # 23 real tokens packed into 32
    ids = [rng.integers(3, config.vocab_size, n) for n in new]
    padded = np.zeros((4, T), np.int32)
    packed = np.zeros((N,), np.int32)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    for b, row in enumerate(ids):
        padded[b, : len(row)] = row
        packed[cu[b] : cu[b + 1]] = row
    caches = caches_of(config, 4, S, layout, rng)
    copy = [tuple(jnp.array(c) for c in pair) for pair in caches]
    want, want_caches = llama.prefill(
        model.params, config, jnp.asarray(padded), jnp.asarray(new), caches, jnp.asarray(past),
        layout=layout, last_only=True,
    )  # fmt: skip
    got, got_caches = llama.prefill_packed(
        model.params, config, jnp.asarray(packed), jnp.asarray(cu), copy, jnp.asarray(past),
        layout=layout,
    )  # fmt: skip
    rows = new > 0
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], rtol=2e-5, atol=2e-5)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        np.testing.assert_allclose(np.asarray(gk), np.asarray(wk), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_rows_in_a_packed_call_equal_a_decode_step(model, layout, rng):
    """The Engine's prefill step: packed pieces for some rows and, in the same call, one decode
    token for others (the decode op's rows) give the logits, caches and status of a packed
    call followed by a decode step; an idle row (neither) is not touched; a decoding row whose
    bound refuses its write is latched alone."""
    config, S = model.config, 64
    past = np.array([0, 9, 12, 4, 7], np.int32)
    new = np.array([5, 0, 0, 17, 0], np.int32)  # rows 0, 3 prefill
    bound = np.array([0, S, S, 0, 0], np.int32)  # rows 1, 2 decode; row 4 idle
    N = 32
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    packed = np.zeros((N,), np.int32)
    packed[: cu[-1]] = rng.integers(3, config.vocab_size, cu[-1])
    step = np.where(bound > 0, rng.integers(3, config.vocab_size, 5), 0).astype(np.int32)
    committed = jnp.full((5,), S, jnp.int32)
    caches = caches_of(config, 5, S, layout, rng)
    copy = [tuple(jnp.array(c) for c in pair) for pair in caches]
    args = (jnp.asarray(packed), jnp.asarray(cu))
    want_p, mid, status_p = llama.prefill_packed(
        model.params, config, *args, caches, jnp.asarray(past), layout=layout,
        committed=committed,
    )  # fmt: skip
    want_d, want_caches, status_d = llama.decode_step(
        model.params, config, jnp.asarray(step), mid, jnp.asarray(past), layout=layout,
        committed=jnp.asarray(bound),
    )  # fmt: skip
    assert not np.asarray(status_p).any() and not np.asarray(status_d).any()

    def mixed(caches, bound):
        return llama.prefill_packed(
            model.params, config, *args, caches, jnp.asarray(past), layout=layout,
            committed=committed, decode_tokens=jnp.asarray(step), decode_bound=jnp.asarray(bound),
        )  # fmt: skip

    kept = [tuple(jnp.array(c) for c in pair) for pair in copy]
    got, got_caches, status = mixed(copy, bound)
    got = np.asarray(got)
    for rows, want in (([0, 3], want_p), ([1, 2], want_d)):
        np.testing.assert_allclose(got[rows], np.asarray(want)[rows], rtol=2e-5, atol=2e-5)
    # XLA's dots over N + 2 rows round differently from dots over N and over 2 (~1e-6 here);
    # the idle row's bytes are untouched.
    for (gk, gv), (wk, wv), (k0, v0) in zip(got_caches, want_caches, kept, strict=True):
        np.testing.assert_allclose(np.asarray(gk), np.asarray(wk), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(gk)[4], np.asarray(k0)[4])
        np.testing.assert_array_equal(np.asarray(gv)[4], np.asarray(v0)[4])
    assert np.asarray(status).tolist() == [0] * 5
    refused = bound.copy()
    refused[2] = past[2]  # its write at past[2] is at the bound: refused (traced: latched)
    _, _, status = jax.jit(mixed)(kept, refused)
    assert np.asarray(status).tolist() == [0, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="decode_tokens: needs decode_bound and committed"):
        llama.prefill_packed(
            model.params, config, *args, copy, jnp.asarray(past), layout=layout,
            decode_tokens=jnp.asarray(step),
        )  # fmt: skip


def test_packed_positions():
    cu = jnp.asarray([0, 3, 3, 5], jnp.int32)
    lengths = jnp.asarray([10, 20, 30], jnp.int32)
    got = llama.packed_positions(cu, lengths, 8).tolist()
    assert got == [10, 11, 12, 30, 31, 32, 33, 34]  # rows 0 and 2; padding continues row 2


def make_arena(kind: str):
    if kind == "eager":
        return EagerArena()
    from jax_kv.memory import VmmArena

    return VmmArena(reserve_bytes=1 << 30)


# The host driver's views cannot run a jitted step in place: XLA's CPU client does not donate
# DLPack-imported buffers (the output comes back elsewhere and the cache refuses it), so the
# VMM cases run on the GPU.
ARENAS = ["eager", pytest.param("vmm", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("arena_kind", ARENAS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_boundaries_keep_the_tokens(model, layout, arena_kind):
    """Prompts of exactly k * chunk and k * chunk + 1 tokens, of 1 token, and one longer than
    three chunks beside short ones: the tokens equal the static reference loop's."""
    chunk = 16
    lengths = [16, 17, 48, 1, 53, 5]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in lengths]
    want = greedy_static(model.params, model.config, prompts, 6, layout=layout)
    arena = make_arena(arena_kind)
    gen = Generator(model, layout=layout, min_bucket=16, prefill_chunk_tokens=chunk, arena=arena)
    out = gen.generate(prompts, 6, stop_tokens=())
    assert out.tokens == want
    s = out.stats
    real = sum(lengths)
    assert s.prefill_tokens == real
    assert s.prefill_calls == -(-real // chunk)  # every call but the last is full
    last = real - (s.prefill_calls - 1) * chunk
    assert s.prefill_tokens_computed == (s.prefill_calls - 1) * chunk + max(
        PREFILL_MIN_TOKENS, 1 << (last - 1).bit_length()
    )
    assert s.prefill_padding_ratio == s.prefill_tokens_computed / real


def test_prefill_computes_the_real_tokens_not_the_longest_prompt(model):
    """Many short prompts beside one long one: the padded form computed B x T positions, the
    packed form about the real tokens (rounded up to a power of two)."""
    lengths = [200] + [3] * 15
    prompts = [[5 + (i % 50) for i in range(n)] for n in lengths]
    out = Generator(model, min_bucket=16).generate(prompts, 2, stop_tokens=())
    s = out.stats
    assert s.prefill_calls == 1
    assert s.prefill_tokens == 245 and s.prefill_tokens_computed == 256  # padded: 16 x 256
    assert out.tokens == greedy_static(model.params, model.config, prompts, 2)


def test_prefill_compiles_per_token_bucket(model):
    gen = Generator(model, min_bucket=64)
    first = gen.generate([[5, 6, 7], [8, 9, 10, 11, 12]], 2, stop_tokens=())
    again = gen.generate([[4] * 6, [3] * 2], 2, stop_tokens=())  # 8 real tokens: same bucket
    assert first.stats.prefill_captures == 1 and again.stats.prefill_captures == 0
    longer = gen.generate([[4] * 20, [3] * 2], 2, stop_tokens=())  # 22 tokens: the next bucket
    assert longer.stats.prefill_captures == 1


def sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_prefill_temp_memory_does_not_depend_on_the_longest_prompt(model):
    """The chunk bounds a prefill call: the step for a 32k-token cache needs the same temporary
    memory as for a 1k one. The padded form's grows with T (the test's negative control)."""
    gen = Generator(model, prefill_chunk_tokens=512)
    small = gen.prefill_temp_bytes(8, 1024, 512)
    large = gen.prefill_temp_bytes(8, 32768, 512)
    assert small == large, (small, large)

    def padded_temp(T):
        config = model.config
        shape = Layout.SEQ_MAJOR.cache_shape(8, T, config.num_kv_heads, config.head_dim)
        caches = [(sds(shape, jnp.float32),) * 2] * config.num_layers
        fn = jax.jit(llama.prefill, static_argnames=("config", "layout", "last_only"))
        lowered = fn.lower(
            model.params, config, sds((8, T)), None, caches, sds((8,)), layout=Layout.SEQ_MAJOR,
            last_only=True,
        )  # fmt: skip
        return lowered.compile().memory_analysis().temp_size_in_bytes

    assert padded_temp(4096) > 4 * padded_temp(512)


def fail_on_call(gen: Generator, kind: str, n: int, error: BaseException, after: bool) -> None:
    """The n-th call of the chosen step kind raises `error`, before it runs (a dispatch that
    ran out of memory) or after (the step's outputs exist and reference the cache)."""
    run, calls = gen._call, {"prefill": 0, "decode": 0}

    def failing(key, args, stats):
        calls[key.kind] += 1
        hit = key.kind == kind and calls[key.kind] == n
        if hit and not after:
            raise error
        out = run(key, args, stats)
        if hit:
            raise error
        return out

    gen._call = failing


def cache_arrays_alive(config) -> set[int]:
    """ids of the live, undeleted jax arrays shaped like a seq-major cache of this model
    ([B, S, Hkv, D])."""
    tail = (config.num_kv_heads, config.head_dim)
    return {
        id(a)
        for a in jax.live_arrays()
        if a.ndim == 4 and a.shape[2:] == tail and not a.is_deleted()
    }


def arena_state(arena):
    return arena.committed_bytes, arena.stats().live_views if hasattr(arena, "live_views") else 0


@pytest.mark.parametrize("arena_kind", ARENAS)
@pytest.mark.parametrize("kind, n", [("prefill", 2), ("decode", 3)])
@pytest.mark.parametrize("after", [False, True], ids=["before-run", "after-run"])
def test_a_failure_inside_generate_is_what_the_caller_sees(model, arena_kind, kind, n, after):
    """A step's failure propagates as itself (an out-of-memory before or after the step ran,
    Ctrl-C), the cache closes cleanly, and the arena's committed bytes and live views are where
    they were before the call."""
    arena = make_arena(arena_kind)
    gen = Generator(model, min_bucket=16, arena=arena, prefill_chunk_tokens=16)
    prompts = [list(range(3, 40)), [5, 6, 7]]  # 40 tokens: three prefill calls
    gc.collect()
    before, alive = arena_state(arena), cache_arrays_alive(model.config)
    for error in (MemoryError(f"injected in {kind} call {n}"), KeyboardInterrupt()):
        fail_on_call(gen, kind, n, error, after)
        with pytest.raises(type(error)) as caught:
            gen.generate(prompts, 8, stop_tokens=())
        assert caught.value is error
        assert not getattr(error, "__notes__", None), error.__notes__  # the close was clean
        del caught
        gc.collect()
        assert arena_state(arena) == before, type(error).__name__
        # The caller still holds the error (and its traceback): the steps' references to the
        # cache's arrays went with the frames, before the cache closed.
        assert cache_arrays_alive(model.config) <= alive, type(error).__name__
        del gen._call  # the instance's own method again
    out = gen.generate(prompts, 4, stop_tokens=())  # the Generator still works
    assert out.tokens == greedy_static(model.params, model.config, prompts, 4)
    if arena_kind == "vmm":
        gc.collect()
        arena.close()


@pytest.mark.gpu
def test_each_row_commits_only_its_own_tokens_on_vmm():
    """Seq-major on the VMM arena: one long prompt beside short ones commits one long slot, not
    a batch of them (issue 30's mixed batch: 64 rows committed to the longest prompt needed
    64 GiB of KV for 5.5 GiB of tokens). Tokens equal the eager arena's."""
    import dataclasses

    from jax_kv.memory import VmmArena

    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_q_heads=16, num_kv_heads=8, head_dim=128,
        hidden_size=512, max_position_embeddings=4096,
    )  # fmt: skip
    model = jm.random_model(config, seed=4, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    lengths, new = [1100, 3, 40, 7], 5
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in lengths]
    eager = Generator(model, min_bucket=16, arena=EagerArena())
    want = eager.generate(prompts, new, stop_tokens=())
    arena = VmmArena(reserve_bytes=1 << 30)
    gen = Generator(model, min_bucket=16, max_len=2048, arena=arena, prefill_chunk_tokens=256)
    out = gen.generate(prompts, new, stop_tokens=())
    assert out.tokens == want.tokens
    tok, G = config.num_kv_heads * config.head_dim * 4, int(arena.granule)  # 512 tokens a granule

    def granules(tokens):  # one binding of one row: the commit step (16), then whole granules
        return -(-(-(-tokens // 16) * 16) * tok // G)

    rows = [granules(n + new) for n in lengths]  # [3, 1, 1, 1] on a 2 MiB granule
    bindings = 2 * config.num_layers
    assert out.stats.committed_bytes == bindings * sum(rows) * G < bindings * 4 * rows[0] * G
    gc.collect()
    arena.close()
