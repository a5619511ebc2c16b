"""An Engine whose cache lives on a device other than JAX's first (EagerArena(device=...)):
its per-step inputs (StepInputs) are committed to that device too, so every compiled call
sees one device, and its tokens equal the Generator's there. Needs several devices (the
suite runs with XLA_FLAGS=--xla_force_host_platform_device_count=4)."""

import jax
import pytest

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.engine import Engine
from jax_kv.memory import EagerArena

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two devices")


def test_an_engine_on_the_second_device_keeps_its_inputs_there():
    d = jax.devices()[1]
    with jax.default_device(d):
        model = jm.random_model("tiny-llama", seed=7)
        eng = Engine(model, arena=EagerArena(device=d), max_slots=2, max_len=64)
        try:
            prompts = [[5, 6, 7, 8], [9, 10]]
            reqs = [eng.submit(p, 6, stop_token_ids=[]) for p in prompts]
            eng.run_until_idle()
            assert eng._inputs["lengths"].devices() == {d} == eng.cache.k[0].devices()
            gen = Generator(model, arena=EagerArena(device=d), max_len=64)
            for p, r in zip(prompts, reqs, strict=True):
                assert r.result().tokens == list(gen.generate([p], 6, stop_tokens=[]).tokens[0])
            assert eng.stats.decode_compiles == 1
        finally:
            eng.close()
