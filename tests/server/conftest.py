"""A server in this process, on a free port, over an Engine of a small random model with a
one-character-per-token tokenizer and a chat template (fast to compile on CPU)."""

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
import urllib.parse

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import jax_kv.models as jm  # noqa: E402
from jax_kv.engine import Engine  # noqa: E402
from jax_kv.memory import EagerArena  # noqa: E402

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


@pytest.fixture(scope="session")
def tiny_model():
    return chat_model()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Resp:
    status_code: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def request(method, url, body=None, *, raw=None, headers=None, timeout=30) -> Resp:
    """Raw HTTP with the standard library (the tests need no HTTP client of their own)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, u.path, body=data, headers=hdrs)
        r = conn.getresponse()
        return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode())
    finally:
        conn.close()


def get(url, **kw) -> Resp:
    return request("GET", url, **kw)


def wait_ready(base: str, timeout: float, alive=lambda: True, any_answer=False) -> None:
    """Waits until GET /health answers 200 (the engine is warmed up), or with any_answer until
    it answers at all."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get(f"{base}/health", timeout=1).status_code == 200 or any_answer:
                return
        except OSError:
            pass
        if not alive() or time.monotonic() > deadline:
            raise TimeoutError(f"{base}: the server did not become ready")
        time.sleep(0.05)


@contextlib.contextmanager
def running(app, ready=True):
    """Serves `app` with uvicorn on a thread; yields the base URL once /health is 200 (with
    ready=False: once it answers at all)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, 120, any_answer=not ready)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(60)


def make_engine(model, **kw):
    kw.setdefault("max_slots", 4)
    kw.setdefault("max_len", 256)
    kw.setdefault("prefill_chunk_tokens", 32)
    return Engine(model, arena=EagerArena(), **kw)


@pytest.fixture(scope="module")
def server(tiny_model):
    """(base URL, app state) of a server with default settings."""
    from jax_kv.server import create_app

    engine = make_engine(tiny_model)
    app = create_app(engine, model_name=MODEL_NAME)
    with running(app) as base:
        yield base, app.state.jax_kv
    engine.close()
