"""The OpenAI-compatible server (issue 22) in this process, talked to with the official
`openai` client (sync and streaming, chat and completions) and with raw HTTP for the errors:
the text equals the Engine's for the same greedy request, usage is reported, every bad body
gets a 400 in OpenAI's shape naming the field (404, 413, 401, 429, 503 where they belong),
and a client that closes its stream frees its slot's memory."""

import http.client
import json
import threading
import time
import urllib.parse

import pytest
from conftest import MODEL_NAME, get, make_engine, request, running

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox"


def engine_text(model, prompt_ids, max_tokens):
    with make_engine(model) as eng:
        r = eng.submit(prompt_ids, max_tokens)
        eng.run_until_idle()
        return r.result()


def client(base, key="unused"):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_completions_equal_the_engine(server, tiny_model):
    base, _ = server
    want = engine_text(tiny_model, tiny_model.encode(PROMPT), 12)
    c = client(base)
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 12)
    assert r.usage.total_tokens == len(PROMPT) + 12 and r.model == MODEL_NAME
    chunks = list(
        c.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # Token ids as the prompt: the same answer.
    r2 = c.completions.create(
        model=MODEL_NAME, prompt=tiny_model.encode(PROMPT), max_tokens=12, temperature=0
    )
    assert r2.choices[0].text == want.text


def test_chat_equals_the_engine(server, tiny_model):
    base, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tiny_model.encode(tiny_model.apply_chat_template(messages))
    want = engine_text(tiny_model, ids, 10)
    c = client(base)
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                  temperature=0)  # fmt: skip
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    stream = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                       temperature=0, stream=True)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_seeded_sampling(server):
    base, _ = server
    c = client(base)
    free = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    text = free.choices[0].text
    stop = text[6:9]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                             stop=[stop, "\x00never"])  # fmt: skip
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    a, b = (
        c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0,
                             seed=42).choices[0].text
        for _ in range(2)
    )  # fmt: skip
    assert a == b  # the same seed, the same tokens


def post(base, path, body=None, *, raw=None, headers=None):
    return request("POST", f"{base}{path}", body, raw=raw, headers=headers)


def expect_error(resp, status, param, message):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert message in err["message"], err


def test_bad_bodies_get_openai_errors_naming_the_field(server):
    base, state = server
    ok = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    cases = [
        ({**ok, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
        ({**ok, "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 1"),
        ({**ok, "max_tokens": True}, 400, "max_tokens", "valid integer"),
        ({**ok, "max_tokens": 10**9}, 400, "max_tokens", "exceed the context length 256"),
        ({**ok, "prompt": "x" * 300}, 400, "prompt", "300 tokens leave no room"),
        ({**ok, "temperature": "hot"}, 400, "temperature", "valid number"),
        ({**ok, "temperature": 3}, 400, "temperature", "less than or equal to 2"),
        ({**ok, "top_p": 0}, 400, "top_p", "greater than 0"),
        ({**ok, "n": 2}, 400, "n", "only n=1"),
        ({**ok, "stop": [""]}, 400, "stop.0", "at least 1 character"),
        ({**ok, "prompt": [1, 999]}, 400, "prompt", "token id 999 outside [0, vocab=512)"),
        ({**ok, "prompt": []}, 400, "prompt", "at least one token"),
        ({"prompt": "hi"}, 400, "model", "Field required"),
        ({**ok, "model": "gpt-4"}, 404, "model", "'gpt-4' is not served here"),
    ]
    for body, status, param, message in cases:
        expect_error(post(base, "/v1/completions", body), status, param, message)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    expect_error(post(base, "/v1/chat/completions", {**chat, "messages": []}), 400, "messages",
                 "at least 1 item")  # fmt: skip
    expect_error(post(base, "/v1/chat/completions", {**chat, "messages": [{"role": "x"}]}), 400,
                 "messages.0.role", "")  # fmt: skip
    expect_error(post(base, "/v1/completions", raw=b"{not json"), 400, None, "not valid JSON")
    big = b'{"model": "tiny", "prompt": "' + b"x" * (2 << 20) + b'"}'
    expect_error(post(base, "/v1/completions", raw=big), 413, None, "exceeds 1048576 bytes")
    # Nothing malformed reached the engine, and it still answers.
    assert state.engine.num_running == 0 and state.engine.num_waiting == 0
    assert post(base, "/v1/completions", ok).status_code == 200
    assert get(f"{base}/v1/models").json()["data"][0]["id"] == MODEL_NAME


def test_metrics_and_health(server):
    base, _ = server
    post(base, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    text = get(f"{base}/metrics").text
    for name in (
        "jax_kv_requests_running", "jax_kv_requests_waiting", "jax_kv_kv_committed_bytes",
        "jax_kv_kv_live_bytes", "jax_kv_generation_tokens_per_second",
        "jax_kv_time_to_first_token_seconds_bucket", "jax_kv_inter_token_latency_seconds_bucket",
        "jax_kv_preemptions_total", 'jax_kv_requests_finished_total{finish_reason="length"}',
    ):  # fmt: skip
        assert name in text, name
    assert get(f"{base}/health").json() == {"status": "ok"}


def test_metrics_carry_the_engines_compiles_and_step_times(server):
    base, state = server
    post(base, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    # The request's end reaches the client before its step is counted: wait for the driver
    # to go idle (an idle driver steps no more).
    steps = -1
    while state.engine.stats.steps != steps:
        steps = state.engine.stats.steps
        time.sleep(0.3)
    values = {}
    for line in get(f"{base}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if value and not name.startswith("#") else None
    s = state.engine.stats
    assert s.steps == steps
    assert values["jax_kv_decode_compiles_total"] == s.decode_compiles == 1
    assert values["jax_kv_picker_compiles_total"] == s.sampler_compiles == 2
    assert values["jax_kv_prefill_compiles_total"] == s.prefill_compiles >= 1
    assert values["jax_kv_engine_steps_total"] == s.steps > 0
    step_s, host_s = (
        values["jax_kv_engine_step_seconds_total"],
        values["jax_kv_engine_host_seconds_total"],
    )
    assert 0 < host_s <= step_s
    parts = [values[f"jax_kv_engine_{p}_seconds_total"] for p in ("dispatch", "beside", "wait")]
    assert parts == [s.dispatch_seconds, s.beside_seconds, s.wait_seconds]
    assert all(p > 0 for p in parts)
    # A call's three parts are its time: the step's time less what lay outside the calls.
    assert sum(parts) == pytest.approx(step_s - host_s, rel=1e-6, abs=1e-6)
    # The deliveries (listeners: the event loop's wake-ups) ran beside calls or after them.
    deliver_s = values["jax_kv_engine_deliver_seconds_total"]
    assert deliver_s == s.deliver_seconds and 0 < deliver_s <= s.beside_seconds + host_s


def test_a_closed_stream_frees_its_slot(server):
    base, state = server
    eng = state.engine
    before = eng.stats.finished.get("cancelled", 0)
    # The tiny model makes a token in about a millisecond: unpaced, a loaded machine's client
    # read its first lines after all 200 tokens were made (the request ended by length, CI,
    # 2026-12-06). 20 ms a step gives the close 4 s before the request could end by itself.
    step = eng._step  # what the background driver calls
    eng._step = lambda **kw: (time.sleep(0.02), step(**kw))[1]
    try:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "stream": True}
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        first = resp.readline()
        assert first.startswith(b"data: ")
        resp.readline()
        resp.readline()
        assert eng.cache.held_bytes > 0
        conn.sock.shutdown(2)  # the client goes away mid-stream
        conn.close()
        deadline = time.monotonic() + 5
        # All three, polled together: the engine's thread counts the ending after it released
        # the slot, and a release that uploads the slots' bounds lets this thread run between.
        while time.monotonic() < deadline and (
            eng.cache.held_bytes
            or eng.num_running
            or eng.stats.finished.get("cancelled", 0) == before
        ):
            time.sleep(0.01)
    finally:
        eng._step = step
    assert eng.cache.held_bytes == 0 and eng.num_running == 0
    assert eng.stats.finished.get("cancelled", 0) == before + 1


def test_api_key(tiny_model):
    from jax_kv.server import create_app

    engine = make_engine(tiny_model, max_slots=1)
    with running(create_app(engine, model_name=MODEL_NAME, api_key="sekrit")) as base:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = post(base, "/v1/completions", body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert get(f"{base}/v1/models").status_code == 401
        r = client(base, key="sekrit").completions.create(model=MODEL_NAME, prompt="hi",
                                                          max_tokens=2)  # fmt: skip
        assert r.usage.completion_tokens == 2
    engine.close()


def test_queue_full_is_429_and_draining_is_503(tiny_model):
    from jax_kv.server import create_app

    engine = make_engine(tiny_model, max_slots=1, max_queue=2)
    app = create_app(engine, model_name=MODEL_NAME)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3}
    with running(app) as base:
        gate = threading.Event()
        step = engine._step  # what the background driver calls
        engine._step = lambda **kw: (gate.wait(), step(**kw))[1]  # hold it between steps
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(post(base, "/v1/completions", body)))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 5
            while engine.num_waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = post(base, "/v1/completions", body)
        finally:
            gate.set()  # a failed assert below must not leave the engine held
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r
        assert r.json()["error"]["type"] == "rate_limit_error"
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200, 200]
        app.state.jax_kv.draining = True
        r = post(base, "/v1/completions", body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert get(f"{base}/health").status_code == 503
        app.state.jax_kv.draining = False
    engine.close()


def test_metrics_count_prefix_hits_on_a_vmm_arena(tiny_model):
    """With the prefix cache (the host driver's VmmArena), a repeated prompt is a hit."""
    from jax_kv.engine import Engine
    from jax_kv.memory import host_arena
    from jax_kv.server import create_app

    arena = host_arena(reserve_bytes=1 << 30, granule=16 * 512)
    engine = Engine(tiny_model, arena=arena, max_slots=2, max_len=256, prefill_chunk_tokens=32)
    body = {"model": MODEL_NAME, "prompt": "x" * 40, "max_tokens": 2, "temperature": 0}
    with running(create_app(engine, model_name=MODEL_NAME)) as base:
        first = post(base, "/v1/completions", body).json()["choices"][0]["text"]
        again = post(base, "/v1/completions", body).json()["choices"][0]["text"]
        text = get(f"{base}/metrics").text
    engine.close()
    arena.close()
    assert first == again
    hits = [ln for ln in text.splitlines() if ln.startswith("jax_kv_prefix_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) >= 32, hits


def test_a_failed_warm_up_is_reported(tiny_model):
    """A warm-up that raises (a compile out of memory, say) is not left to its thread: /health
    says "failed" with the error, every request gets a 500 naming it, and the server is told to
    stop (python -m jax_kv serve then exits 1). It used to answer "warming up" for ever."""
    from jax_kv.server import create_app

    engine = make_engine(tiny_model)

    def broken():
        raise RuntimeError("injected: out of memory while compiling")

    engine.warm_up = broken
    app = create_app(engine, model_name=MODEL_NAME)
    stopped = threading.Event()
    app.state.jax_kv.on_failure = stopped.set
    try:
        with running(app, ready=False) as base:
            assert stopped.wait(10)
            r = get(f"{base}/health")
            assert r.status_code == 500 and r.json()["status"] == "failed", r.text
            assert "injected" in r.json()["error"]
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
            r = request("POST", f"{base}/v1/completions", body)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed", r.text
    finally:
        engine.close()


def test_a_server_stopped_while_it_warms_up_starts_no_driver(tiny_model):
    """SIGTERM while the engine compiles: the lifespan's exit shuts the engine down and waits
    for the warm-up thread, which then starts no driver (Engine.start refuses after shutdown);
    the caller's engine.close() has the engine to itself."""
    from jax_kv.server import create_app

    engine = make_engine(tiny_model)
    compiling = threading.Event()
    engine.warm_up = lambda: compiling.wait(30)  # the compiles, still under way
    app = create_app(engine, model_name=MODEL_NAME)
    try:
        with running(app, ready=False) as base:
            assert get(f"{base}/health").json()["status"] == "warming up"
            threading.Timer(0.3, compiling.set).start()  # they finish after the stop began
        state = app.state.jax_kv
        assert not state._warming.is_alive() and engine._thread is None  # no driver started
        assert state.failure is None and not state.ready.is_set()
    finally:
        compiling.set()
        engine.close()


def test_a_model_without_a_tokenizer_streams_an_event_per_token_batch():
    """Random weights have no tokenizer (prompts as token ids, no text): the stream still
    carries the tokens as empty-text events before the finish chunk, as many as the tokens at
    most, so a client sees progress and a benchmark times them."""
    import jax_kv.models as jm
    from jax_kv.server import create_app

    model = jm.random_model("tiny-llama", seed=7)
    assert model.tokenizer is None
    engine = make_engine(model, max_slots=1)
    with running(create_app(engine, model_name=MODEL_NAME)) as base:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        r = post(base, "/v1/completions", body)
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        choices = [c for e in events for c in e["choices"]]
        tokens = [c for c in choices if not c["finish_reason"]]
        assert tokens and all(c["text"] == "" for c in tokens)
        assert len(tokens) <= 12 and choices[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 12
    engine.close()
