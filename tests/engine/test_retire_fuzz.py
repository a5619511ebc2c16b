"""Randomized schedules over the engine's retiring slots (a request that ends on a call's token
keeps its slot, neither running nor free, until it is released beside the next call, or at
once when admission runs short of memory, or by a step with nothing to call).

Each case draws an engine (1-4 slots, chunks of 16 or 32 tokens, a tight budget or none, decode
row buckets or not, the prefix cache off or on with prefix_cache_bytes None, 0 or two blocks)
over the host driver's VmmArena or the eager arena, and a schedule: requests arriving between
steps (fresh prompts, prompts sharing another's prefix, exact repeats, chat continuations of an
ended request), max_new_tokens 1..20, stop token ids taken from the request's own greedy output
(so it stops early) or random, and random cancels. Hooks on the engine instance (no library
code changed) check, while the steps run, that:

- no slot is admitted into while it is retiring (`_free_slot` never returns one);
- a release beside a call (SlotCache.beside_step: no device synchronize) is of a slot no
  running request holds and whose row the call's own inputs leave idle (length 0, decode
  write bound 0, not in its decode bucket's row index, no packed prefill token), after the
  call's caches were accepted (the host driver's write-back first, then the unmap);
- a request's slot is released once per admission (no double release);
- every request is finished exactly once.

After every step: check_memory(), no retiring slot is held by a running request, none is the
slot of a request admitted in that step, held bytes within the budget. At the end: greedy
tokens equal Generator alone with the same stop ids (the stop kept as the last token, as the
engine does; a cancelled request's tokens a prefix of them), the streamed deltas equal the
completion, nothing retiring, no request memory held, and after close the arena commits 0
bytes, holds no handle and its fault counters are zero. A third of the schedules end instead
by close() in mid-run (running, queued and retiring requests left), and a second test runs
arrivals and cancels under the background driver until shutdown(drain=True). TEST_SEED
replays a failure."""

import gc

import numpy as np
import pytest

from jax_kv.engine import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Engine
from jax_kv.memory import EagerArena, host_arena

MAX_LEN = 256
MAX_PROMPT = 80  # prompt + max_new <= 100 tokens: 7 granules of 16 tokens at most


def token_bytes(model):
    c = model.config
    return c.num_kv_heads * c.head_dim * 4


CASES = [
    ("eager", False, None),
    ("host", False, None),
    ("host", True, None),
    ("host", True, 0),
    ("host", True, "small"),
]


class Expect:
    """Generator alone, memoized: free runs (for drawing stop ids) and stopped runs."""

    def __init__(self, generator):
        self.generator = generator
        self.memo = {}

    def __call__(self, prompt, n, stops):
        key = (tuple(prompt), n, tuple(stops))
        if key not in self.memo:
            result = self.generator.generate([prompt], n, stop_tokens=list(stops))
            self.memo[key] = list(result.tokens[0])
        return self.memo[key]


def build(model, arena_kind, prefix, prefix_bytes, rng):
    granule = 16 * token_bytes(model)
    bindings = 2 * model.config.num_layers
    kw = dict(
        max_slots=int(rng.integers(1, 5)),
        max_len=MAX_LEN,
        prefill_chunk_tokens=int(rng.choice([16, 32])),
        decode_row_buckets=bool(rng.random() < 0.5),
    )
    budget = None
    if rng.random() < 0.6:  # tight: a few requests' worth (one needs 7 granules at most)
        budget = int(rng.integers(7, 13)) * granule * bindings
        kw["kv_budget_bytes"] = budget
    if arena_kind == "eager":
        arena = EagerArena()
        kw["granule_bytes"] = granule
    else:
        arena = host_arena(reserve_bytes=1 << 30, granule=granule)
        kw["prefix_cache"] = prefix
        if prefix:
            # One block is one granule per binding here (16 tokens of 512 bytes).
            small = 2 * granule * bindings
            kw["prefix_cache_bytes"] = small if prefix_bytes == "small" else prefix_bytes
    eng = Engine(model, arena=arena, **kw)
    return eng, arena, budget, kw


def instrument(eng, log):
    """Wraps engine and cache methods on the instances to check the retiring protocol while
    it runs; appends what it saw to `log`."""
    cache = eng.cache
    real_free_slot = eng._free_slot
    real_release = eng._release
    real_release_slot = cache.release_slot
    real_accept = cache.accept
    released = set()  # (id(seq), seq.admitted): one release per admission
    state = {"accepted": False, "inputs": {}, "releasing": False, "bucket": None}

    def free_slot():
        b = real_free_slot()
        if b is not None:
            assert b not in eng._retiring, f"slot {b} offered for admission while retiring"
            assert eng._slots[b] is None
        return b

    def release(seq, keep_partial):
        key = (id(seq), seq.admitted)
        assert key not in released, f"{seq.request.id}: its slot {seq.slot} released twice"
        released.add(key)
        assert seq.slot is not None and eng._slots[seq.slot] is None
        assert seq.slot not in eng._retiring  # popped before the release
        state["releasing"] = True
        try:
            return real_release(seq, keep_partial)
        finally:
            state["releasing"] = False

    def release_slot(b):
        if not cache._synchronize:  # beside the call in flight: its row must be idle
            assert eng._slots[b] is None, f"slot {b} released beside a call that runs it"
            assert all(s.slot != b for s in eng._active())
            assert state["accepted"], "released beside the call before its caches came back"
            # The call's own inputs leave the row idle: no length, no decode write bound, no
            # packed prefill tokens.
            inputs = state["inputs"]
            assert inputs["lengths"][b] == 0 and inputs["bound"][b] == 0, (b, inputs)
            bucket = state["bucket"]  # a decode call's rows, its row index written for it
            if bucket is not None and bucket < eng.max_slots:
                assert b not in inputs[f"decode_rows_{bucket}"], (b, bucket, inputs)
            if "cu_seqlens" in inputs:
                assert inputs["cu_seqlens"][b + 1] == inputs["cu_seqlens"][b], (b, inputs)
            # A request's slot (EngineStats.releases_beside_step), or a slot whose admission
            # beside the call found no memory for its first piece (_plan_ahead).
            log.append(("beside" if state["releasing"] else "admission", int(b)))
        return real_release_slot(b)

    def accept(k, v, *, verify=True):
        state["accepted"] = True
        return real_accept(k, v, verify=verify)

    real_dispatch = eng._dispatch

    def dispatch(kind, args, rows, counts, bucket=None, sample=None):
        state["accepted"] = False  # until this call's caches come back (accept)
        state["bucket"] = bucket
        return real_dispatch(kind, args, rows, counts, bucket, sample)

    real_write_inputs = eng._write_inputs
    real_inputs_write = eng._inputs.write

    def write_inputs(rows, **prefill):
        state["inputs"] = {}  # this call's
        return real_write_inputs(rows, **prefill)

    def inputs_write(**values):
        state["inputs"].update({k: np.array(v) for k, v in values.items()})
        return real_inputs_write(**values)

    eng._write_inputs = write_inputs
    eng._inputs.write = inputs_write
    eng._free_slot = free_slot
    eng._release = release
    eng._dispatch = dispatch
    cache.release_slot = release_slot
    cache.accept = accept


def draw_request(rng, model, expect, history):
    """(prompt, max_new, stop ids) of a new request; `history` holds (prompt, completion)
    of the requests submitted so far (completion None while running)."""
    vocab = model.config.vocab_size
    fresh = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731
    kind = rng.random()
    ended = [(p, c) for p, c in history if c is not None and c.finish_reason != FINISH_CANCELLED]
    prompt = None
    if kind < 0.25 and ended:  # a chat's next turn: history + answer + a new message
        p, c = ended[int(rng.integers(len(ended)))]
        prompt = p + list(c.tokens) + fresh(int(rng.integers(1, 6)))
    elif kind < 0.45 and history:  # another's prefix (whole blocks and a part) + a new tail
        p = history[int(rng.integers(len(history)))][0]
        cut = int(rng.integers(1, len(p) + 1))
        prompt = p[:cut] + fresh(int(rng.integers(0, 20)))
    elif kind < 0.55 and history:  # an exact repeat
        prompt = list(history[int(rng.integers(len(history)))][0])
    if not prompt or len(prompt) > MAX_PROMPT:
        prompt = fresh(int(rng.integers(1, 61)))
    max_new = int(rng.integers(1, 21))
    r = rng.random()
    if r < 0.4:  # a token of its own greedy output: it stops there (or at its first repeat)
        free = expect(prompt, max_new, ())
        stops = [free[int(rng.integers(len(free)))]]
    elif r < 0.55:
        stops = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
    else:
        stops = []
    return prompt, max_new, stops


def run_schedule(model, expect, rng, arena_kind, prefix, prefix_bytes, requests):
    """One random engine and schedule; returns (engine, beside-call releases seen). A third
    of the schedules end by close() in mid-run (running, queued and retiring requests left:
    the running and queued ones end cancelled, the retiring slots are released)."""
    eng, arena, budget, kw = build(model, arena_kind, prefix, prefix_bytes, rng)
    close_after = int(rng.integers(3, 40)) if rng.random() < 1 / 3 else None
    log = []
    finishes = {}
    reqs = []  # (request, prompt, max_new, stops)
    ok = False
    try:
        instrument(eng, log)
        to_submit = requests
        steps = 0
        while to_submit or eng.has_work():
            if close_after is not None and steps == close_after:
                eng.close()  # in mid-run; the engine's own end of the schedule
                break
            steps += 1
            assert steps < 2000, "the schedule does not end"
            # Arrivals between steps.
            for _ in range(int(rng.choice([0, 0, 1, 1, 2, 3])) if to_submit else 0):
                if not to_submit:
                    break
                to_submit -= 1
                history = [(p, r.completion) for (r, p, _, _) in reqs]
                prompt, n, stops = draw_request(rng, model, expect, history)
                req = eng.submit(prompt, n, stop_token_ids=stops)
                real_finish = req._finish

                def finish(completion, req=req, real_finish=real_finish):
                    finishes[req.id] = finishes.get(req.id, 0) + 1
                    return real_finish(completion)

                req._finish = finish
                reqs.append((req, prompt, n, stops))
            # Random cancels: queued, running, or already ended (a no-op then).
            if reqs and rng.random() < 0.1:
                reqs[int(rng.integers(len(reqs)))][0].cancel()
            if not eng.has_work():
                continue
            admissions = eng._admissions
            eng.step()
            eng.check_memory()
            running = {s.slot for s in eng._active()}
            assert not running & set(eng._retiring), (running, eng._retiring)
            for b, seq in eng._retiring.items():
                assert seq.slot == b and seq.request.done
            admitted = {s.slot for s in eng._active() if s.admitted >= admissions}
            assert not admitted & set(eng._retiring), (admitted, eng._retiring)
            if budget is not None:
                assert eng.cache.held_bytes <= budget
        assert not eng._retiring and not eng.has_work()
        if not eng.cache.closed:
            eng.check_memory()
            assert eng.cache.live_bytes == 0 and int(eng.cache.granules.sum()) == 0
            assert eng.cache.held_bytes == eng.cache.cached_only_bytes
            if eng.prefix is not None and eng.prefix_cache_bytes is not None:
                assert eng.cache.cached_only_bytes <= eng.prefix_cache_bytes
        # Every request finished exactly once, with Generator's tokens.
        assert sum(eng.stats.finished.values()) == len(reqs) == eng.stats.submitted
        for req, prompt, n, stops in reqs:
            assert finishes.get(req.id) == 1, (req, finishes.get(req.id))
            c = req.result()
            want = expect(prompt, n, stops)
            assert [d.token for d in req.deltas_from(0)[0]] == c.tokens, req
            if c.finish_reason == FINISH_CANCELLED:
                assert c.tokens == want[: len(c.tokens)], (req, prompt, n, stops)
            else:
                assert c.tokens == want, (req, c.finish_reason, prompt, n, stops, kw)
                reason = FINISH_STOP if want[-1] in stops else FINISH_LENGTH
                assert c.finish_reason == reason, (req, c.finish_reason, want, stops)
        assert eng.stats.releases_beside_step == sum(1 for kind, _ in log if kind == "beside")
        ok = True
    finally:
        close_and_check(eng, arena, arena_kind, ok)
    return eng, len(log)


def close_and_check(eng, arena, arena_kind, ok):
    """Closes the engine; on the host arena, checks (unless the test already failed: that
    failure is the one to see) that nothing stays committed and no fault counter moved."""
    eng.close()
    gc.collect()
    if arena_kind != "host":
        return
    try:
        if ok:
            assert arena.committed_bytes == 0, arena.stats()
    finally:
        arena.close()
    if ok:
        s = arena.stats()
        assert s.handles_live == 0 and s.committed_bytes == 0, s
        assert not any(s.faults.values()), s.faults


@pytest.mark.parametrize(
    ("arena_kind", "prefix", "prefix_bytes"),
    CASES,
    ids=["eager", "host-no-prefix", "host-prefix", "host-prefix-cap0", "host-prefix-small"],
)
def test_retiring_slots_under_random_schedules(
    model, generator, rng, arena_kind, prefix, prefix_bytes
):
    expect = Expect(generator)
    for _ in range(3):
        run_schedule(model, expect, rng, arena_kind, prefix, prefix_bytes, 14)


@pytest.mark.parametrize("arena_kind", ["eager", "host"])
def test_retiring_slots_under_the_background_driver(model, generator, rng, arena_kind):
    """The background driver steps while requests arrive and some are cancelled from this
    thread; shutdown(drain=True) returns after the last retiring slot was released (the
    driver's loop counts them as held), every request finished once with Generator's tokens,
    and close() leaves the arena empty."""
    expect = Expect(generator)
    eng, arena, _, _ = build(model, arena_kind, arena_kind == "host", None, rng)
    ok = False
    try:
        eng.start()
        reqs = []
        for _ in range(10):
            history = [(p, r.completion) for (r, p, _, _) in reqs]
            prompt, n, stops = draw_request(rng, model, expect, history)
            reqs.append((eng.submit(prompt, n, stop_token_ids=stops), prompt, n, stops))
            if rng.random() < 0.2:
                reqs[int(rng.integers(len(reqs)))][0].cancel()
            if rng.random() < 0.5:
                reqs[-1][0].result(timeout=60)
        eng.shutdown(drain=True, timeout=120)
        assert eng._thread is None and not eng._retiring and not eng.has_work()
        eng.check_memory()
        assert eng.cache.live_bytes == 0 and int(eng.cache.granules.sum()) == 0
        for req, prompt, n, stops in reqs:
            c = req.result(timeout=0)
            want = expect(prompt, n, stops)
            if c.finish_reason == FINISH_CANCELLED:
                assert c.tokens == want[: len(c.tokens)], (req, prompt, n, stops)
            else:
                assert c.tokens == want, (req, prompt, n, stops)
        assert sum(eng.stats.finished.values()) == len(reqs)
        ok = True
    finally:
        close_and_check(eng, arena, arena_kind, ok)
