"""`python -m jax_kv serve` as users start it (issue 22, items 2 and 5): the embedded default
model (SmolLM2-135M-Instruct) answers a chat request through the official client with the
Engine's greedy text, and SIGTERM lets a running stream finish, then exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.parse

import pytest
from conftest import free_port, wait_ready

openai = pytest.importorskip("openai")

ARGS = ["--max-len", "256", "--max-slots", "2", "--prefill-chunk-tokens", "32"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served():
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jax_kv", "serve", "--port", str(port), *ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, 600, alive=lambda: proc.poll() is None)
    except TimeoutError:
        proc.kill()
        raise RuntimeError(f"the server did not start:\n{proc.stdout.read()[-3000:]}") from None
    yield base, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def test_default_model_answers_a_chat_like_the_engine(served):
    import jax_kv.models as jm
    from jax_kv.engine import Engine

    base, _ = served
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=16, temperature=0
    )
    answer = r.choices[0].message.content
    assert "Paris" in answer
    model = jm.default()
    ids = model.encode(model.apply_chat_template(QUESTION))
    with Engine(model, max_slots=2, max_len=256, prefill_chunk_tokens=32) as eng:
        want = eng.submit(ids, 16)
        eng.run_until_idle()
    assert answer == want.result().text
    assert r.usage.prompt_tokens == len(ids)


def test_sigterm_finishes_the_running_stream_and_exits_0(served):
    base, proc = served
    u = urllib.parse.urlsplit(base)
    import http.client

    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 60,
            "temperature": 0, "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(resp.readlines()))
    reader.start()
    proc.send_signal(signal.SIGTERM)
    reader.join(120)
    events = [ln for ln in lines if ln.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]\n"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    resp.close()
    conn.close()
    assert proc.wait(60) == 0
