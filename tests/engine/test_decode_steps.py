"""Engine(decode_steps=k): k decode steps in one compiled call, each row's token picked on the
device and fed to its next step (the host's work paid once per k tokens). On CPU in f32 every
request's tokens equal the one-step engine's (k = 1, the same requests), through stops
mid-call, preemptions, shared prefix blocks and the memory invariant after every step;
sampled tokens do not depend on k; warm_up compiles every decode program.

The reference is the one-step engine, not Generator alone: the decode step of both computes
every slot's row (M = max_slots), where Generator alone decodes at M = 1, a GEMV whose sums run
in another order; with the tiny random model a near-tie then parts them now and then
(TEST_SEED=472195484: the one-step engine and Generator on the same 3 prompts at once part
from Generator alone at token 7 of one request), which is not what these tests are about."""

import numpy as np
import pytest
from test_engine import engine, prompts, step_checked, token_bytes  # noqa: F401

from jax_kv import Sampling
from jax_kv.engine import FINISH_LENGTH, FINISH_STOP, Engine


def one_step(engine, model, ps, news, stop_ids=(), **kw):  # noqa: F811
    """The one-step engine's tokens for the same requests, submitted at once."""
    with engine(model, **kw) as eng:
        reqs = [
            eng.submit(p, n, stop_token_ids=list(stop_ids)) for p, n in zip(ps, news, strict=True)
        ]
        eng.run_until_idle()
        return [r.result().tokens for r in reqs]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_tokens_equal_the_one_step_engine(model, rng, engine, k):  # noqa: F811
    """Prompts across chunks and granules, max_new from 1 up (k-multiples and not), some
    sharing a prefix (blocks mapped on the host arena): each request's tokens are the
    one-step engine's, every one streamed once."""
    ps = prompts(rng, model, [5, 70, 17, 1, 33, 48, 16, 40])
    ps[6] = ps[1][:50] + ps[6]  # a prefix of another request's prompt
    news = [12, 5, 20, 9, 1, k, 2 * k + 1, 31]
    want = one_step(engine, model, ps, news)
    with engine(model, decode_steps=k) as eng:
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps, news, strict=True)]
        while eng.has_work():
            step_checked(eng)
        for r, w, n in zip(reqs, want, news, strict=True):
            assert r.result().tokens == w, r
            assert r.result().finish_reason == FINISH_LENGTH and r.streamed == n
        assert eng.stats.decode_tokens + len(ps) == sum(news)  # each request's first: prefill


def test_a_stop_mid_call_ends_there_and_spares_the_others(model, rng, engine):  # noqa: F811
    """k = 4: a request whose stop token comes at a step inside a call ends on it (the call's
    later steps for it dropped, their cache writes past its end); a request beside it, and
    one that maps its prefix after it ended, keep their tokens."""
    p, other = prompts(rng, model, [24, 30])
    full, other_tokens = one_step(engine, model, [p, other], [20, 20])
    stop = full[6]
    end = full.index(stop)  # the first time it comes
    later = p + full[: end + 1] + [5, 6]
    (later_tokens,) = one_step(engine, model, [later], [9])
    with engine(model, decode_steps=4) as eng:
        a = eng.submit(p, 20, stop_token_ids=[stop])
        b = eng.submit(other, 20, stop_token_ids=[])
        while eng.has_work():
            step_checked(eng)
        c = eng.submit(later, 9, stop_token_ids=[])
        while eng.has_work():
            step_checked(eng)
    assert a.result().tokens == full[: end + 1] and a.result().finish_reason == FINISH_STOP
    assert a.streamed == end + 1  # no token streamed after its stop
    assert b.result().tokens == other_tokens
    assert c.result().tokens == later_tokens


def test_a_stop_early_in_a_call_keeps_memory_within_the_check(model):
    """Review repro (16-token granules, k = 4): a 9-token prompt's request stops on its
    second token, at the first step of a call whose rows start 9 tokens into a granule, after
    the next call's tokens were committed beside it: the slot holds up to 2 (k - 1) tokens
    past its live ones until it is released, which check_memory allows (k - 1 did not)."""
    from jax_kv.memory import host_arena

    prompt = list(range(3, 12))

    def build(k):
        arena = host_arena(reserve_bytes=1 << 30, granule=16 * token_bytes(model))
        return Engine(model, arena=arena, max_slots=3, max_len=256, prefill_chunk_tokens=32,
                      decode_steps=k)  # fmt: skip

    with build(1) as eng:
        req = eng.submit(prompt, 20, stop_token_ids=[])
        eng.run_until_idle()
        full = req.result().tokens
    assert full[1] != full[0]
    with build(4) as eng:
        req = eng.submit(prompt, 20, stop_token_ids=[full[1]])
        while eng.has_work():
            step_checked(eng)
        assert req.result().tokens == full[:2] and req.result().finish_reason == FINISH_STOP


def test_sampled_tokens_do_not_depend_on_decode_steps(model, rng, engine):  # noqa: F811
    """A row's key is its request's seed and the token's position, so a sampled request's
    tokens are the same at k = 1 and k = 3 (the sampler runs inside the call at k > 1)."""
    ps = prompts(rng, model, [12, 40, 7])
    plans = [Sampling(temperature=0.9, seed=1), Sampling(temperature=1.3, top_k=20, seed=2), None]
    out = {}
    for k in (1, 3):
        with engine(model, decode_steps=k) as eng:
            reqs = [eng.submit(p, 17, s, stop_token_ids=[]) for p, s in zip(ps, plans, strict=True)]
            eng.run_until_idle()
            out[k] = [r.result().tokens for r in reqs]
    assert out[1] == out[3]
    assert len({tuple(t) for t in out[1]}) == 3


def test_preemption_with_decode_steps(model, rng, engine):  # noqa: F811
    """The preemption test's budget (12 granules per binding, 3 slots) at k = 3: requests
    are preempted and re-prefilled, tokens equal the one-step engine's under the same
    budget, memory within the budget."""
    granule = 16 * token_bytes(model)
    budget = 12 * granule * 2 * model.config.num_layers
    ps = prompts(rng, model, [30, 20, 40, 10, 25])
    news = [60, 70, 50, 40, 30]
    want = one_step(engine, model, ps, news, kv_budget_bytes=budget)
    with engine(model, kv_budget_bytes=budget, decode_steps=3) as eng:
        reqs = [eng.submit(p, n, stop_token_ids=[]) for p, n in zip(ps, news, strict=True)]
        while eng.has_work():
            step_checked(eng)
            assert eng.cache.held_bytes <= budget
        assert eng.stats.preemptions > 0
        assert [r.result().tokens for r in reqs] == want


def test_warm_up_compiles_every_decode_program(model, rng, engine):  # noqa: F811
    """After warm_up a run of greedy and sampled requests compiles nothing; the decode calls
    are fewer than the tokens they produced."""
    with engine(model, decode_steps=4, max_slots=4) as eng:
        eng.warm_up()
        s = eng.stats
        before = (s.decode_compiles, s.prefill_compiles, s.sampler_compiles)
        calls, tokens = s.decode_calls, s.decode_tokens
        ps = prompts(rng, model, [9, 30, 3, 50, 21])
        for i, p in enumerate(ps):
            eng.submit(p, 13 + i, Sampling(1.0, seed=i) if i % 2 else None, stop_token_ids=[])
        eng.run_until_idle()
        assert (s.decode_compiles, s.prefill_compiles, s.sampler_compiles) == before
        assert s.decode_tokens - tokens > 2 * (s.decode_calls - calls) > 0


def test_decode_steps_must_be_positive(model):
    with pytest.raises(ValueError, match="decode_steps"):
        Engine(model, max_slots=2, max_len=64, decode_steps=0)


def test_decode_steps_of_one_is_the_plain_step(model, rng):
    """k = 1 builds no steps field: the inputs and the programs are the plain engine's."""
    with Engine(model, max_slots=2, max_len=64) as eng:
        assert "steps" not in eng._input_fields()
        req = eng.submit(prompts(np.random.default_rng(0), model, [5])[0], 3, stop_token_ids=[])
        eng.run_until_idle()
        assert len(req.result().tokens) == 3
