"""Python code in a fresh process: how tests check what is read once per process (the
JAX_KV_* runtime config, frozen at first use)."""

import os
import subprocess
import sys
import textwrap


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` in a new interpreter with no JAX_KV_* variable but those in `env`, on the
    CPU unless `env` says otherwise; returns the finished process (stdout, stderr as text)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_KV_")}
    clean.update(env)
    clean.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )
