"""The next call's prefill memory is committed while a call runs (Engine._plan_ahead): the
prefilling slots' next pieces and the queue head's admission, so that the device does not
wait for those commits at the next planning. On the host driver's VmmArena (the commits are
the real ones) and the eager arena: greedy tokens equal Generator alone, the memory invariant
holds after every step (allowing the next call's tokens committed ahead), and the counters
say where the commits ran. A queued request whose prefix the call in flight is writing waits
for the next planning, so that it maps those blocks instead of computing them again."""

import threading

import pytest
from arena_checks import close_and_check

from jax_kv.engine import Engine
from jax_kv.memory import EagerArena, host_arena

MAX_LEN = 256
BLOCK = 16  # tokens per granule: 8 KiB granules of the tiny model's 512-byte tokens


@pytest.fixture
def arena():
    a = host_arena(reserve_bytes=1 << 30, granule=BLOCK * 512)
    yield a
    close_and_check(a)


def drain(eng):
    while eng.has_work():
        eng.step()
        eng.check_memory()


def prompts(rng, model, n, lo, hi):
    vocab = model.config.vocab_size
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(lo, hi)))] for _ in range(n)]


def three_slots(model, arena, kind):
    """3 slots, 32-token chunks, the prefix cache off; on the host driver's VmmArena
    (`kind` "host") or the eager arena, 16 tokens to a granule either way."""
    return Engine(
        model,
        max_slots=3,
        max_len=MAX_LEN,
        prefill_chunk_tokens=32,
        arena=arena if kind == "host" else EagerArena(),
        granule_bytes=None if kind == "host" else BLOCK * 512,
        prefix_cache=False,
    )


@pytest.mark.parametrize("kind", ["host", "eager"])
def test_admissions_and_next_pieces_are_committed_beside_the_call(
    model, generator, rng, arena, kind
):
    """12 requests through 3 slots, prompts of 20-90 tokens in 32-token chunks (several pieces
    each): admissions happen while a call runs (at planning only where no call would run),
    and the device waits for no commit but those admissions' (no piece's, no decode row's)."""
    eng = three_slots(model, arena, kind)
    with eng:
        work = [(p, int(rng.integers(2, 12))) for p in prompts(rng, model, 12, 20, 90)]
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in work]
        eng.step()
        eng.check_memory()
        first = eng.stats.planning_commits
        assert first >= 1  # the first planning had no call to hide behind
        drain(eng)
        for (p, n), r in zip(work, reqs, strict=True):
            assert r.result().tokens == generator.generate([p], n, stop_tokens=[]).tokens[0]
        s = eng.stats
        # Admitted at planning: the first step's, and where all three requests ended in one
        # call (no call to run beside); each of those commits at most once.
        assert s.admitted_ahead >= 6, s
        assert s.pieces_ahead > 0, s
        assert first <= s.planning_commits <= 12 - s.admitted_ahead, s
        assert s.preemptions == 0


def test_a_request_waits_for_the_blocks_the_call_in_flight_writes(model, generator, rng, arena):
    """A (3 blocks + 4 tokens) and B (the same 3 blocks + 6 others) are queued together. A's
    first call prefills 32 tokens, A's blocks 0 and 1; admitted beside it, B would find no
    block cached and compute them again. It waits, is admitted at the next planning and maps
    both blocks (block 2, written by A's second call, it computes: planning does not wait)."""
    vocab = model.config.vocab_size
    shared = [int(t) for t in rng.integers(3, vocab, 3 * BLOCK)]
    a = shared + [int(t) for t in rng.integers(3, vocab, 4)]
    b = shared + [int(t) for t in rng.integers(3, vocab, 6)]
    with Engine(model, max_slots=2, max_len=MAX_LEN, prefill_chunk_tokens=32, arena=arena) as eng:
        ra, rb = (eng.submit(p, 5, stop_token_ids=[]) for p in (a, b))
        drain(eng)
        for p, r in ((a, ra), (b, rb)):
            assert r.result().tokens == generator.generate([p], 5, stop_tokens=[]).tokens[0]
        assert eng.prefix.stats.hit_tokens == 2 * BLOCK
        assert eng.stats.prefill_tokens == len(a) + len(b) - 2 * BLOCK


def test_a_request_cancelled_while_a_call_runs_is_never_admitted(model, rng, arena):
    """B is cancelled while A's second call runs, before the work beside it (as a client that
    goes away mid-step; A's 80-token prompt fills that call's 32-token chunk, so B was not
    admitted at its planning): B ends cancelled, once, without taking a slot; A goes on."""
    a, b = prompts(rng, model, 2, 80, 81)
    with Engine(model, max_slots=2, max_len=MAX_LEN, prefill_chunk_tokens=32, arena=arena) as eng:
        ra = eng.submit(a, 4, stop_token_ids=[])
        eng.step()  # A's first piece; B arrives after it
        rb = eng.submit(b, 4, stop_token_ids=[])
        finished = []
        real_finish, real_plan = rb._finish, eng._plan_ahead

        def plan_ahead(counts):
            rb.cancel()
            eng._plan_ahead = real_plan
            return real_plan(counts)

        rb._finish = lambda c: (finished.append(c.finish_reason), real_finish(c))
        eng._plan_ahead = plan_ahead
        admissions = eng._admissions
        drain(eng)
        assert finished == ["cancelled"] and rb.result().tokens == []
        assert eng._admissions == admissions  # B never took a slot
        assert ra.result().finish_reason == "length"


def test_cancels_are_looked_for_only_after_one(model, rng):
    """The step asks its requests whether they were cancelled only after a Request.cancel()
    (at 256 slots and a long queue, asking each at every step cost a lock per request); a
    cancel from another thread still ends its request within one step, once."""
    from jax_kv.engine.request import Request

    asked = []
    real = Request.cancel_requested
    Request.cancel_requested = property(lambda r: asked.append(r.id) or real.fget(r))
    try:
        eng = Engine(model, arena=EagerArena(), max_slots=2, max_len=MAX_LEN,
                     prefill_chunk_tokens=16)  # fmt: skip
        with eng:
            reqs = [eng.submit(p, 30, stop_token_ids=[]) for p in prompts(rng, model, 6, 5, 9)]
            for _ in range(3):
                eng.step()
            asked.clear()
            eng.step()  # nothing cancelled: at most the queue's head is asked, at admission
            assert len(set(asked)) <= 1, asked
            t = threading.Thread(target=reqs[4].cancel)  # queued
            t.start()
            t.join()
            reqs[0].cancel()  # running
            eng.step()
            assert reqs[4].result().finish_reason == reqs[0].result().finish_reason == "cancelled"
            eng.run_until_idle()
            assert sum(eng.stats.finished.values()) == 6
    finally:
        Request.cancel_requested = real


@pytest.mark.parametrize("kind", ["host", "eager"])
@pytest.mark.parametrize("late", [1, 2])
def test_a_request_submitted_while_calls_run_ahead_is_prefilled_by_the_next_call(
    model, generator, rng, arena, kind, late
):
    """Two requests decode with calls dispatched ahead; one more, submitted between steps
    while a slot is free, is admitted beside the call in flight before a decode call would be
    dispatched after it: the next step's call prefills it, so its first token comes at the
    second step, not the third (a call ahead would have run first). Two more (a queue longer
    than the free slots: saturation) keep the order that lets admissions share a prefill
    call: the call ahead first, the head's first token at the third step. Tokens equal
    Generator alone; the memory invariant holds after every step."""
    eng = three_slots(model, arena, kind)
    with eng:
        first, more = prompts(rng, model, 2, 10, 30), prompts(rng, model, late, 5, 30)
        reqs = [eng.submit(p, 20, stop_token_ids=[]) for p in first]
        while not (all(r.streamed for r in reqs) and eng._next is not None):
            eng.step()
            eng.check_memory()
        ahead = eng.stats.calls_ahead
        queued = [eng.submit(p, 6, stop_token_ids=[]) for p in more]
        steps = 0
        while not queued[0].streamed:
            eng.step()
            eng.check_memory()
            steps += 1
        assert steps == (2 if late == 1 else 3), steps
        assert eng.stats.calls_ahead == ahead + (late - 1)  # none ahead of an early admission
        drain(eng)
        for p, r, n in zip([*first, *more], [*reqs, *queued], [20, 20, 6, 6], strict=False):
            assert r.result().tokens == generator.generate([p], n, stop_tokens=[]).tokens[0]
