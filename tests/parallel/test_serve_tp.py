"""`python -m jax_kv serve --tp 2` (issue 28 at the front door): the server starts on a mesh of
2 host devices (the child process's XLA_FLAGS), warms up, and serves a completion of the
requested length; a --tp the model's KV heads do not allow is one error line, exit 2."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("uvicorn")

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
ARGS = ["--random-weights", "tiny-llama", "--max-len", "128", "--max-slots", "2",
        "--prefill-chunk-tokens", "32"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not start:\n{proc.stdout.read()[-3000:]}")


def test_serve_with_tp_2_answers_a_completion():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jax_kv", "serve", "--port", str(port), "--tp", "2", *ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        body = json.dumps(dict(model="random-tiny-llama", prompt=[5, 9, 13, 200], max_tokens=8,
                               temperature=0)).encode()  # fmt: skip
        req = urllib.request.Request(f"{base}/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "tp 2" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_serve_with_a_tp_the_kv_heads_refuse_is_one_error_line():
    r = subprocess.run(
        [sys.executable, "-m", "jax_kv", "serve", "--tp", "4", *ARGS],
        capture_output=True, env=ENV, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: mesh: tp=4 does not divide num_kv_heads=2"), r.stderr[-2000:]
