"""Text of a request (issue 21, item 1): stop strings found across token boundaries and cut
from the text, text that could still become a stop string held back from the stream, an
incomplete UTF-8 character held until its last byte arrives, and the streamed deltas adding
up to the final text."""

import dataclasses

import pytest

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.engine import FINISH_LENGTH, FINISH_STOP, Engine, TextStream
from jax_kv.memory import EagerArena


class ByteTokenizer:
    """Token t < 128 is ASCII byte t, t >= 128 the letter 'a' + t % 26 (one character per
    token), except t = 300 and 301: the two bytes of 'é' (0xC3, 0xA9); decoding replaces an
    incomplete sequence with U+FFFD."""

    BYTES = {300: b"\xc3", 301: b"\xa9"}

    def decode(self, ids, skip_special_tokens=False):
        data = b"".join(
            self.BYTES.get(t, bytes([t if t < 128 else ord("a") + t % 26])) for t in ids
        )
        return data.decode("utf-8", errors="replace")

    def encode(self, text, add_special_tokens=True):
        raise NotImplementedError


def stream_all(stream, ids):
    return [stream.push(t) for t in ids], stream.finish()


def decode(ids):
    return ByteTokenizer().decode(ids)


def test_stop_string_across_tokens_is_cut_and_held_back():
    ids = [ord(c) for c in "hello STOP world"]
    s = TextStream(decode, ["STOP"])
    deltas, rest = stream_all(s, ids)
    assert s.stopped and s.released == "hello " and rest == ""
    assert "".join(deltas) == "hello "  # nothing of "STO" went out before the P came
    assert [len(d) for d in deltas[:4]] == [0, 0, 0, 1]  # three characters held back


def test_a_near_miss_is_released_at_the_end():
    s = TextStream(decode, ["STOP"])
    deltas, rest = stream_all(s, [ord(c) for c in "ab STO"])
    assert not s.stopped
    assert "".join(deltas) == "ab " and rest == "STO"
    assert s.released == "ab STO"


def test_the_earliest_of_several_stop_strings_wins():
    s = TextStream(decode, ["world", "lo w"])
    stream_all(s, [ord(c) for c in "hello world"])
    assert s.released == "hel"


def test_an_incomplete_character_waits_for_its_last_byte():
    s = TextStream(decode, [])
    assert s.push(ord("a")) == "a"
    assert s.push(300) == ""  # 0xC3 alone: U+FFFD, held
    assert s.push(301) == "é"
    assert s.push(ord("b")) == "b"
    assert s.released == "aéb"


@pytest.fixture(scope="module")
def model():
    m = jm.random_model("tiny-llama", seed=7)
    return dataclasses.replace(m, tokenizer=ByteTokenizer())


def test_engine_stops_at_a_string_spanning_tokens(model):
    prompt = [5, 17, 99, 3, 250, 41]
    free = (
        Generator(model, arena=EagerArena(), max_len=128)
        .generate([prompt], 24, stop_tokens=[])
        .tokens[0]
    )
    assert not {300, 301} & set(free)  # one character per token
    text = decode(free)
    assert len(text) == len(free)
    stop = text[5:8]  # three characters: three tokens
    assert len(stop) == 3
    with Engine(model, max_slots=2, max_len=128, arena=EagerArena()) as eng:
        stopped = eng.submit(prompt, 24, stop=stop, stop_token_ids=[])
        plain = eng.submit(prompt, 24, stop_token_ids=[])
        eng.run_until_idle()
    c = stopped.result()
    cut = text.find(stop)
    assert c.finish_reason == FINISH_STOP
    assert c.text == text[:cut]
    assert c.tokens == free[: cut + 3]  # one character per token: through the stop string
    p = plain.result()
    assert p.finish_reason == FINISH_LENGTH and p.tokens == free and p.text == text
    assert "".join(d.text for d in stopped) == c.text
    assert "".join(d.text for d in plain) == p.text
