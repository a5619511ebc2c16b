"""Decode row buckets (Engine(decode_row_buckets)): the Engine's decode-only call runs the
projections, the MLP, the logits and the token picker on the smallest bucket of rows
(max_slots and up to three halvings) that holds its decoding slots, the attention op still over
every cache row (the others idle). Checked:

- `llama.decode_step(rows=)` gives each listed row the logits and cache writes of the full
  step and leaves every other row untouched;
- the buckets and the default (on from 128 slots);
- one compile of the step and two of the pickers per bucket, all in warm_up, and greedy tokens
  equal to Generator alone at every occupancy; sampled tokens equal with buckets and without;
- a decode call dispatched ahead (Engine(decode_ahead)) takes a bucket that holds its rows,
  each listed in its row index, and every row it writes is listed;
- the row index is an input at a fixed address (one per bucket, rewritten in place), as the
  other per-step inputs are, so XLA can replay each bucket's recorded CUDA graph."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv import Sampling
from jax_kv.engine import Engine
from jax_kv.layout import Layout
from jax_kv.memory import EagerArena, host_arena
from jax_kv.models import llama

MAX_LEN = 256


def token_bytes(model):
    c = model.config
    return c.num_kv_heads * c.head_dim * 4  # f32


def staggered(rng, model, n):
    """n (prompt, max_new) of staggered lengths: an engine of 8 slots serving them passes
    through every occupancy from 8 down to 1."""
    vocab = model.config.vocab_size
    return [
        ([int(t) for t in rng.integers(3, vocab, int(rng.integers(3, 30)))], 2 + 3 * i)
        for i in range(n)
    ]


def alone(generator, prompt, n):
    return list(generator.generate([prompt], n, stop_tokens=[]).tokens[0])


@pytest.mark.parametrize("rows", [[4, 1, 6, 6], [0, 2, 3, 5], [5, 6]])
def test_decode_step_on_rows_equals_the_full_step(model, rng, rows):
    """6 cache rows with random pasts; `rows` lists the advancing ones (6: padding). Against
    the full step with the same write bound (0 for the others: idle)."""
    config, B, S = model.config, 6, 64
    params = model.params
    caches = [
        tuple(jnp.asarray(rng.standard_normal((B, S, config.num_kv_heads, config.head_dim)),
                          jnp.float32) for _ in range(2))
        for _ in range(config.num_layers)
    ]  # fmt: skip
    lengths = jnp.asarray(rng.integers(0, S - 1, B), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, B), jnp.int32)
    real = sorted({r for r in rows if r < B})
    bound = np.zeros(B, np.int32)
    bound[real] = S
    bound = jnp.asarray(bound)
    kw = dict(layout=Layout.SEQ_MAJOR, committed=bound)
    full_logits, full_caches, full_status = llama.decode_step(
        params, config, tokens, [tuple(jnp.array(a) for a in c) for c in caches], lengths, **kw
    )
    logits, out_caches, status = llama.decode_step(
        params, config, tokens, [tuple(jnp.array(a) for a in c) for c in caches], lengths,
        rows=jnp.asarray(rows, jnp.int32), **kw,
    )  # fmt: skip
    assert logits.shape == (len(rows), config.vocab_size)
    for i, r in enumerate(rows):
        if r < B:
            np.testing.assert_allclose(logits[i], full_logits[r], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(status, full_status)
    assert np.isfinite(np.asarray(logits)).all()
    for (k0, v0), (k1, v1), (k, v) in zip(caches, full_caches, out_caches, strict=True):
        for before, want, got in ((k0, k1, k), (v0, v1, v)):
            for b in range(B):
                if b in real:  # the new token written at lengths[b], as the full step does
                    np.testing.assert_allclose(got[b], want[b], rtol=1e-5, atol=1e-5)
                else:  # idle: not written
                    np.testing.assert_array_equal(got[b], before[b])


@pytest.mark.parametrize(
    ("slots", "option", "want"),
    [
        (256, None, [32, 64, 128, 256]),
        (128, None, [16, 32, 64, 128]),
        (64, None, [64]),  # off below 128 slots by default
        (64, True, [8, 16, 32, 64]),
        (16, True, [2, 4, 8, 16]),
        (8, None, [8]),
        (8, True, [1, 2, 4, 8]),
        (3, True, [1, 3]),
        (1, True, [1]),
        (64, False, [64]),
    ],
)
def test_the_buckets_and_the_default(model, slots, option, want):
    with Engine(model, arena=EagerArena(), max_slots=slots, max_len=32,
                decode_row_buckets=option) as eng:  # fmt: skip
        assert eng.decode_buckets() == want
        assert eng.decode_row_buckets == (len(want) > 1 or option is True)
        assert [eng._decode_bucket(n) for n in range(slots + 1)] == [
            next(b for b in want if b >= n) for n in range(slots + 1)
        ]


class _NoRows:
    """The test model behind a decode_step without `rows` (another library's DecoderModel);
    the tests below never trace it."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode_step(self, params, tokens, caches, lengths, *, layout, committed=None,
                    attention=None):  # fmt: skip
        return self._model.decode_step(params, tokens, caches, lengths, layout=layout,
                                       committed=committed, attention=attention)  # fmt: skip


def test_a_decode_step_without_rows_turns_the_buckets_off_or_is_refused(model):
    no_rows = _NoRows(model)
    with Engine(no_rows, arena=EagerArena(), max_slots=128, max_len=32) as eng:
        assert not eng.decode_row_buckets and eng.decode_buckets() == [128]
    with pytest.raises(ValueError, match="decode_row_buckets: expected a model whose decode_step"):
        Engine(no_rows, arena=EagerArena(), max_slots=8, max_len=32, decode_row_buckets=True)


def test_one_compile_per_bucket_all_in_warm_up_and_tokens_at_every_occupancy(model, generator, rng):
    """8 slots (buckets 1, 2, 4, 8): warm_up compiles the four steps and both pickers of each;
    14 requests of staggered lengths then pass through every occupancy from 8 to 1, every
    bucket called, with no compile, each request's tokens equal to Generator alone."""
    with Engine(model, arena=EagerArena(), max_slots=8, max_len=MAX_LEN,
                prefill_chunk_tokens=64, decode_row_buckets=True) as eng:  # fmt: skip
        assert eng.decode_buckets() == [1, 2, 4, 8]
        eng.warm_up()
        s = eng.stats
        assert s.decode_compiles == 4 and s.sampler_compiles == 8
        assert sorted(s.decode_bucket_calls) == [1, 2, 4, 8]
        assert eng._decode._cache_size() == 4
        assert eng._greedy._cache_size() == eng._sampler._cache_size() == 4
        before = dict(s.decode_bucket_calls)
        work = staggered(rng, model, 14)
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in work]
        eng.run_until_idle()
        assert (s.decode_compiles, s.sampler_compiles) == (4, 8)
        assert all(s.decode_bucket_calls[n] > before[n] for n in (1, 2, 4, 8)), (
            before, s.decode_bucket_calls,
        )  # fmt: skip
        assert sum(s.decode_bucket_calls.values()) == s.decode_calls
        for (p, n), r in zip(work, reqs, strict=True):
            assert r.result().tokens == alone(generator, p, n)


def test_sampled_tokens_do_not_depend_on_the_bucket(model, rng):
    """The sampler of a bucket gathers each row's temperature, top-k, top-p, seed and
    position: a request's sampled tokens are those of the engine without buckets (greedy ones
    beside them too)."""
    work = staggered(rng, model, 10)
    samplings = [
        Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=i) if i % 2 else None
        for i in range(len(work))
    ]

    def serve(buckets):
        with Engine(model, arena=EagerArena(), max_slots=8, max_len=MAX_LEN,
                    prefill_chunk_tokens=64, decode_row_buckets=buckets) as eng:  # fmt: skip
            reqs = [
                eng.submit(p, n, sampling, stop_token_ids=[])
                for (p, n), sampling in zip(work, samplings, strict=True)
            ]
            eng.run_until_idle()
            used = set(eng.stats.decode_bucket_calls)
            assert used == ({1, 2, 4, 8} if buckets else {8})
            return [r.result().tokens for r in reqs]

    assert serve(True) == serve(False)


@pytest.mark.parametrize("kind", ["host", "eager"])
def test_a_call_ahead_takes_a_bucket_that_holds_its_rows(model, generator, rng, kind):
    """Every decode call, dispatched ahead (before the last call's tokens were read) or not:
    its bucket is the smallest that holds its rows, its row index lists their slots (then
    padding), and every row it may write (write bound > 0) is listed. A call ahead advances
    some of the rows of the call before it, so its bucket is never larger; with requests
    ending by length, some calls ahead take a smaller bucket than the call before."""
    if kind == "host":
        arena = host_arena(reserve_bytes=1 << 30, granule=16 * token_bytes(model))
    else:
        arena = EagerArena()
    eng = Engine(model, arena=arena, max_slots=8, max_len=MAX_LEN, prefill_chunk_tokens=64,
                 decode_row_buckets=True)  # fmt: skip
    B = eng.max_slots
    calls = []  # (ahead, bucket, slots, index, bound) of each decode call
    real = eng._dispatch

    def dispatch(kind, args, rows, counts, bucket=None, sample=None):
        call = real(kind, args, rows, counts, bucket, sample)
        if kind == "decode":
            ahead = eng._in_flight is not None  # _complete: the call before is in flight
            n = call.bucket
            # The inputs as the call read them: no write since its dispatch.
            index = np.asarray(eng._inputs[f"decode_rows_{n}"]) if n < B else np.arange(B)
            bound = np.asarray(eng._inputs["bound"])
            calls.append((ahead, n, sorted(s.slot for s in rows), index, bound))
        return call

    eng._dispatch = dispatch
    try:
        work = staggered(rng, model, 14)
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in work]
        while eng.has_work():
            eng.step()
            eng.check_memory()
        for (p, n), r in zip(work, reqs, strict=True):
            assert r.result().tokens == alone(generator, p, n)
        assert eng.stats.calls_ahead == sum(c[0] for c in calls) > 0
        last = None
        shrunk = 0
        for ahead, n, slots, index, bound in calls:
            assert n == eng._decode_bucket(len(slots)), (n, slots)
            assert len(index) == n
            if n < B:
                assert list(index[: len(slots)]) == slots
                assert (index[len(slots) :] == B).all()  # padding
            assert set(np.flatnonzero(bound)) <= set(slots), (bound, slots)
            if ahead:
                assert last is not None and n <= last
                shrunk += n < last
            last = n
        assert shrunk > 0, [(c[0], c[1]) for c in calls]
        assert any(ahead and n < B for ahead, n, *_ in calls)
    finally:
        eng.close()
        if kind == "host":
            assert arena.committed_bytes == 0
            arena.close()


def test_the_row_index_is_read_at_a_fixed_address(model, generator, rng):
    """Every call of a bucket's compiled step and picker reads its row index from the same
    buffer, rewritten in place with the call's other inputs (one upload per call, calls
    ahead included), as every per-step input is (test_engine.py::
    test_steps_read_their_inputs_at_fixed_addresses): XLA replays a recorded CUDA graph only
    while its buffers keep their addresses."""
    arena = host_arena(reserve_bytes=1 << 30, granule=16 * token_bytes(model))
    eng = Engine(model, max_slots=8, max_len=MAX_LEN, prefill_chunk_tokens=64, arena=arena,
                 decode_row_buckets=True)  # fmt: skip
    seen: dict[tuple, set] = {}

    def recording(kind, fn, inputs_from):
        def run(*args):
            # The inputs (not the params, the caches, or a picker's step outputs).
            arrays = [a for a in args[inputs_from:] if isinstance(a, jax.Array)]
            key = (kind, *(a.shape for a in arrays))  # a bucket has its own buffers
            seen.setdefault(key, set()).add(tuple(a.unsafe_buffer_pointer() for a in arrays))
            return fn(*args)

        return run

    # tokens, lengths, bound, status (the step's status out, donated)[, rows]
    eng._decode = recording("decode", eng._decode, 1)
    eng._greedy = recording("argmax", eng._greedy, 2)  # tokens[, rows]
    try:
        work = staggered(rng, model, 14)
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in work]
        eng.run_until_idle()
        for (p, n), r in zip(work, reqs, strict=True):
            assert r.result().tokens == alone(generator, p, n)
        # The calls of buckets 1, 2 and 4 take a row index [n]; bucket 8's none.
        assert {k[-1] for k in seen if k[0] == "decode" and len(k) == 6} == {(1,), (2,), (4,)}
        assert {k[-1] for k in seen if k[0] == "argmax" and len(k) == 3} == {(1,), (2,), (4,)}
        moved = {k: len(v) for k, v in seen.items() if len(v) != 1}
        assert not moved, f"inputs at new addresses (calls' pointer sets per key): {moved}"
        s = eng.stats
        assert s.calls_ahead > 0
        assert eng._inputs.writes == s.prefill_calls + s.decode_calls  # one upload per call
    finally:
        eng.close()
        assert arena.committed_bytes == 0
        arena.close()


def test_decode_step_refuses_bad_rows(model):
    config, B, S = model.config, 4, 16
    caches = llama.init_caches(config, B, S, layout=Layout.SEQ_MAJOR, dtype=jnp.float32)
    zeros = jnp.zeros((B,), jnp.int32)
    kw = dict(layout=Layout.SEQ_MAJOR)
    step = llama.decode_step
    with pytest.raises(ValueError, match=r"rows: needs committed"):
        step(model.params, config, zeros, caches, zeros, rows=jnp.zeros((2,), jnp.int32), **kw)
    for bad in (
        jnp.zeros((5,), jnp.int32),
        jnp.zeros((2,), jnp.uint32),
        jnp.zeros((1, 2), jnp.int32),
    ):
        with pytest.raises(ValueError, match=r"rows: expected int32 \[n <= B=4\]"):
            step(model.params, config, zeros, caches, zeros, committed=zeros, rows=bad, **kw)
