"""The engines the server tests serve, built by module-level functions: an EngineProcess's
spawned process unpickles its factory by module and name, so they live in a module of a name
no other test directory has (every directory's `conftest` is a different module)."""

import dataclasses
import time

import jax_kv.models as jm
from jax_kv.engine import Engine
from jax_kv.memory import EagerArena

MODEL_NAME = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class CharTokenizer:
    """Token t < 128 is ASCII character t; t >= 128 the letter 'a' + t % 26."""

    def encode(self, text, add_special_tokens=True):
        return _Encoding([ord(c) if ord(c) < 128 else ord("?") for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(t) if t < 128 else chr(ord("a") + t % 26) for t in ids)


@dataclasses.dataclass
class _Encoding:
    ids: list


def chat_model():
    """The tiny model with the character tokenizer and the chat template (module level: an
    engine's spawned process builds it too, from the factories of the engine-process tests)."""
    m = jm.random_model("tiny-llama", seed=7)
    return dataclasses.replace(m, tokenizer=CharTokenizer(), chat_template=CHAT_TEMPLATE)


def chat_engine(**kw):
    """make_engine on chat_model(): what an EngineProcess of the tests builds."""
    return make_engine(chat_model(), **kw)


def make_engine(model, **kw):
    kw.setdefault("max_slots", 4)
    kw.setdefault("max_len", 256)
    kw.setdefault("prefill_chunk_tokens", 32)
    return Engine(model, arena=EagerArena(), **kw)


def slowed(engine, prefill_s=0.0, decode_s=0.0):
    """The engine with every prefill call and every decode call sleeping first (a warm-up or
    a request long enough to stop, submit or cancel during it); returns it."""
    prefill, decode = engine._run_prefill, engine._run_decode

    def slow_prefill(*args, **kw):
        time.sleep(prefill_s)
        return prefill(*args, **kw)

    def slow_decode(*args, **kw):
        time.sleep(decode_s)
        return decode(*args, **kw)

    engine._run_prefill, engine._run_decode = slow_prefill, slow_decode
    return engine


SLOW_PREFILL_S = 1.5  # per prefill call of engine_slow_warm_up: >= 7 calls, >= 10.5 s in all


def engine_slow_warm_up():
    """Every prefill call sleeps first: a warm-up long enough that a stop during it shows
    whether the engine's process read the pipe between compiles (buckets 16 .. 256)."""
    return slowed(chat_engine(max_slots=2, prefill_chunk_tokens=256), prefill_s=SLOW_PREFILL_S)


def failing_engine():
    raise ValueError("max_slots: expected an int >= 1, got 0 (a build that fails)")


def broken_engine():
    raise RuntimeError("the device is gone")
