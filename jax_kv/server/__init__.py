"""`python -m jax_kv serve`: an OpenAI-compatible HTTP server on the Engine (Starlette on
uvicorn, pydantic bodies, Prometheus metrics; the `serve` extra)."""

from jax_kv.server.app import create_app
from jax_kv.server.protocol import APIError

__all__ = ["APIError", "create_app", "run"]


def run(*args, **kwargs):
    from jax_kv.server.main import run as _run

    return _run(*args, **kwargs)
