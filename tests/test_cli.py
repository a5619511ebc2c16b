"""python -m jax_kv: generate with the default model (streamed text, then the stats table;
or one JSON object) and the ops demo, each in its own process as a user runs them."""

import json
import os
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.run(
        [sys.executable, "-m", "jax_kv", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_generate_json():
    p = run("generate", "--max-new-tokens", "6", "--min-bucket", "8", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["text"].startswith(" Paris"), r["text"]
    assert len(r["tokens"]) == 6
    s = r["stats"]
    assert s["growth_events"] == 1 and s["decisions"][0]["kept"] is False  # eager on CPU
    assert s["captures"] == 2 and s["invalidations"] == 1
    if "finish_reasons" in r:  # GenerationResult.finish_reasons, where the library has it
        assert r["finish_reasons"] == ["max_new_tokens"]


def test_generate_streams_then_prints_stats():
    p = run(
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "3",
        "--layout",
        "head-major",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("The capital of France is Paris")
    for field in ("layout / arena", "HEAD_MAJOR / eager", "compiled steps", "KV memory"):
        assert field in p.stdout


@pytest.mark.parametrize(
    "args, match",
    [
        (("generate", "--layout", "diagonal"), "error: --layout: invalid choice: 'diagonal'"),
        (
            ("generate", "--model", "/nonexistent/model.gguf"),
            "error: --model: /nonexistent/model.gguf: no such file or directory",
        ),
        (
            ("generate", "--max-new-tokens", "0"),
            "error: --max-new-tokens: expected an int >= 1, got '0'",
        ),
    ],
)
def test_generate_bad_arguments(args, match):
    """One line on stderr, exit 2 (tests/test_cli_errors.py has the full list)."""
    p = run(*args)
    assert p.returncode == 2 and p.stderr.startswith(match) and p.stderr.count("\n") == 1
    assert "Traceback" not in p.stderr


def test_demo():
    p = run("demo", "--steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "max |head-major - seq-major| = 0.00e+00" in p.stdout
