"""The Generator never loses work or the caller's arrays (issue 19, items 4-6): rows stop at
the length cap with a finish reason and keep what they generated; a prompt that cannot fit is
refused before any compute; a step's latched status raises naming the row, one call late;
bad arguments are refused by name; the caller's params are never modified or deleted."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from reference_loop import greedy_static

import jax_kv.models as jm
from jax_kv.cache import KvCache
from jax_kv.decode import Generator, Sampling
from jax_kv.decode.generator import StepStatusError


@pytest.fixture(scope="module")
def model():
    return jm.random_model("tiny-llama", seed=3)


PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [8, 8, 8, 1, 4, 6, 20, 2, 2]]


@pytest.mark.parametrize("k", [1, 4])
def test_rows_stop_at_max_len_and_keep_their_tokens(model, k):
    max_len = 12
    uncapped = Generator(model, min_bucket=8).generate(PROMPTS, 10, stop_tokens=())
    capped = Generator(model, min_bucket=8, max_len=max_len, tokens_per_call=k).generate(
        PROMPTS, 10, stop_tokens=()
    )
    for b, p in enumerate(PROMPTS):
        n = min(10, max_len - len(p))
        assert capped.tokens[b] == uncapped.tokens[b][:n], f"row {b}"
        assert len(p) + len(capped.tokens[b]) <= max_len
    assert capped.finish_reasons == ["length", "max_new_tokens", "length"]
    assert uncapped.finish_reasons == ["max_new_tokens"] * 3
    assert capped.stats.capacity <= max_len


def test_finish_reason_stop(model):
    free = Generator(model, min_bucket=8).generate(PROMPTS, 6, stop_tokens=())
    stop_at = free.tokens[1][2]
    got = Generator(model, min_bucket=8).generate(PROMPTS, 6, stop_tokens=[stop_at])
    assert got.tokens[1] == free.tokens[1][: free.tokens[1].index(stop_at) + 1]
    assert got.finish_reasons[1] == "stop"


def test_prompt_that_cannot_fit_is_refused_before_compute(model):
    gen = Generator(model, min_bucket=8, max_len=9)
    with pytest.raises(
        ValueError,
        match=r"prompts\[2\]: 9 tokens leave no room for a new token under max_len=9",
    ):
        gen.generate(PROMPTS, 4)
    assert gen._steps == {}, "nothing was compiled or run"
    out = gen.generate(PROMPTS[:2], 5, stop_tokens=())  # the Generator is still usable
    assert out.finish_reasons == ["length", "max_new_tokens"]
    assert [len(t) for t in out.tokens] == [4, 5]


def test_model_maximum_caps_too(model):
    import dataclasses

    small = dataclasses.replace(model, config=model.config.replace(max_position_embeddings=10))
    out = Generator(small, min_bucket=8).generate(PROMPTS[:2], 20, stop_tokens=())
    assert [len(t) for t in out.tokens] == [5, 8]
    assert out.finish_reasons == ["length", "length"]


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_latched_status_raises_naming_the_row(model, monkeypatch, where):
    """A committed capacity below what the loop writes: the ops latch row 1 (NaN, cache
    untouched) and the host raises StepStatusError naming it instead of using its tokens."""
    real = KvCache.committed_tokens

    def short(self):  # prefill: no room at all; decode: none for the next token (at growth)
        c = real(self).copy()
        if where == "prefill":
            c[1] = 1
        elif self.lengths.any():
            c[1] = int(self.lengths[1])
        return c

    monkeypatch.setattr(KvCache, "committed_tokens", short)
    gen = Generator(model, min_bucket=8)
    seen = []
    with pytest.raises(StepStatusError, match=rf"{where}: row 1 was refused .*status 1"):
        gen.generate(PROMPTS, 30, stop_tokens=(), on_tokens=seen.append)
    if where == "decode":
        assert all(row[1] is not None for row in seen)  # only tokens before the refusal
    monkeypatch.undo()
    assert gen.generate(PROMPTS, 3).finish_reasons == ["max_new_tokens"] * 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=2.7), r"max_new_tokens: expected an int >= 1, got 2.7"),
        (dict(max_new_tokens=True), r"max_new_tokens: expected an int >= 1, got True"),
        (dict(max_new_tokens="3"), r"max_new_tokens: expected an int >= 1, got '3'"),
        (dict(max_new_tokens=-1), r"max_new_tokens: expected an int >= 1, got -1"),
        (dict(stop_tokens=[1, 512]), r"stop_tokens: expected token ids in \[0, vocab=512\)"),
        (dict(stop_tokens=[-1]), r"stop_tokens: expected token ids in \[0, vocab=512\), got -1"),
        (dict(stop_tokens=[1.0]), r"stop_tokens: expected token ids .* got 1.0"),
        (dict(stop_tokens="12"), r"stop_tokens: expected an iterable of token ids, got '12'"),
        (dict(stop_tokens=7), r"stop_tokens: expected an iterable of token ids, got 7"),
        (dict(sampling=0.7), r"sampling: expected a jax_kv.Sampling or None, got 0.7"),
    ],
)
def test_generate_refuses_by_name(model, kwargs, match):
    gen = Generator(model, min_bucket=8)
    args = dict(max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        gen.generate(PROMPTS, **args)
    assert gen._steps == {}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens_per_call=0), r"tokens_per_call: expected an int >= 1, got 0"),
        (dict(tokens_per_call=1.5), r"tokens_per_call: expected an int >= 1, got 1.5"),
        (dict(min_bucket=3), r"min_bucket: expected a power of two >= 1, got 3"),
        (dict(min_bucket=0), r"min_bucket: expected an int >= 1, got 0"),
        (dict(max_len=1), r"max_len: expected an int >= 2, got 1"),
        (dict(max_len=8.0), r"max_len: expected an int >= 2, got 8.0"),
    ],
)
def test_generator_refuses_by_name(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Generator(model, **kwargs)


def test_caller_params_are_never_modified_or_deleted(model):
    before = jax.tree_util.tree_leaves(model.params)
    structure = jax.tree_util.tree_structure(model.params)
    gen = Generator(model, min_bucket=8)  # fuse_projections=True: the Generator's own copy
    gen.generate(PROMPTS, 3)
    after = jax.tree_util.tree_leaves(model.params)
    assert jax.tree_util.tree_structure(model.params) == structure
    assert all(a is b for a, b in zip(before, after, strict=True))
    assert not any(leaf.is_deleted() for leaf in after)
    assert "wqkv" in gen.params["layers"][0] and "wqkv" not in model.params["layers"][0]
    want = greedy_static(model.params, model.config, PROMPTS, 3)
    assert gen.generate(PROMPTS, 3, stop_tokens=()).tokens == want


def test_min_bucket_default_comes_from_the_environment():
    """JAX_KV_MIN_BUCKET is read once per process: a child process sees its own value."""
    code = (
        "import jax_kv.models as jm; from jax_kv.decode import Generator; "
        "g = Generator(jm.random_model('tiny-llama', seed=3)); print(g.min_bucket); "
        "print(g.generate([[1, 2]], 2).stats.capacity)"
    )
    env = {"JAX_KV_MIN_BUCKET": "32", "JAX_PLATFORMS": "cpu"}
    import os

    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["32", "32"]


def test_sampling_is_not_mutated(model):
    s = Sampling(temperature=0.5, top_k=4, seed=7)
    a = Generator(model, min_bucket=8).generate(PROMPTS, 5, s)
    b = Generator(model, min_bucket=8).generate(PROMPTS, 5, s)
    assert a.tokens == b.tokens and s.seed == 7
    assert np.all([len(t) == 5 for t in a.tokens])
