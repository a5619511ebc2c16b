"""Issue 21, item 6: why the Engine's bf16 tokens part from Generator's alone.

With trained weights (the default model, SmolLM2-135M-Instruct, in bf16) on this CPU the Engine
computes what the Generator computes at the same batching, token for token: a 1-slot Engine
equals Generator on each prompt alone, and an N-slot Engine equals Generator on the same N
prompts at once. What parts them is the batching itself: Generator on N prompts at once parts
from Generator on each alone (`bench/experiments/bf16_agreement.py`, 30 chat prompts, 32
tokens: Generator x16 against alone 20 of 30 equal; the Engine x16 the same 20, differing at
the same tokens; Engine x1 against Generator alone and Engine x16 against Generator x16 30 of 30).
A row's sums run in another order in a GEMM of M = 1 than of M = 16, and one bf16 rounding
apart at some layer flips a close pair of logits later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_kv.models as jm
from jax_kv import Engine, Generator

N_NEW = 24
MAX_LEN = 512
# Two prompts whose tokens in a batch of 2 part from their tokens alone (at tokens 5 and 2 of
# 24 on the CPU they were chosen on; not on every CPU): the equalities below then say
# something a batching slip would break.
TEXTS = ["Write a short story about volcanoes.", "Write a short story about a chess game."]

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="CPU: XLA's GPU GEMMs pick kernels by shape, so the engine's packed prefill (M = "
    "the chunk's tokens) and the Generator's padded one (M = B x padded length) round apart",
)


@pytest.fixture(scope="module")
def bf16_model():
    return jm.default(jnp.bfloat16, progress=False)


@pytest.fixture(scope="module")
def chat_prompts(bf16_model):
    m = bf16_model
    return [m.encode(m.apply_chat_template([{"role": "user", "content": t}])) for t in TEXTS]


def engine_tokens(model, prompts, slots):
    with Engine(model, max_slots=slots, max_len=MAX_LEN, prefill_chunk_tokens=256) as eng:
        reqs = [eng.submit(p, N_NEW, stop_token_ids=[]) for p in prompts]
        eng.run_until_idle()
        return [r.result().tokens for r in reqs]


def generator_tokens(model, prompts, batch):
    gen = Generator(model, max_len=MAX_LEN)
    out = []
    for i in range(0, len(prompts), batch):
        out += gen.generate(prompts[i : i + batch], N_NEW, stop_tokens=[]).tokens
    return out


@pytest.fixture(scope="module")
def generator_alone(bf16_model, chat_prompts):
    return generator_tokens(bf16_model, chat_prompts, batch=1)


def test_bf16_engine_with_one_slot_equals_generator_alone(
    bf16_model, chat_prompts, generator_alone
):
    got = engine_tokens(bf16_model, chat_prompts, slots=1)
    assert all(len(t) == N_NEW for t in got)
    assert got == generator_alone


def test_bf16_engine_with_all_prompts_at_once_equals_generator_on_the_batch(
    bf16_model, chat_prompts, generator_alone
):
    n = len(chat_prompts)
    got = engine_tokens(bf16_model, chat_prompts, slots=n)
    want = generator_tokens(bf16_model, chat_prompts, batch=n)
    assert all(len(t) == N_NEW for t in got)
    assert got == want
    # Batching moved these prompts' tokens on the CPU they were chosen on; on an AMD EPYC with
    # AVX2 and no AVX-512 (CI, 2026-12-08) XLA's CPU kernels computed the batch of 2 as each
    # alone, so the equality above held without telling the batchings apart: say so, not pass.
    if want == generator_alone:
        pytest.skip("this CPU computes these prompts batched as alone: the Engine equals the "
                    "Generator, but batching moved no token to tell it by")  # fmt: skip


def test_steps_compile_with_the_step_compiler_options(monkeypatch):
    """Every step the Engine and the Generator compile (and the Engine's token pickers) takes
    jax_kv.config.step_compiler_options(): with XLA free to skip a fusion's bf16 roundings,
    the H100 gave a 1-slot Engine the Generator's tokens in 27 of 48 requests, 47 without
    (bench/NOTES.md, fourteenth session)."""
    from jax_kv.config import step_compiler_options

    real, seen = jax.jit, {}

    def jit(fun, **kwargs):
        seen[fun.__qualname__] = kwargs.get("compiler_options")
        return real(fun, **kwargs)

    monkeypatch.setattr(jax, "jit", jit)
    model = jm.random_model("tiny-llama", seed=0, dtype=jnp.float32)
    for k in (1, 2):  # Engine(decode_steps=2): the decode call's own program
        with Engine(model, max_slots=2, max_len=64, prefill_chunk_tokens=16, decode_steps=k) as eng:
            eng.submit([1, 2, 3], 4, stop_token_ids=[])
            eng.run_until_idle()
    Generator(model, max_len=64).generate([[1, 2, 3]], 2, stop_tokens=[])
    steps = {
        name: options
        for name, options in seen.items()
        if name.split(".<locals>")[0].split(".")[-1]
        in ("_prefill_fn", "_decode_fn", "_greedy_fn", "_sampler_fn", "_decode_steps_fn", "_call")
    }
    owners = {name.split(".<locals>")[0] for name in steps}
    assert {"Engine._prefill_fn", "Engine._decode_fn", "Engine._greedy_fn", "Engine._sampler_fn",
            "Engine._decode_steps_fn", "Generator._call"} <= owners, seen  # fmt: skip
    assert all(options == step_compiler_options() for options in steps.values()), steps
