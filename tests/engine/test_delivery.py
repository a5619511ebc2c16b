"""Delivery of tokens and endings to requests. `step()` hands them over before it returns.
Under the background driver (`start()`), a step's tokens reach their requests while the next
call runs (streaming to clients, a listener per request, is host work the device then does not
wait for), or at the step's end when no call follows: every request still sees its tokens in
order and its ending once. A listener that raises fails the engine, and every request still
gets its tokens and an ending (none lost)."""

import time

import pytest

from jax_kv.engine import FINISH_ERROR, FINISH_LENGTH, Engine, EngineError
from jax_kv.memory import EagerArena

MAX_LEN = 256


def prompts(rng, model, n, lo, hi):
    vocab = model.config.vocab_size
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(lo, hi)))] for _ in range(n)]


def engine(model):
    return Engine(model, arena=EagerArena(), max_slots=3, max_len=MAX_LEN, prefill_chunk_tokens=32)


def test_step_delivers_before_it_returns(model, rng):
    with engine(model) as eng:
        req = eng.submit(prompts(rng, model, 1, 10, 11)[0], 3, stop_token_ids=[])
        eng.step()  # the prompt's call: its first token
        assert req.streamed == 1
        eng.step()
        assert req.streamed == 2
        eng.run_until_idle()
        assert req.done and eng.stats.delivered_beside_call == 0


def test_the_driver_delivers_beside_the_next_call(model, generator, rng):
    """8 requests through 3 slots under the driver: most tokens are handed over while a call
    runs; each request's streamed deltas equal its completion and Generator alone, and the
    listener saw every delta and the ending, in order, on the engine's thread."""
    work = [(p, int(rng.integers(3, 15))) for p in prompts(rng, model, 8, 5, 40)]
    with engine(model) as eng:
        reqs, seen = [], {}
        for p, n in work:
            r = eng.submit(p, n, stop_token_ids=[])
            seen[r.id] = []
            r.add_listener(lambda r=r: seen[r.id].append((r.streamed, r.done)))
            reqs.append(r)
        eng.start()
        for r in reqs:
            r.result(timeout=120)
        eng.shutdown(drain=True)
        tokens = sum(n for _, n in work)
        assert eng.stats.delivered_beside_call >= tokens // 2, eng.stats
    for (p, n), r in zip(work, reqs, strict=True):
        c = r.result()
        assert c.finish_reason == FINISH_LENGTH
        assert (
            [d.token for d in r] == c.tokens == generator.generate([p], n, stop_tokens=[]).tokens[0]
        )
        streamed = [k for k, _ in seen[r.id]]
        assert streamed == sorted(streamed) and streamed[-1] == n and seen[r.id][-1][1]


@pytest.mark.parametrize("driver", [False, True])
def test_a_listener_that_raises_fails_the_engine_and_loses_no_request(model, rng, driver):
    """The first request's listener raises at its second token: the step fails, and every
    request (running and queued) ends, the failing one and the others with the error, each
    with the tokens it was given in order."""
    with engine(model) as eng:
        reqs = [eng.submit(p, 20, stop_token_ids=[]) for p in prompts(rng, model, 5, 5, 30)]

        def boom(r=reqs[0]):
            if r.streamed == 2:
                raise RuntimeError("listener broke")

        reqs[0].add_listener(boom)
        if driver:
            eng.start()
            deadline = time.monotonic() + 120
            while not all(r.done for r in reqs) and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            with pytest.raises(RuntimeError, match="listener broke"):
                eng.run_until_idle()
        for r in reqs:
            c = r.completion
            assert c is not None, r
            assert [d.token for d in r.deltas_from(0)[0]] == c.tokens
            assert c.finish_reason in (FINISH_ERROR, FINISH_LENGTH)
        assert any(r.completion.finish_reason == FINISH_ERROR for r in reqs)
        with pytest.raises(EngineError):
            eng.submit([1, 2, 3], 2)


class Interrupt(BaseException):
    """As KeyboardInterrupt: not an Exception."""


def test_an_interrupt_in_a_listener_loses_no_ending(model, rng):
    """A's listener raises an interrupt at A's 2nd token; B gets its 2nd token and its ending
    in the same step, after A's token in the outbox: the step fails, and B still gets both
    (found by review: the rest of the outbox was dropped on a BaseException, and B, ended and
    retiring, was released by _fail without an ending)."""
    a_ids, b_ids = prompts(rng, model, 2, 8, 9)
    eng = engine(model)
    try:
        a = eng.submit(a_ids, 10, stop_token_ids=[])
        b = eng.submit(b_ids, 2, stop_token_ids=[])
        fired = []

        def boom():
            if a.streamed == 2 and not fired:
                fired.append(1)
                raise Interrupt()

        a.add_listener(boom)
        eng.step()  # the prompts' call: one token each
        with pytest.raises(Interrupt):
            eng.step()
        assert a.done and b.done
        assert [d.token for d in b.deltas_from(0)[0]] == b.completion.tokens
        assert b.completion.finish_reason == FINISH_LENGTH
    finally:
        try:
            eng.close()
        except BaseException:  # noqa: BLE001 - the engine failed: its close may raise too
            pass


def test_an_idle_driver_does_not_step(model, rng):
    """The driver steps only while there is work: an idle engine's steps (and the step time
    the server exports) stay where its last request left them."""
    with engine(model) as eng:
        eng.start()
        time.sleep(0.35)  # the driver's wait times out every 0.1 s
        assert eng.stats.steps == 0
        req = eng.submit(prompts(rng, model, 1, 5, 10)[0], 3, stop_token_ids=[])
        req.result(timeout=120)
        # The last step is counted just after its tokens are delivered: then nothing moves.
        counts = [eng.stats.steps]
        for _ in range(4):
            time.sleep(0.35)
            counts.append(eng.stats.steps)
        assert counts[1] > 0 and counts[1:] == [counts[1]] * 4, counts
        eng.shutdown(drain=True)
