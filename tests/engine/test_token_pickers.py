"""The Engine's tokens are picked from a call's logits by a second compiled function chosen on
the host: argmax where every row of the call is greedy, the sampler where one samples. The
compiled steps hold no conditional: outside a CUDA graph XLA runs a `lax.cond` by copying its
predicate to the host and blocking the dispatching thread until the device reaches it (the
whole forward pass), which would leave nothing for the work meant to run beside the call. The
steps hold no loop either: a while loop runs outside the graph too (a host launch per
iteration, the graph cut around it)."""

import re

import numpy as np

from jax_kv import Sampling
from jax_kv.decode import Generator
from jax_kv.engine import Engine
from jax_kv.memory import EagerArena

CONDITIONAL = re.compile(r"stablehlo\.(case|if)\b|\bconditional\(")
LOOP = re.compile(r"stablehlo\.while\b")


def small_engine(model, **kw):
    kw.setdefault("max_slots", 4)
    kw.setdefault("max_len", 64)
    kw.setdefault("prefill_chunk_tokens", 16)
    return Engine(model, arena=EagerArena(), **kw)


def test_the_compiled_steps_and_pickers_hold_no_conditional(model):
    """Those of every row and those of a decode row bucket (Engine(decode_row_buckets): the
    step, argmax and sampler on 2 of the 4 rows, given their row index)."""
    eng = small_engine(model, decode_row_buckets=True)  # buckets 1, 2, 4
    try:
        inputs, caches = eng._inputs, eng._caches()
        lowered = {
            "decode": eng._decode.lower(
                eng.params,
                inputs["tokens"],
                caches,
                inputs["lengths"],
                inputs["bound"],
                inputs["status"],
            ),
            "prefill": eng._prefill.lower(
                eng.params,
                inputs["prefill_tokens_16"],
                inputs["cu_seqlens"],
                caches,
                inputs["lengths"],
                eng.cache.committed,
                inputs["tokens"],
                inputs["bound"],
            ),
        }
        logits = np.zeros((eng.max_slots, model.config.vocab_size), np.float32)
        sampling = eng._sampling_args()  # may rewrite the inputs: before taking them
        positions, tokens = inputs["lengths"], inputs["tokens"]
        status = np.zeros((eng.max_slots,), np.int32)
        lowered["argmax"] = eng._greedy.lower(logits, status, tokens)
        lowered["sampler"] = eng._sampler.lower(logits, positions, *sampling, status, tokens)
        rows = inputs["decode_rows_2"]
        lowered["decode on 2 rows"] = eng._decode.lower(
            eng.params, inputs["tokens"], caches, inputs["lengths"], inputs["bound"],
            inputs["status"], rows,
        )  # fmt: skip
        lowered["argmax on 2 rows"] = eng._greedy.lower(logits[:2], status, tokens, rows)
        lowered["sampler on 2 rows"] = eng._sampler.lower(
            logits[:2], positions, *sampling, status, tokens, rows
        )
        for name, low in lowered.items():
            text = low.as_text()
            assert "stablehlo" in text or "HloModule" in text  # the pattern reads this text
            assert not CONDITIONAL.search(text), f"{name}: holds a conditional"
            if name.startswith(("decode", "prefill")):
                assert not LOOP.search(text), f"{name}: holds a while loop"
    finally:
        eng.close()


def test_a_call_samples_only_where_one_of_its_rows_samples(model, rng):
    vocab = model.config.vocab_size
    p, q, r = (rng.integers(3, vocab, n).tolist() for n in (9, 14, 5))
    hot = Sampling(temperature=1.3, top_k=20, top_p=0.9, seed=11)
    solo = small_engine(model)
    try:
        alone = solo.submit(p, 12, hot, stop_token_ids=[])
        solo.run_until_idle()
    finally:
        solo.close()

    eng = small_engine(model)
    try:
        eng.warm_up()
        assert eng.stats.sampler_compiles == 2  # argmax and the sampler, both in warm_up
        picked: list[str] = []

        def counting(name, fn):
            def run(*a):
                picked.append(name)
                return fn(*a)

            return run

        eng._greedy = counting("argmax", eng._greedy)
        eng._sampler = counting("sampler", eng._sampler)
        greedy_first = eng.submit(q, 6, stop_token_ids=[])
        eng.run_until_idle()
        assert set(picked) == {"argmax"}  # no row samples: no sort, no draw
        picked.clear()
        beside = eng.submit(q, 20, stop_token_ids=[])
        eng.step()
        sampled = eng.submit(p, 12, hot, stop_token_ids=[])
        greedy_last = eng.submit(r, 3, stop_token_ids=[])
        eng.run_until_idle()
        # The sampler runs exactly in the calls where the sampled request takes part.
        assert picked.count("sampler") >= 12 and "argmax" in picked
        assert eng.stats.sampler_compiles == 2  # none after warm_up
    finally:
        eng.close()
    assert sampled.result().tokens == alone.result().tokens
    gen = Generator(model, arena=EagerArena(), max_len=64)
    for req, prompt, n in ((greedy_first, q, 6), (beside, q, 20), (greedy_last, r, 3)):
        want = gen.generate([prompt], n, stop_tokens=()).tokens[0]
        assert req.result().tokens == list(want), "a greedy row beside a sampled one"


def test_pieces_short_of_the_prompts_end_take_the_argmax(model, rng):
    """A sampled request's pieces before its prompt's last one produce no token: their calls
    skip the sampler's sort; its last piece and its decode steps sample."""
    eng = small_engine(model)  # chunk 16
    try:
        eng.warm_up()
        picked: list[str] = []
        greedy, sampler = eng._greedy, eng._sampler
        eng._greedy = lambda *a: (picked.append("argmax"), greedy(*a))[1]
        eng._sampler = lambda *a: (picked.append("sampler"), sampler(*a))[1]
        prompt = rng.integers(3, model.config.vocab_size, 40).tolist()  # pieces 16, 16, 8
        req = eng.submit(prompt, 3, Sampling(temperature=1.0, seed=3), stop_token_ids=[])
        eng.run_until_idle()
        assert picked == ["argmax", "argmax", "sampler", "sampler", "sampler"]
        assert len(req.result().tokens) == 3
    finally:
        eng.close()


def test_a_write_of_the_inputs_between_a_decode_step_and_its_sampler(model):
    """The decode step returns its status in a donated input (a StepInputs field); a write of
    the inputs between the step and its picker (the sampler's parameters, when a row's
    changed) donates that field too. The picker must read the field as the write returned it,
    not the step's output: forced here before every call ahead, the sampled run completes and
    equals the run without the forced writes."""
    runs = []
    for force in (False, True):
        eng = small_engine(model, max_slots=2, prefix_cache=False)
        real = eng._dispatch_next

        def dispatch_next(call, eng=eng, real=real, force=force):
            eng._sampling_dirty = eng._sampling_dirty or force  # as if a row's sampling changed
            return real(call)

        eng._dispatch_next = dispatch_next
        try:
            req = eng.submit([5, 6, 7, 8], 10, Sampling(0.8, seed=1), stop_token_ids=[])
            eng.run_until_idle()
            runs.append(req.result().tokens)
            assert eng.stats.calls_ahead > 0
        finally:
            eng.close()
    assert runs[0] == runs[1] and len(runs[0]) == 10
