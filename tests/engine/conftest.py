"""The engine tests' model (a seeded tiny random Llama, f32) and the Generator whose tokens
each request must equal when generated alone."""

import pytest

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.memory import EagerArena

MAX_LEN = 256


@pytest.fixture(scope="module")
def model():
    return jm.random_model("tiny-llama", seed=7)


@pytest.fixture(scope="module")
def generator(model):
    return Generator(model, arena=EagerArena(), max_len=MAX_LEN)
