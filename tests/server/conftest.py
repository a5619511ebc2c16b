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

from engine_factories import (  # noqa: E402, F401 - the server tests import them from here
    CHAT_TEMPLATE,
    MODEL_NAME,
    CharTokenizer,
    chat_model,
    make_engine,
)


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


@pytest.fixture(scope="module")
def server(tiny_model):
    """(base URL, app state) of a server with default settings."""
    from jax_kv.server import create_app

    engine = make_engine(tiny_model)
    app = create_app(engine, model_name=MODEL_NAME)
    with running(app) as base:
        yield base, app.state.jax_kv
    engine.close()
