"""Runs the server: an Engine (in its own process by default), the app, uvicorn; SIGTERM
drains and exits 0."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from jax_kv.engine import Engine
from jax_kv.server.app import DRAIN_TIMEOUT_S, create_app
from jax_kv.server.engine_process import EngineProcess


class _Server(uvicorn.Server):
    """uvicorn's server, but a stop signal first marks the app draining: a request that
    still arrives on an open connection gets 503 while the running ones finish."""

    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self.jax_kv_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.jax_kv_state.draining = True
        super().handle_exit(sig, frame)


def run(
    make_engine: Callable[[], Engine],
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    engine_process: bool = True,
    tp: int = 1,
) -> int:
    """Serves the Engine `make_engine()` builds (a picklable callable: engine_process.
    build_engine with its arguments bound). engine_process: build and run it in a process of
    its own (EngineProcess), so the event loop and the engine's driver do not share a GIL;
    False runs it on a thread of this process. tp: the KV heads' devices, for the banner."""
    engine: Any = EngineProcess(make_engine) if engine_process else make_engine()
    app = create_app(engine, model_name=model_name, api_key=api_key)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S),
    )  # fmt: skip
    server = _Server(config, app.state.jax_kv)
    state = app.state.jax_kv
    state.on_failure = lambda: setattr(server, "should_exit", True)  # exit 1, below
    where = "in its own process" if engine_process else "on a thread of this process"
    print(
        f"jax_kv: serving {model_name!r} on http://{host}:{port}/v1 ({engine.max_slots} slots, "
        f"max_len {engine.max_len}, tp {tp}, the engine {where}); /health answers 200 once "
        "warmed up",
        file=sys.stderr,
    )
    # uvicorn re-raises the stop signal to the handler it found once its graceful shutdown
    # is done (so a default handler would kill the process with it); a drained SIGTERM is a
    # normal exit here, status 0.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        engine.close()
    return 1 if state.failure is not None else 0
