"""Generator on CPU, in process: several tokens per call equal one token per call, stop
tokens end a row, sampling is reproducible, counters add up, a step is never kept across a
move, bad arguments are refused."""

import numpy as np
import pytest
from reference_loop import greedy_static

import jax_kv.models as jm
from jax_kv.cache import GrowthEvent
from jax_kv.decode import GenerationStats, Generator, Sampling


@pytest.fixture(scope="module")
def model():
    return jm.random_model("tiny-llama", seed=1)


PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [8, 8, 8, 1, 4, 6, 20]]


def test_matches_the_reference_loop(model):
    want = greedy_static(model.params, model.config, PROMPTS, 24)
    got = Generator(model, min_bucket=8).generate(PROMPTS, 24, stop_tokens=())
    assert got.tokens == want
    s = got.stats
    assert s.growth_events >= 2 and s.captures == 1 + s.invalidations
    assert s.replays + s.captures == s.decode_calls == 23
    assert s.decode_tokens == 23 * len(PROMPTS)
    assert s.host_overhead_us_per_step == s.host_overhead_us > 0


@pytest.mark.parametrize("k", [3, 4])
def test_tokens_per_call(model, k):
    """k decode steps inside one jitted call (lax.scan), growth only
    between calls."""
    one = Generator(model, min_bucket=8).generate(PROMPTS, 21, stop_tokens=())
    seen = []
    many = Generator(model, min_bucket=8, tokens_per_call=k).generate(
        PROMPTS, 21, stop_tokens=(), on_tokens=seen.append
    )
    assert many.tokens == one.tokens
    assert many.stats.decode_calls < one.stats.decode_calls
    # 20 decode tokens are not a multiple of k: the last call runs k steps anyway (no second
    # compiled step for the tail: as many compiles as a run with no tail), and its extra
    # tokens are neither counted nor streamed.
    s = many.stats
    whole = 1 + k * -(-20 // k)
    no_tail = Generator(model, min_bucket=8, tokens_per_call=k).generate(
        PROMPTS, whole, stop_tokens=()
    )
    assert s.captures == no_tail.stats.captures and s.decode_calls == -(-20 // k)
    assert s.decode_tokens == 20 * len(PROMPTS)
    # Every call ran k steps: the host time per step is the time per call over k.
    assert s.host_overhead_us > 0
    assert s.host_overhead_us_per_step == pytest.approx(s.host_overhead_us / k)
    assert len(seen) == 21 and all(len(row) == 21 for row in many.tokens)


def test_stop_tokens_end_rows(model):
    free = Generator(model).generate(PROMPTS, 16, stop_tokens=())
    stop = free.tokens[1][5]  # row 1 stops on its 6th token (and keeps it)
    r = Generator(model).generate(PROMPTS, 16, stop_tokens=[stop])
    for row, full in zip(r.tokens, free.tokens, strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:cut]


def test_streaming_callback(model):
    seen = []
    r = Generator(model).generate(PROMPTS, 6, stop_tokens=(), on_tokens=seen.append)
    assert [[s[b] for s in seen] for b in range(3)] == r.tokens


def test_sampling_is_seeded(model):
    s = Sampling(temperature=1.0, top_k=50, seed=3)
    a = Generator(model).generate(PROMPTS, 12, s, stop_tokens=()).tokens
    b = Generator(model).generate(PROMPTS, 12, s, stop_tokens=()).tokens
    c = (
        Generator(model)
        .generate(PROMPTS, 12, Sampling(temperature=1.0, top_k=50, seed=4), stop_tokens=())
        .tokens
    )
    assert a == b and a != c


def test_a_new_seed_compiles_nothing(model):
    # The seed only makes the rng key, an argument of the step: not part of what is compiled.
    first, second = (Sampling(temperature=1.0, top_k=50, seed=seed) for seed in (4, 5))
    gen = Generator(model)
    gen.generate(PROMPTS, 12, first, stop_tokens=())
    r = gen.generate(PROMPTS, 12, second, stop_tokens=())
    assert r.stats.captures == 0 and r.stats.prefill_captures == 0
    assert r.tokens == Generator(model).generate(PROMPTS, 12, second, stop_tokens=()).tokens


def test_compiled_steps_are_reused_across_calls(model):
    gen = Generator(model, min_bucket=64)
    gen.generate(PROMPTS, 4, stop_tokens=())
    again = gen.generate(PROMPTS, 4, stop_tokens=()).stats
    assert again.captures == 0 and again.prefill_captures == 0 and again.replays == 3


def test_steps_a_growth_invalidated_serve_a_later_call(model):
    # Eager arena (CPU): every growth invalidates the current step; the next generate starts
    # at the small capacity again and reuses the steps of the first, compiling nothing.
    gen = Generator(model, min_bucket=8)
    first = gen.generate(PROMPTS, 24, stop_tokens=())
    again = gen.generate(PROMPTS, 24, stop_tokens=())
    assert again.tokens == first.tokens
    s = again.stats
    assert s.invalidations == first.stats.invalidations >= 2
    assert not any(d.kept for d in s.decisions)
    assert s.captures == 0 and s.prefill_captures == 0 and s.replays == s.decode_calls == 23


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(prompts=[[]], max_new_tokens=4), "prompts: expected one or more non-empty"),
        (dict(prompts=[[1, 10**6]], max_new_tokens=4), r"prompts\[0\]: token id 1000000 outside"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens: expected an int >= 1, got 0"),
        (dict(prompts=["text"], max_new_tokens=2), "no tokenizer"),
    ],
)
def test_bad_arguments(model, args, match):
    with pytest.raises(ValueError, match=match):
        Generator(model).generate(**args)


def test_bad_generator_arguments(model):
    with pytest.raises(ValueError, match="tokens_per_call: expected an int >= 1, got 0"):
        Generator(model, tokens_per_call=0)
    with pytest.raises(ValueError, match="layout: expected a jax_kv.Layout"):
        Generator(model, layout="diagonal")


class _Cache:
    """The two things `_decide` reads of a KvCache after an event."""

    def __init__(self, capacity: int, pointers: list[int]):
        self.array_capacity, self._pointers = capacity, pointers

    def pointers(self) -> list[int]:
        return self._pointers


def _event(keeps: bool, moved: int) -> GrowthEvent:
    return GrowthEvent(
        old_capacity=16,
        new_capacity=32,
        bytes_moved=moved,
        granules_committed=1,
        shape_changed=False,
        pointer_changed=False,
        keeps_compiled_step=keeps,
        reason="committed granules",
    )


@pytest.mark.parametrize(
    "keeps, moved, after, kept",
    [
        (True, 0, (64, [1, 2]), True),  # an honest VMM commit: kept
        (True, 4096, (64, [1, 2]), False),  # claims a keep but moved bytes
        (True, 0, (64, [1, 3]), False),  # claims a keep but a pointer moved
        (True, 0, (128, [1, 2]), False),  # claims a keep but the array grew
        (False, 0, (64, [1, 2]), False),
    ],
    ids=["honest", "moved-bytes", "moved-pointer", "new-shape", "declined"],
)
def test_a_step_is_never_kept_across_a_move(model, keeps, moved, after, kept):
    """The negative test: whatever an event claims, the compiled step is invalidated when the
    growth moved bytes or changed what the step bakes in (shape, pointers)."""
    stats = GenerationStats()
    Generator(model)._decide(_event(keeps, moved), (64, [1, 2]), _Cache(*after), 7, stats)
    (d,) = stats.decisions
    assert (d.kept, stats.invalidations) == (kept, int(not kept))
    assert d.token_index == 7 and d.bytes_moved == moved
    if keeps and not kept:
        assert "invalidated" in d.reason


def test_per_row_growth_groups_rows_about_once_per_commit_step():
    """growth_ask (seq-major on VMM, where each row commits its own tokens): rows of different
    lengths that would cross their commit step within one more step grow with the row that must,
    so a mixed batch has about one growth event (a drain of the call in flight) per step, not one
    per row; equal rows ask for their need alone, as before; no row asks past its last."""
    from jax_kv.decode.generator import growth_ask

    step, B, tokens = 16, 64, 256
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 500, B).astype(np.int64)
    last = prompts + tokens + 5

    def events(policy):
        committed = -(-prompts // step) * step
        count = 0
        for t in range(tokens):
            need = np.minimum(prompts + t + 1, last + 1)
            if (need > committed).any():
                ask = policy(need, committed)
                assert (ask >= need).all() and (ask <= last + 1).all()
                committed = np.maximum(committed, -(-ask // step) * step)
                count += 1
            assert (committed >= need).all()
        return count

    grouped = events(lambda need, c: growth_ask(need, c, step, last))
    alone = events(lambda need, c: need)
    assert grouped <= tokens // step + 2 < alone, (grouped, alone)
    equal = np.full(B, 40, np.int64)
    c = np.full(B, 32, np.int64)
    np.testing.assert_array_equal(growth_ask(equal, c, step, equal + 100), equal)
    # a row near its last asks for no more than last + 1; a row that must grow asks its need
    ask = growth_ask(np.array([30, 20]), np.array([32, 16]), step, np.array([40, 33]))
    assert ask.tolist() == [41, 20]
