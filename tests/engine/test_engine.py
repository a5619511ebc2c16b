"""The continuous-batching engine (issue 21) on CPU: the API (submit, iterate, result, cancel,
queue full, too long), per-request greedy tokens equal to Generator alone in any arrival order
and with preemptions forced, the memory invariant after every step of a random schedule, one
decode compile for the engine's life, prefill compiles per bucket only, the background driver
and failures that end every request instead of losing one."""

import functools
import threading

import jax
import pytest

from jax_kv import Sampling
from jax_kv.engine import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineError,
    QueueFull,
    RequestError,
)
from jax_kv.memory import EagerArena, host_arena

MAX_LEN = 256


def token_bytes(model):
    c = model.config
    return c.num_kv_heads * c.head_dim * 4


@pytest.fixture(params=["eager", "host"])
def engine(request):
    """Builds engines on the eager arena (dense rows, granules counted) or on the host
    driver's VmmArena (granules committed and unmapped per slot, as on CUDA; the steps' caches
    written back, see SlotCache.writes_back); 16 tokens per granule either way."""
    made = []

    def build(model, **kw):
        kw.setdefault("max_slots", 3)
        kw.setdefault("max_len", MAX_LEN)
        kw.setdefault("prefill_chunk_tokens", 32)
        granule = 16 * token_bytes(model)
        if request.param == "eager":
            arena = EagerArena()
            kw.setdefault("granule_bytes", granule)
        else:
            arena = host_arena(reserve_bytes=1 << 30, granule=granule)
        eng = Engine(model, arena=arena, **kw)
        made.append((eng, arena))
        return eng

    build.kind = request.param
    yield build
    for eng, arena in made:
        eng.close()
        if request.param == "host":
            assert eng.cache.closed and arena.committed_bytes == 0
            arena.close()


def prompts(rng, model, lengths):
    return [[int(t) for t in rng.integers(3, model.config.vocab_size, n)] for n in lengths]


def alone(generator, prompt, n):
    return generator.generate([prompt], n, stop_tokens=[]).tokens[0]


def idle(cache):
    """No request holds memory: what is left is cached prefix blocks no slot maps (the
    prefix cache is on by default on a VmmArena, the host driver's included)."""
    return cache.live_bytes == 0 and cache.held_bytes == cache.cached_only_bytes


def step_checked(eng):
    eng.step()
    eng.check_memory()


def test_greedy_tokens_equal_generator_in_any_arrival_order(model, generator, rng, engine):
    """Requests arrive while others run (some between steps), prompts span several chunks
    (32 tokens) and granules (16 tokens): each request's tokens equal it generated alone."""
    ps = prompts(rng, model, [5, 70, 17, 1, 33, 48, 16])
    news = [12, 5, 20, 9, 1, 14, 7]
    with engine(model) as eng:
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps[:3], news[:3], strict=True)]
        for i in range(3, len(ps)):
            step_checked(eng)
            step_checked(eng)
            reqs.append(eng.submit(ps[i], news[i], stop_token_ids=[]))
        while eng.has_work():
            step_checked(eng)
        for p, n, r in zip(ps, news, reqs, strict=True):
            c = r.result()
            assert c.finish_reason == FINISH_LENGTH and len(c.tokens) == n
            assert c.tokens == alone(generator, p, n), r
        s = eng.stats
        assert s.decode_compiles == len(s.decode_bucket_calls) <= len(eng.decode_buckets())
        assert s.prefill_compiles == len(s.prefill_buckets) <= 2  # buckets 16 and 32
        assert s.finished == {FINISH_LENGTH: len(ps)}
        assert idle(eng.cache)


def test_preemption_keeps_tokens_and_memory_within_the_budget(model, generator, rng, engine):
    """A budget of 12 granules per binding for 3 slots: the running requests outgrow it, the
    youngest are preempted (granules released, tokens kept) and re-prefilled later; tokens
    still equal Generator's, held memory never passes the budget."""
    tb = token_bytes(model)
    granule = 16 * tb
    bindings = 2 * model.config.num_layers
    budget = 12 * granule * bindings
    ps = prompts(rng, model, [30, 20, 40, 10, 25])
    news = [60, 70, 50, 40, 30]
    with engine(model, kv_budget_bytes=budget) as eng:
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps, news, strict=True)]
        while eng.has_work():
            step_checked(eng)
            assert eng.cache.held_bytes <= budget
        assert eng.stats.preemptions > 0
        assert sum(r.result().preemptions for r in reqs) == eng.stats.preemptions
        for p, n, r in zip(ps, news, reqs, strict=True):
            assert r.result().tokens == alone(generator, p, n), r
        assert (
            eng.stats.decode_compiles
            == len(eng.stats.decode_bucket_calls)
            <= len(eng.decode_buckets())
        )


def test_memory_invariant_and_compiles_over_a_random_schedule(model, rng, engine):
    """200 requests of random lengths arriving at random steps, a few cancelled: after every
    step the slots hold at most live bytes + one granule per (binding, slot in use); one
    decode compile; every request ends with a reason."""
    with engine(model, max_slots=4, max_queue=1000) as eng:
        reqs = []
        pending = [(int(rng.integers(1, 60)), int(rng.integers(1, 40))) for _ in range(200)]
        while pending or eng.has_work():
            for _ in range(int(rng.poisson(1.5))):
                if pending:
                    n, new = pending.pop()
                    reqs.append(eng.submit(prompts(rng, model, [n])[0], new))
            if reqs and rng.random() < 0.05:
                reqs[int(rng.integers(len(reqs)))].cancel()
            step_checked(eng)
        reasons = [r.completion.finish_reason for r in reqs]
        assert len(reqs) == 200 and all(r.done for r in reqs)
        assert set(reasons) <= {FINISH_LENGTH, FINISH_CANCELLED, FINISH_STOP}
        assert (
            eng.stats.decode_compiles
            == len(eng.stats.decode_bucket_calls)
            <= len(eng.decode_buckets())
        )
        assert eng.stats.prefill_compiles <= 2
        assert idle(eng.cache)


def test_cancel_a_queued_and_a_running_request(model, rng, engine):
    ps = prompts(rng, model, [10, 10, 10])
    with engine(model, max_slots=1) as eng:
        running = eng.submit(ps[0], 50, stop_token_ids=[])
        queued = eng.submit(ps[1], 5, stop_token_ids=[])
        eng.step()
        eng.step()
        held = eng.cache.held_bytes
        assert held > 0 and not running.done and not queued.done
        queued.cancel()
        running.cancel()
        eng.step()  # within one step both end and the slot's memory is back
        assert idle(eng.cache)
        assert running.result().finish_reason == FINISH_CANCELLED
        assert 1 <= len(running.result().tokens) < 50
        assert queued.result().finish_reason == FINISH_CANCELLED
        assert queued.result().tokens == []
        late = eng.submit(ps[2], 3, stop_token_ids=[])
        eng.run_until_idle()
        assert late.result().finish_reason == FINISH_LENGTH


def test_stop_token_ends_a_request_and_is_kept(model, generator, rng, engine):
    p = prompts(rng, model, [12])[0]
    free = alone(generator, p, 10)
    stop = free[4]
    k = free.index(stop)  # the first occurrence ends it
    with engine(model) as eng:
        r = eng.submit(p, 10, stop_token_ids=[stop])
        eng.run_until_idle()
    c = r.result()
    assert c.finish_reason == FINISH_STOP and c.tokens == free[: k + 1]


def test_submit_refusals_name_the_numbers(model, engine):
    with engine(model, max_queue=2) as eng:
        with pytest.raises(ValueError, match=r"prompt: 250 tokens \+ max_new_tokens 7 = 257 "
                           r"exceeds max_len=256"):  # fmt: skip
            eng.submit([5] * 250, 7)
        with pytest.raises(ValueError, match=r"prompt: token id 512 outside \[0, vocab=512\)"):
            eng.submit([1, 512], 4)
        with pytest.raises(ValueError, match=r"max_new_tokens: expected an int >= 1, got 0"):
            eng.submit([1], 0)
        with pytest.raises(ValueError, match=r"prompt: expected at least one token"):
            eng.submit([], 3)
        with pytest.raises(ValueError, match=r"stop_token_ids: expected token ids in "
                           r"\[0, vocab=512\), got 512"):  # fmt: skip
            eng.submit([1], 3, stop_token_ids=[512])
        with pytest.raises(ValueError, match=r"stop strings need a tokenizer"):
            eng.submit([1], 3, stop="x")
        with pytest.raises(ValueError, match=r"sampling: expected a jax_kv.Sampling"):
            eng.submit([1], 3, sampling={"temperature": 1})
        eng.submit([1], 3)
        eng.submit([2], 3)
        with pytest.raises(QueueFull, match=r"2 requests waiting, max_queue=2"):
            eng.submit([3], 3)
        assert eng.stats.submitted == 2
    granule = 16 * token_bytes(model)
    small = 4 * granule * 2 * model.config.num_layers  # 64 tokens per request at most
    with engine(model, kv_budget_bytes=small) as eng:
        with pytest.raises(ValueError, match=rf"need the KV memory of 69 tokens, more than "
                           rf"the {small} bytes the engine can ever give one request \(64 "
                           r"tokens\)"):  # fmt: skip
            eng.submit([1] * 60, 10)
        eng.submit([1] * 60, 5)  # 64 tokens: fits


def test_bad_engine_arguments(model, engine):
    for kw, match in [
        (dict(max_slots=0), r"max_slots: expected an int >= 1, got 0"),
        (dict(prefill_chunk_tokens=8), r"prefill_chunk_tokens: expected an int >= 16, got 8"),
        (dict(max_len=4096), r"max_len: expected <= the model's max_position_embeddings"),
        (dict(max_queue=True), r"max_queue: expected an int >= 1, got True"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine(model, **kw)
    with pytest.raises(ValueError, match=r"model: expected a jax_kv.decode.DecoderModel"):
        Engine(object())


def test_per_request_sampling_does_not_depend_on_companions(model, rng, engine):
    """A seeded sampled request gives the same tokens alone and beside others (its key is
    folded from its seed and the token's position, not from the slot or the step)."""
    p, q = prompts(rng, model, [9, 21])
    hot = Sampling(temperature=1.5, top_k=50, top_p=0.9, seed=123)
    with engine(model) as eng:
        solo = eng.submit(p, 16, hot, stop_token_ids=[])
        eng.run_until_idle()
    with engine(model) as eng:
        eng.submit(q, 30, Sampling(temperature=0.7, seed=5), stop_token_ids=[])
        eng.step()
        mixed = eng.submit(p, 16, hot, stop_token_ids=[])
        greedy = eng.submit(q, 8, stop_token_ids=[])
        eng.run_until_idle()
    assert mixed.result().tokens == solo.result().tokens
    other = Sampling(temperature=1.5, top_k=50, top_p=0.9, seed=124)
    with engine(model) as eng:
        diff = eng.submit(p, 16, other, stop_token_ids=[])
        eng.run_until_idle()
    assert diff.result().tokens != solo.result().tokens
    assert greedy.result().finish_reason == FINISH_LENGTH


def test_background_driver_streams_in_order_from_many_threads(model, rng, engine):
    ps = prompts(rng, model, [int(n) for n in rng.integers(1, 50, 24)])
    with engine(model, max_slots=4) as eng:
        eng.start()
        reqs: list = [None] * len(ps)
        streamed: list = [None] * len(ps)

        def client(i):
            reqs[i] = eng.submit(ps[i], 6 + i % 5, stop_token_ids=[])
            streamed[i] = [d.token for d in reqs[i]]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        eng.shutdown(drain=True)
        for i, r in enumerate(reqs):
            c = r.result(timeout=1)
            assert c.finish_reason == FINISH_LENGTH
            assert streamed[i] == c.tokens and len(c.tokens) == 6 + i % 5
        with pytest.raises(EngineError, match=r"shutting down"):
            eng.submit([1], 2)


def test_shutdown_without_drain_cancels(model, rng, engine):
    ps = prompts(rng, model, [20, 20, 20, 20])
    with engine(model, max_slots=2) as eng:
        reqs = [eng.submit(p, 200 - 20) for p in ps]
        eng.step()
        eng.shutdown(drain=False)
        assert all(r.completion.finish_reason == FINISH_CANCELLED for r in reqs)
        assert idle(eng.cache)


def test_a_failed_step_ends_every_request_with_its_error(model, rng, engine):
    ps = prompts(rng, model, [8, 8, 8, 8, 8])
    with engine(model, max_slots=2) as eng:
        reqs = [eng.submit(p, 20, stop_token_ids=[]) for p in ps]
        eng.step()
        eng.step()

        def broken(*a, **k):
            raise RuntimeError("injected device failure")

        eng._decode = broken
        with pytest.raises(RuntimeError, match="injected device failure"):
            eng.step()
        for r in reqs:
            assert r.completion.finish_reason == FINISH_ERROR
            with pytest.raises(RequestError, match="injected device failure"):
                r.result()
        with pytest.raises(EngineError, match=r"the engine failed: injected device failure"):
            eng.submit([1], 2)


def test_a_row_the_attention_op_refuses_in_decode_ends_only_its_request(
    model, generator, rng, engine
):
    """A decode call's status names a row the attention op refused (a nonzero code: its
    output is NaN): that request ends with the error, the call's other rows advance, and
    every other request's tokens are still its tokens generated alone."""
    ps = prompts(rng, model, [8, 12, 10])
    with engine(model, max_slots=3) as eng:
        reqs = [eng.submit(p, 24, stop_token_ids=[]) for p in ps]
        victim = reqs[1]
        decode, calls = eng._decode, [0]

        def refuse_on_the_fourth_call(*args, **kw):
            logits, status, caches, positions = decode(*args, **kw)
            calls[0] += 1
            if calls[0] == 4:
                b = next(s.slot for s in eng._slots if s is not None and s.request is victim)
                status = status.at[b].set(1)
            return logits, status, caches, positions

        eng._decode = refuse_on_the_fourth_call
        while eng.has_work():
            eng.step()
            eng.check_memory()
        assert calls[0] > 4
        c = victim.completion
        assert c.finish_reason == FINISH_ERROR and 0 < len(c.tokens) < 24
        with pytest.raises(RequestError, match="refused by the attention op"):
            victim.result()
        for p, r in ((ps[0], reqs[0]), (ps[2], reqs[2])):
            assert r.result().finish_reason == FINISH_LENGTH
            assert r.result().tokens == alone(generator, p, 24)
        assert idle(eng.cache)


@pytest.mark.parametrize(
    ("max_len", "chunk", "slots", "buckets"),
    [
        (256, 512, 8, False),
        (100, 512, 2, False),
        (130, 512, 1, False),
        (2048, 64, 4, False),
        (2048, 200, 4, False),
        (256, 64, 8, True),
    ],
    ids=[
        "max_len<chunk",
        "two short slots",
        "one slot",
        "chunk<max_len",
        "chunk not 2^k",
        "decode row buckets",
    ],  # fmt: skip
)
def test_after_warm_up_no_request_waits_for_a_compile(model, rng, max_len, chunk, slots, buckets):
    """warm_up compiles every prefill bucket a call can reach, including buckets only a packed
    call of several rows reaches (max_len below the chunk: it used to miss them), and the
    decode step of every decode bucket with both its pickers; a burst of requests of every
    length then compiles nothing."""
    with Engine(model, max_slots=slots, max_len=max_len, prefill_chunk_tokens=chunk,
                arena=EagerArena(), decode_row_buckets=buckets) as eng:  # fmt: skip
        eng.warm_up()
        rows = len(eng.decode_buckets())  # 1; 4 with buckets (1, 2, 4, 8)
        assert eng.stats.decode_compiles == rows
        assert eng.stats.sampler_compiles == 2 * rows  # the argmax and the sampler picker
        before = (eng.stats.prefill_compiles, rows, 2 * rows)
        for i, n in enumerate(rng.integers(1, min(max_len, 300), 24)):
            prompt = [int(t) for t in rng.integers(3, model.config.vocab_size, n)]
            sampling = Sampling(temperature=0.8, seed=i) if i % 3 == 0 else None
            eng.submit(prompt, int(min(16, max_len - n)), sampling, stop_token_ids=[])
        eng.run_until_idle()
        s = eng.stats
        assert (s.prefill_compiles, s.decode_compiles, s.sampler_compiles) == before, (
            s.prefill_buckets
        )


def test_close_frees_the_cache_when_its_last_step_fails(model):
    """close() runs a last step (ending the cancelled requests) and then frees the cache; when
    that step raises (a request's listener, as the server's call_soon_threadsafe on a closed
    event loop does), the cache is freed all the same and the step's error propagates."""
    arena = host_arena(reserve_bytes=256 << 20, granule=16 * token_bytes(model))
    try:
        eng = Engine(model, arena=arena, max_slots=2, max_len=64, prefill_chunk_tokens=16)
        r = eng.submit([1, 2, 3], 4)

        def closed_loop():
            raise RuntimeError("Event loop is closed")

        r.add_listener(closed_loop)
        with pytest.raises(RuntimeError, match="Event loop is closed"):
            eng.close()
        assert eng.cache.closed
        s = arena.stats()
        assert (s.regions, s.live_views, s.committed_bytes) == (0, 0, 0)
    finally:
        arena.close()


@pytest.mark.parametrize("buckets", [False, True], ids=["all-rows", "row-buckets"])
@pytest.mark.parametrize("max_len, max_queue", [(8, 2), (2, 1024), (3, 1)])
def test_warm_up_fits_any_geometry_the_engine_accepts(model, max_len, max_queue, buckets):
    """warm_up submits several prompts per bucket and a last batch of min(4, max_slots): it
    stays within the engine's own max_queue (it used to raise QueueFull with its requests left
    queued), and at the smallest max_len accepted (2) its prompts are not empty. It compiles
    every decode bucket (1, 2, 4 with decode row buckets) and both pickers of each, whether
    or not a warm request decoded there (at max_len 2 none decodes)."""
    eng = Engine(model, arena=EagerArena(), max_slots=4, max_len=max_len,
                 prefill_chunk_tokens=16, max_queue=max_queue,
                 decode_row_buckets=buckets)  # fmt: skip
    try:
        eng.warm_up()
        assert eng.num_waiting == 0 and not eng.has_work()
        assert eng.stats.decode_compiles == len(eng.decode_buckets()) == (3 if buckets else 1)
        assert eng.stats.sampler_compiles == 2 * len(eng.decode_buckets())
    finally:
        eng.close()


def test_start_is_refused_after_shutdown(model):
    eng = Engine(model, arena=EagerArena(), max_slots=2, max_len=64)
    eng.shutdown()
    with pytest.raises(EngineError, match="start: the engine was shut down"):
        eng.start()
    eng.close()


def test_steps_read_their_inputs_at_fixed_addresses(model, generator, rng):
    """Every call of a compiled step reads its per-step inputs (tokens, lengths, bounds,
    prefill offsets, sampling) from the same buffers, rewritten in place: XLA replays a
    recorded CUDA graph only while its buffers keep their addresses (a fresh `lengths` per
    call re-recorded the Generator's graph at every step). Tokens still equal the Generator's
    alone, so no call read a stale value."""
    arena = host_arena(reserve_bytes=1 << 30, granule=16 * token_bytes(model))
    eng = Engine(model, max_slots=3, max_len=MAX_LEN, prefill_chunk_tokens=32, arena=arena)
    seen: dict[tuple, set] = {}

    def recording(kind, step):
        def run(params, *args):
            arrays = [a for a in args if isinstance(a, jax.Array)]  # not the caches' list
            key = (kind, *(a.shape for a in arrays))  # a prefill bucket has its own buffers
            seen.setdefault(key, set()).add(tuple(a.unsafe_buffer_pointer() for a in arrays))
            return step(params, *args)

        return run

    eng._prefill, eng._decode = recording("prefill", eng._prefill), recording("decode", eng._decode)
    try:
        ps = prompts(rng, model, [5, 40, 17, 1, 33, 64, 9])
        news = [3, 11, 6, 1, 9, 20, 4]  # the last ones decode alone: decode-only calls
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps, news, strict=True)]
        eng.run_until_idle()
        for p, r in zip(ps, reqs, strict=True):
            assert r.result().tokens == alone(generator, p, len(r.result().tokens))
        s = eng.stats
        assert s.decode_calls >= 5 and s.mixed_calls >= 3 and len(s.prefill_buckets) > 1, s
        moved = {k: len(v) for k, v in seen.items() if len(v) != 1}
        assert not moved, f"inputs at new addresses (calls' pointer sets per step): {moved}"
        calls = eng.stats.prefill_calls + eng.stats.decode_calls
        assert eng._inputs.writes == calls  # one upload per call
    finally:
        eng.close()
        assert arena.committed_bytes == 0
        arena.close()


def test_a_prefill_piece_and_the_decoding_rows_take_one_call(model, generator, rng, engine):
    """A step with a prefill piece advances the decoding requests in the same call (one pass
    over the weights, the decode kernel for their rows); a step without one runs the decode
    step. Both requests' tokens equal each generated alone."""
    eng = engine(model, max_slots=3, prefill_chunk_tokens=32)
    a, b = prompts(rng, model, [7, 50])
    ra = eng.submit(a, 12, stop_token_ids=[])
    eng.step()  # a's prompt: its first token
    assert (eng.last_step.prefill_tokens, eng.last_step.decode_rows) == (7, 0)
    rb = eng.submit(b, 5, stop_token_ids=[])
    s = eng.stats
    before = (s.prefill_calls, s.mixed_calls, s.decode_calls)
    eng.step()  # b's first piece (32 of its 50 tokens) and a's second token
    assert (eng.last_step.prefill_tokens, eng.last_step.decode_rows) == (32, 1)
    assert (s.prefill_calls, s.mixed_calls, s.decode_calls) == (
        before[0] + 1, before[1] + 1, before[2]
    )  # fmt: skip
    eng.step()  # the rest of b (18), a's third token
    assert (eng.last_step.prefill_tokens, eng.last_step.decode_rows) == (18, 1)
    eng.step()  # no piece left: the decode step, both rows
    assert (eng.last_step.prefill_tokens, eng.last_step.decode_rows) == (0, 2)
    assert s.decode_calls == before[2] + 1
    eng.run_until_idle()
    assert ra.result().tokens == alone(generator, a, 12)
    assert rb.result().tokens == alone(generator, b, 5)
    assert len(ra.result().tokens) == 12 and s.decode_tokens == 12 - 1 + 5 - 1


def test_the_default_budget_holds_max_len_in_whole_granules(model):
    """On the eager arena the default budget is every slot at max_len, counted in whole
    granules as admission counts them: with max_len not a whole number of granules, a request
    of max_len tokens is accepted and runs (it was refused as more than the engine could ever
    give one request, and warm_up failed the same way)."""
    granule = 16 * token_bytes(model)
    with Engine(model, arena=EagerArena(), max_slots=2, max_len=200, prefill_chunk_tokens=32,
                granule_bytes=granule) as eng:  # fmt: skip
        bindings = 2 * model.config.num_layers
        assert eng.cache.budget_bytes == bindings * 2 * 13 * granule  # ceil(200 / 16) = 13
        eng.warm_up()
        req = eng.submit([5] * 150, 50, stop_token_ids=[])
        eng.run_until_idle()
        assert len(req.result().tokens) == 50


def test_an_ended_requests_slot_is_released_beside_the_next_call(model, generator, rng, engine):
    """A request that ends on a call's token has its result at once; its slot is released
    while the next call runs (its row idle in it: not planned into it) and is not admitted
    into before; the release is counted; with nothing left to call, a step releases it."""
    a_prompt, b_prompt = prompts(rng, model, [20, 24])
    with engine(model, max_slots=2) as eng:
        a = eng.submit(a_prompt, 3, stop_token_ids=[])
        b = eng.submit(b_prompt, 9, stop_token_ids=[])
        while not a.done:
            step_checked(eng)
        held = eng.cache.held_bytes
        assert eng.num_running == 1 and eng._retiring and eng.has_work()
        before = eng.stats.releases_beside_step
        step_checked(eng)  # b's decode call: a's slot released beside it
        assert not eng._retiring and eng.stats.releases_beside_step == before + 1
        # (on VMM the block a ended in stays cached: the prefix cache's, not a's)
        assert eng.cache.held_bytes - eng.cache.cached_only_bytes < held
        c = eng.submit(a_prompt, 2, stop_token_ids=[])  # takes a slot only now
        while eng.has_work():
            step_checked(eng)
        assert idle(eng.cache) and not eng._retiring
        for p, n, r in ((a_prompt, 3, a), (b_prompt, 9, b), (a_prompt, 2, c)):
            assert r.result().tokens == alone(generator, p, n)
    # Alone: the last request's slot is released by a step with no call.
    with engine(model, max_slots=1) as eng:
        r = eng.submit(a_prompt, 2, stop_token_ids=[])
        eng.run_until_idle()
        assert r.done and not eng._retiring and idle(eng.cache)


def test_admission_short_of_memory_takes_a_retiring_slots_memory_first(model, rng, engine):
    """The budget holds one request: the next one is admitted in the step after the first
    ends (the ended slot's granules released for it at once, the device idle), without a
    preemption."""
    tb = token_bytes(model)
    granule = 16 * tb
    bindings = 2 * model.config.num_layers
    first, second = prompts(rng, model, [40, 40])
    with engine(model, max_slots=2, kv_budget_bytes=3 * granule * bindings) as eng:
        a = eng.submit(first, 4, stop_token_ids=[])
        b = eng.submit(second, 4, stop_token_ids=[])
        while not a.done:
            step_checked(eng)
        assert eng.num_waiting == 1 and eng._retiring
        step_checked(eng)
        assert eng.num_running == 1 and not eng._retiring
        assert eng.stats.releases_beside_step == 0  # released at planning, not beside
        eng.run_until_idle()
        assert b.result().finish_reason == FINISH_LENGTH and eng.stats.preemptions == 0


def test_a_queued_request_takes_an_ended_requests_slot_in_the_next_step(model, rng, engine):
    """Slots short, memory not: the queue's head takes the slot of a request that ended on
    the last call in the very next step (released at planning), so one slot serves requests
    back to back with no step without a call. (Found by review: a released-beside-the-call
    slot made every request cost one more step: 24 steps for 18 calls.)"""
    ps = prompts(rng, model, [12, 9, 15])
    with engine(model, max_slots=1) as eng:
        reqs = [eng.submit(p, 3, stop_token_ids=[]) for p in ps]
        calls = 0
        while eng.has_work():
            step_checked(eng)
            calls += bool(eng.last_step.prefill_tokens or eng.last_step.decode_rows)
        assert all(r.result().finish_reason == FINISH_LENGTH for r in reqs)
        # Per request: a prefill call (its first token), 2 decode calls; then one step that
        # releases the last slot.
        assert calls == 3 * 3 and eng.stats.steps == calls + 1


def test_a_decoding_rows_next_granule_is_committed_while_the_call_runs(
    model, generator, rng, engine
):
    """A decoding row about to enter a new granule has it committed beside the call (so the
    next planning commits nothing for it), within the floor of one granule per slot; a row
    ending by length gets none; tokens are unchanged."""
    (p,) = prompts(rng, model, [10])
    with engine(model, max_slots=1) as eng:
        r = eng.submit(p, 40, stop_token_ids=[])  # 10 + 40 tokens: granules of 16 at 16, 32, 48
        while eng.has_work():
            step_checked(eng)
            slot = eng._slots[0]
            if slot is not None and slot.generated:
                backed = int(eng.cache.committed_tokens()[0])
                assert slot.cached + 1 <= backed <= slot.cached + 1 + 16  # the next token's
        # The cache ends holding 49 tokens (the last one sampled is never written): the
        # granules from 16, 32 and 48 are committed ahead, the first by the prefill.
        assert eng.stats.commits_ahead == 3
        assert r.result().tokens == alone(generator, p, 40)


def submit_queued_or_one_by_one(eng, ps, n, queued):
    """The prompts all at once (each after the first waits for the one slot), or each after
    the last ended; returns the requests, served."""
    if queued:
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p in ps]
        eng.run_until_idle()
        return reqs
    reqs = []
    for p in ps:
        reqs.append(eng.submit(p, n, stop_token_ids=[]))
        eng.run_until_idle()
    return reqs


def test_a_queued_request_takes_an_ended_slots_granules_as_they_are(model, generator, rng,
                                                                    engine):  # fmt: skip
    """Without the prefix cache, a queued request given an ended request's slot keeps the
    granules its first piece needs (SlotCache.hand_over): on VMM fewer map calls than the same
    requests each taking a released slot; tokens are unchanged."""
    ps = prompts(rng, model, [40, 30, 35])
    runs = {}
    for queued in (True, False):
        with engine(model, max_slots=1, prefix_cache=False) as eng:
            arena = eng.cache.arena
            maps = arena.stats().map_calls if eng.cache.is_vmm else 0
            reqs = submit_queued_or_one_by_one(eng, ps, 6, queued)
            for p, r in zip(ps, reqs, strict=True):
                assert r.result().tokens == alone(generator, p, 6)
            assert eng.stats.slots_handed_over == (2 if queued else 0)
            assert idle(eng.cache)
            runs[queued] = (arena.stats().map_calls - maps) if eng.cache.is_vmm else 0
    if runs[False]:
        assert runs[True] < runs[False], runs


def release_at_once(retire, only=None, keep_for_queue=False):
    """Engine._retire as it was before keep_for_queue: every ended slot released now."""
    return retire(only)


def test_ended_slots_wait_for_the_queue_and_are_handed_over_not_released(
    model, generator, rng, engine
):
    """Saturated (a queue longer than the slots, a prefill chunk the running prompts fill), a
    slot whose request ended is kept past the call for a queued head (Engine._retire's
    keep_for_queue) instead of released: every admission after the first max_slots takes an
    ended slot with its granules, the memory invariant holds after every step, tokens equal
    Generator's, and once the queue is empty every slot is released. Against the same run
    with every ended slot released at once: more hand-overs, fewer map calls on VMM."""
    ps = prompts(rng, model, [60, 45, 70, 50, 65, 40, 55, 75])
    news = [3, 9, 5, 12, 4, 8, 6, 10]
    runs = {}
    for keep in (True, False):
        with engine(model, max_slots=3, prefill_chunk_tokens=16, prefix_cache=False) as eng:
            if not keep:
                eng._retire = functools.partial(release_at_once, eng._retire)
            maps = eng.cache.arena.stats().map_calls if eng.cache.is_vmm else 0
            reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps, news, strict=True)]
            while eng.step():
                eng.check_memory()
            for p, n, r in zip(ps, news, reqs, strict=True):
                assert r.result().tokens == alone(generator, p, n)
            assert (eng.stats.slots_kept_for_queue > 0) == keep
            assert idle(eng.cache)
            maps = (eng.cache.arena.stats().map_calls - maps) if eng.cache.is_vmm else 0
            runs[keep] = (eng.stats.slots_handed_over, maps)
    assert runs[True][0] == len(ps) - 3 > runs[False][0], runs
    assert runs[True][1] < runs[False][1] or not runs[True][1], runs


def test_a_queued_request_takes_an_ended_slot_whose_blocks_the_prefix_store_keeps(
    model, generator, rng, engine
):
    """With the prefix cache on, an ended request's slot holds blocks the store keeps (full
    blocks here: 16 tokens each). A queued request given that slot gets fresh granules in
    place of them (SlotCache.hand_over through VmmArena.recommit: no zero granule mapped
    between); tokens are unchanged, the store's blocks still serve a later request that shares
    them, and the driver makes fewer calls than for the same requests each taking a released
    slot."""
    if engine.kind != "host":
        pytest.skip("the prefix cache needs a VmmArena")
    ps = prompts(rng, model, [40, 30, 35])
    runs = {}
    for queued in (True, False):
        with engine(model, max_slots=1) as eng:
            before = eng.cache.arena.stats()
            reqs = submit_queued_or_one_by_one(eng, ps, 6, queued)
            for p, r in zip(ps, reqs, strict=True):
                assert r.result().tokens == alone(generator, p, 6)
            assert eng.stats.slots_handed_over == (2 if queued else 0)
            assert idle(eng.cache)
            eng.check_memory()
            # The first request's history, continued: its cached blocks were kept.
            turn = ps[0] + reqs[0].result().tokens + prompts(rng, model, [5])[0]
            hits = eng.prefix.stats.hit_tokens
            again = eng.submit(turn, 4, stop_token_ids=[])
            eng.run_until_idle()
            assert eng.prefix.stats.hit_tokens > hits
            assert again.result().tokens == alone(generator, turn, 4)
            after = eng.cache.arena.stats()
            runs[queued] = sum(
                getattr(after, c) - getattr(before, c)
                for c in ("map_calls", "unmap_calls", "zero_map_calls", "zero_access_calls")
            )
    assert runs[True] < runs[False], runs


def test_a_queued_request_reuses_an_ended_slot_in_place_after_its_partial_block(
    model, generator, rng, engine
):
    """With the prefix cache on, the partial block an ended request wrote (its own tail: of
    use only to a request continuing it) is evicted when a queued request that does not
    continue it takes the slot, and the slot's granules serve the new request as they are:
    no map call, as with the prefix cache off. Tokens are unchanged; a later continuation of
    the first request finds no cached tail and prefills it, with the same tokens."""
    if engine.kind != "host":
        pytest.skip("the prefix cache needs a VmmArena")
    ps = prompts(rng, model, [8, 6, 7])  # with their 6 tokens, inside one 16-token block
    maps = {}
    for prefix in (True, False):
        with engine(model, max_slots=1, prefix_cache=prefix) as eng:
            before = eng.cache.arena.stats().map_calls
            reqs = submit_queued_or_one_by_one(eng, ps, 6, True)
            for p, r in zip(ps, reqs, strict=True):
                assert r.result().tokens == alone(generator, p, 6)
            maps[prefix] = eng.cache.arena.stats().map_calls - before
            assert eng.stats.slots_handed_over == 2
            assert eng.stats.hand_over_evictions == (2 if prefix else 0)
            assert idle(eng.cache)
            eng.check_memory()
            if prefix:
                turn = ps[0] + reqs[0].result().tokens + prompts(rng, model, [5])[0]
                hits = eng.prefix.stats.hit_tokens
                again = eng.submit(turn, 4, stop_token_ids=[])
                eng.run_until_idle()
                assert eng.prefix.stats.hit_tokens == hits  # its tail went with the slot
                assert again.result().tokens == alone(generator, turn, 4)
    assert maps[True] == maps[False] > 0, maps
