"""Decode calls dispatched ahead (Engine(decode_ahead=True), the default): where the next call
is decode only and its rows are known, the Engine dispatches it before reading the call in
flight's tokens; the next call takes those tokens on the device (the picker writes them into
the `tokens` input). Checked on the host driver's VmmArena (granules unmapped per slot, as on
CUDA) and the eager arena:

- tokens (greedy, sampled, stopped early) equal with calls ahead and without, and greedy ones
  equal Generator alone with the same stop ids;
- calls are dispatched ahead (counted), none with decode_ahead=False;
- a row whose request stopped on the call before is computed once for nothing (counted, its
  token dropped), and its slot is released only after that call: until then it keeps its
  granules; so is a row the attention op refused on the call before;
- a cancel, a shutdown and a close while a call is ahead end every request, and the arena
  commits nothing after close."""

import pytest

from jax_kv import Sampling
from jax_kv.engine import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Engine
from jax_kv.memory import EagerArena, host_arena

MAX_LEN = 128


def granule(model):
    c = model.config
    return 16 * c.num_kv_heads * c.head_dim * 4  # 16 f32 tokens of one binding


def build(model, kind, **kw):
    kw.setdefault("max_slots", 4)
    kw.setdefault("max_len", MAX_LEN)
    kw.setdefault("prefill_chunk_tokens", 32)
    if kind == "eager":
        arena = EagerArena()
        kw.setdefault("granule_bytes", granule(model))
    else:
        arena = host_arena(reserve_bytes=1 << 30, granule=granule(model))
    return Engine(model, arena=arena, **kw), arena


def close(eng, arena, kind):
    eng.close()
    if kind == "host":
        assert arena.committed_bytes == 0
        arena.close()


def solo(generator, prompt, n, stops=()):
    return list(generator.generate([prompt], n, stop_tokens=list(stops)).tokens[0])


def run(model, kind, requests, decode_ahead, decode_row_buckets=False):
    """Serves `requests` ((prompt, max_new, stops, sampling) each, two arriving per step) ->
    (completions, stats), checking memory after every step."""
    eng, arena = build(
        model, kind, decode_ahead=decode_ahead, decode_row_buckets=decode_row_buckets
    )
    try:
        pending, handles = list(requests), []
        while pending or eng.has_work():
            for prompt, n, stops, sampling in pending[:2]:
                handles.append(eng.submit(prompt, n, sampling, stop_token_ids=list(stops)))
            pending = pending[2:]
            eng.step()
            eng.check_memory()
        return [h.result() for h in handles], eng.stats
    finally:
        close(eng, arena, kind)


@pytest.mark.parametrize("buckets", [False, True], ids=["all-rows", "row-buckets"])
@pytest.mark.parametrize("kind", ["host", "eager"])
def test_tokens_equal_with_calls_ahead_and_without(model, generator, rng, kind, buckets):
    """With decode row buckets (4 slots: 1, 2, 4) too: a call ahead takes the bucket of its
    own rows, its tokens taken from the picker's writes at the rows of the call before."""
    vocab = model.config.vocab_size
    requests = []
    for i in range(10):
        prompt = [int(t) for t in rng.integers(3, vocab, int(rng.integers(1, 40)))]
        n = int(rng.integers(2, 30))
        stops: tuple = ()
        if i % 3 == 0:  # a token of its own greedy output: it stops early
            free = solo(generator, prompt, n)
            stops = (free[int(rng.integers(1, len(free)))],)
        sampling = Sampling(temperature=0.9, top_k=40, seed=i) if i % 4 == 1 else None
        requests.append((prompt, n, stops, sampling))
    ahead, stats = run(model, kind, requests, True, buckets)
    serial, serial_stats = run(model, kind, requests, False, buckets)
    for (prompt, n, stops, sampling), a, s in zip(requests, ahead, serial, strict=True):
        assert a.tokens == s.tokens and a.finish_reason == s.finish_reason
        if sampling is None:
            assert a.tokens == solo(generator, prompt, n, stops)
        assert len(a.tokens) <= n
        # A stop id ends it first, also on its last allowed token (Engine._emit).
        stopped = bool(stops) and a.tokens[-1] in stops
        assert a.finish_reason == (FINISH_STOP if stopped else FINISH_LENGTH)
    assert stats.calls_ahead > 0 and serial_stats.calls_ahead == 0
    assert serial_stats.wasted_rows == 0
    for s in (stats, serial_stats):  # one compile per bucket used
        assert s.decode_compiles == len(s.decode_bucket_calls)
        assert set(s.decode_bucket_calls) <= ({1, 2, 4} if buckets else {4})
    assert stats.decode_tokens == serial_stats.decode_tokens  # dropped tokens not counted
    # Not the same calls: one whose every row stopped on the call before is an extra one, and
    # requests arriving while a call is ahead are admitted beside it, one call later.


def test_a_row_stopped_on_the_call_before_keeps_its_slot_until_the_call_ahead_ends(
    model, generator, rng
):
    eng, arena = build(model, "host")
    try:
        vocab = model.config.vocab_size
        other = [int(t) for t in rng.integers(3, vocab, 9)]
        for _ in range(50):  # a prompt whose output has a token first seen at 3..15
            prompt = [int(t) for t in rng.integers(3, vocab, 12)]
            free = solo(generator, prompt, 20)
            firsts = [k for k in range(3, 16) if free.index(free[k]) == k]
            if firsts:
                break
        k = firsts[0]
        stop = free[k]  # the request ends on token k, a decode call's
        keep = eng.submit(other, 30, stop_token_ids=[])
        req = eng.submit(prompt, 20, stop_token_ids=[stop])
        while not req.done:
            eng.step()
        assert req.result().tokens == free[: k + 1]
        b = next(b for b, seq in eng._retiring.items() if seq.request is req)
        assert eng._next is not None and b in {s.slot for s in eng._next.rows}
        held = int(eng.cache.granules[b])
        assert held > 0  # the call ahead writes its row: its granules stay
        released = []
        real = eng.cache.release_slot
        eng.cache.release_slot = lambda slot: (released.append(slot), real(slot))[1]
        eng.step()  # completes the call ahead: its token for the ended request is dropped
        assert eng.stats.wasted_rows == 1
        assert req.result().tokens == free[: k + 1]
        eng.run_until_idle()
        assert released.count(b) == 1 and b not in eng._retiring
        assert keep.result().tokens == solo(generator, other, 30)
    finally:
        close(eng, arena, "host")


def test_cancel_shutdown_and_close_with_a_call_ahead(model, generator, rng):
    vocab = model.config.vocab_size
    ps = [[int(t) for t in rng.integers(3, vocab, n)] for n in (7, 11, 5)]
    eng, arena = build(model, "host")
    try:
        reqs = [eng.submit(p, 40, stop_token_ids=[]) for p in ps]
        while eng._next is None:
            eng.step()
        reqs[0].cancel()
        ahead = eng.stats.calls_ahead
        eng.step()  # completes the call ahead, then ends the cancelled request
        assert reqs[0].done and reqs[0].result().finish_reason == FINISH_CANCELLED
        got = reqs[0].result().tokens
        assert got == solo(generator, ps[0], 40)[: len(got)]
        while eng._next is None:
            eng.step()
        assert eng.stats.calls_ahead > ahead
        eng.shutdown(drain=False)  # with a call ahead in flight
        for r in reqs[1:]:
            assert r.result().finish_reason == FINISH_CANCELLED
        assert eng._next is None and not eng.has_work()
    finally:
        close(eng, arena, "host")
    eng, arena = build(model, "host")
    req = eng.submit(ps[1], 40, stop_token_ids=[])
    while eng._next is None:
        eng.step()
    close(eng, arena, "host")  # close() with a call ahead in flight: nothing left committed
    assert req.result().finish_reason == FINISH_CANCELLED


def test_a_row_refused_on_the_call_before_is_released_after_the_call_ahead(model, generator, rng):
    """The attention op's status refuses slot 1's row on a decode call; the call ahead,
    dispatched before that status was read, computes the row too. The request ends with an
    error, the others go on, and the slot is released only once no call in flight writes it."""
    eng, arena = build(model, "host", max_slots=3)
    real = eng._decode
    calls = [0]

    def decode(params, tokens, caches, lengths, bound, status):
        logits, status, caches, positions = real(params, tokens, caches, lengths, bound, status)
        calls[0] += 1
        if calls[0] == 3:
            status = status.at[1].set(3)  # any nonzero status: the op refused the row
        return logits, status, caches, positions

    eng._decode = decode
    released = []
    real_release = eng.cache.release_slot

    def release_slot(b):
        busy = {s.slot for s in eng._in_flight[1]} if eng._in_flight is not None else set()
        released.append((b, b in busy))
        return real_release(b)

    eng.cache.release_slot = release_slot
    try:
        vocab = model.config.vocab_size
        ps = [[int(t) for t in rng.integers(3, vocab, 9 + i)] for i in range(3)]
        reqs = [eng.submit(p, 12, stop_token_ids=[]) for p in ps]
        while eng.has_work():
            eng.step()
            eng.check_memory()
        ends = [r.completion for r in reqs]  # result() raises the error
        reasons = [c.finish_reason for c in ends]
        assert reasons.count("error") == 1 and reasons.count(FINISH_LENGTH) == 2, reasons
        failed = reasons.index("error")
        assert eng.stats.calls_ahead >= 3 and eng.stats.wasted_rows >= 1
        for i, (p, c) in enumerate(zip(ps, ends, strict=True)):
            want = solo(generator, p, 12)
            got = c.tokens
            assert got == (want[: len(got)] if i == failed else want)
        assert released and not any(busy for _, busy in released), released
    finally:
        close(eng, arena, "host")
