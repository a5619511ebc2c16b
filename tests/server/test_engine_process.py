"""The Engine in its own process (jax_kv.server.engine_process): the same tokens, text and
refusals as the Engine in this process, cancellation that frees memory, and no request lost
when the engine's process dies. The engines are built in spawned processes from the module-
level factories below (what a spawned process can import)."""

import functools
import json
import os
import signal
import threading
import time

import pytest
from conftest import request, running
from engine_factories import (
    MODEL_NAME,
    SLOW_PREFILL_S,
    broken_engine,
    chat_engine,
    engine_slow_warm_up,
    failing_engine,
)

from jax_kv.decode.sampling import Sampling
from jax_kv.engine import FINISH_CANCELLED, FINISH_ERROR, EngineError, QueueFull
from jax_kv.server.engine_process import EngineProcess

tiny_engine = chat_engine


@pytest.fixture(scope="module")
def remote():
    with EngineProcess(tiny_engine) as ep:
        ep.warm_up()
        yield ep


PROMPTS = ["Hello", "The quick brown fox", "a", "Once upon a time, far away"]


def test_tokens_and_text_equal_the_engine_in_this_process(remote):
    """Greedy and seeded sampling, text with a stop string: every request's completion
    equals the in-process Engine's for the same arguments."""
    jobs = [dict(prompt=p, max_new_tokens=12) for p in PROMPTS]
    jobs.append(dict(prompt="Hello", max_new_tokens=12, sampling=Sampling(0.8, top_k=20, seed=3)))
    jobs.append(dict(prompt=[65, 66, 67], max_new_tokens=9, stop="e"))
    got = [remote.submit(**j) for j in jobs]
    with tiny_engine() as local:
        want = [local.submit(**j) for j in jobs]
        local.run_until_idle()
    for g, w in zip(got, want, strict=True):
        a, b = g.result(60), w.result()
        assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
        assert a.tokens  # a test of empty completions would pass whatever the engine did
    streamed = list(got[0])
    assert [d.token for d in streamed] == want[0].result().tokens
    assert "".join(d.text for d in streamed) == want[0].result().text


def test_refusals_are_raised_at_submit_as_the_engine_raises_them(remote):
    with pytest.raises(ValueError, match=r"exceeds max_len=256"):
        remote.submit([1] * 250, 10)
    with pytest.raises(ValueError, match=r"prompt: token id 100000 outside \[0, vocab="):
        remote.submit([100000], 4)
    with pytest.raises(ValueError, match=r"max_new_tokens"):
        remote.submit([1, 2], 0)


def test_a_full_queue_is_refused_with_queue_full():
    """max_queue=2: submits beyond what the engine may hold waiting are QueueFull at once
    (counted here: the engine has not received them yet)."""
    with EngineProcess(functools.partial(tiny_engine, max_slots=1, max_queue=2)) as ep:
        held = []
        with pytest.raises(QueueFull, match=r"max_queue=2"):
            for _ in range(10):
                held.append(ep.submit([1, 2, 3], 30))
        assert 2 <= len(held) < 10
        assert all(r.result(60).completion_tokens == 30 for r in held)


def test_cancel_ends_the_request_and_frees_its_memory(remote):
    before = remote.snapshot().kv["held"]
    r = remote.submit([5] * 40, 200)
    deadline = time.monotonic() + 60
    while r.streamed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert remote.snapshot().kv["held"] > before
    r.cancel()
    assert r.result(60).finish_reason == FINISH_CANCELLED
    deadline = time.monotonic() + 60
    while remote.snapshot().kv["held"] != before:  # reported after the step that freed it
        assert time.monotonic() < deadline, remote.snapshot().kv
        time.sleep(0.01)


def test_a_build_that_fails_raises_its_error():
    """A bad argument as itself, any other error as EngineError naming it."""
    with pytest.raises(ValueError, match=r"^max_slots: expected an int >= 1"):
        EngineProcess(failing_engine)  # a bad argument stays a ValueError (serve: exit 2)
    with pytest.raises(EngineError, match=r"failed to build: RuntimeError: the device is gone"):
        EngineProcess(broken_engine)


def test_a_dead_engine_ends_every_request_with_an_error():
    ep = EngineProcess(functools.partial(tiny_engine, max_slots=1))
    try:
        running = [ep.submit([1, 2, 3], 200) for _ in range(3)]
        os.kill(ep._process.pid, signal.SIGKILL)
        for r in running:
            c = _wait(r)  # result() would raise the error: the completion carries it
            assert c.finish_reason == FINISH_ERROR and "exited" in str(c.error)
        with pytest.raises(EngineError, match=r"exited"):
            ep.submit([1], 1)
        assert not ep.accepting
    finally:
        ep.close()


def _wait(r, timeout=60):
    deadline = time.monotonic() + timeout
    while r.completion is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return r.completion


def test_shutdown_drains_then_refuses():
    ep = EngineProcess(tiny_engine)
    try:
        r = ep.submit([1, 2, 3], 20)
        ep.shutdown(drain=True, timeout=60)
        assert r.completion is not None and r.completion.completion_tokens == 20
        with pytest.raises(EngineError, match=r"shutting down"):
            ep.submit([1], 1)
    finally:
        ep.close()
    assert ep._process.exitcode == 0


def test_the_server_streams_the_engine_processs_tokens_and_exports_its_counters():
    """create_app over an EngineProcess: a streamed completion carries the Engine's text, and
    /metrics the counters the engine's process reported."""
    from jax_kv.server import create_app

    remote = EngineProcess(tiny_engine)
    app = create_app(remote, model_name=MODEL_NAME, warm_up=False)
    with running(app) as base:
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 10, "temperature": 0,
                "stream": True}  # fmt: skip
        r = request("POST", f"{base}/v1/completions", body, timeout=60)
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        with tiny_engine() as local:
            want = local.submit("Hello", 10)
            local.run_until_idle()
        assert text == want.result().text and text
        metrics = request("GET", f"{base}/metrics").text
        steps = [ln for ln in metrics.splitlines() if ln.startswith("jax_kv_engine_steps_total")]
        assert steps and float(steps[0].split()[-1]) > 0
    remote.close()  # the app's shutdown drained it
    assert remote._process.exitcode == 0


@pytest.mark.parametrize("stop", ["shutdown", "close"])
def test_a_stop_during_the_warm_up_ends_it_at_its_next_request(stop):
    """The engine's process used to run warm_up to its end before it read the pipe, so a
    server stopped while it compiled waited for every compile (and close() could kill it
    after _JOIN_S). It now reads the pipe between warm-up requests: a shutdown or a close
    returns within about one prefill call, the warm-up is refused as the thread engine's is,
    and the process exits by itself."""
    ep = EngineProcess(engine_slow_warm_up)
    warm = {}

    def warm_up():
        try:
            ep.warm_up()
        except EngineError as e:
            warm["error"] = e

    t = threading.Thread(target=warm_up, daemon=True)
    t.start()
    time.sleep(0.5)  # the warm-up is in its first prefill call
    t0 = time.monotonic()
    if stop == "shutdown":
        ep.shutdown(drain=False)
    else:
        ep.close()
    t.join(30)
    elapsed = time.monotonic() - t0
    try:
        assert not t.is_alive()
        assert elapsed < 3 * SLOW_PREFILL_S, f"{stop} took {elapsed:.1f} s during the warm-up"
        assert "error" in warm, "warm_up() returned as if it had warmed up"
        if stop == "close":
            ep._process.join(10)
            assert ep._process.exitcode == 0, ep._process.exitcode  # not killed
    finally:
        ep.close()
