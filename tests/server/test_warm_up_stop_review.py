"""Review of 5164fbf (the engine's process reads its pipe between warm-up requests): a request
submitted while the warm-up runs is handled at once, so the warm-up's own run_until_idle()
serves it to its end, and the pipe is not read again until then: a cancel, a shutdown without
draining or a close sent meanwhile waits for that request's last token. Every test here fails
on the code reviewed. The engines are built in spawned processes from the module-level
factories below (what a spawned process can import)."""

import os
import threading
import time

from engine_factories import chat_engine, engine_slow_warm_up, slowed

import jax_kv.server.engine_process as engine_process
from jax_kv.engine import FINISH_CANCELLED, EngineError
from jax_kv.server.engine_process import EngineProcess

SLOW_PREFILL_S = 1.0  # per prefill call: a warm-up of >= 7 calls
SLOW_DECODE_S = 0.1  # per decode call: a request of LONG tokens decodes for >= 12 s
LONG = 120


def engine_slow_warm_up_and_decode():
    """Every prefill call sleeps SLOW_PREFILL_S (a warm-up long enough to submit during it),
    every decode call SLOW_DECODE_S (a request of LONG tokens outlasts any stop margin)."""
    e = chat_engine(max_slots=2, prefill_chunk_tokens=256)
    return slowed(e, prefill_s=SLOW_PREFILL_S, decode_s=SLOW_DECODE_S)


MARKER_ENV = "JAX_KV_WARM_UP_REVIEW_MARKER"


def engine_queue_of_one_marking_its_last_warm_up_requests():
    """max_queue=1. When the warm-up submits its last requests (the first of them samples),
    it writes the file named by $JAX_KV_WARM_UP_REVIEW_MARKER and waits 3 s: a submit sent
    then is read at the warm-up's next request, while this one waits in the queue."""
    e = chat_engine(max_slots=2, max_queue=1, prefill_chunk_tokens=32)
    marker, submit = os.environ[MARKER_ENV], e.submit

    def marking(prompt, max_new=256, sampling=None, **kw):
        request = submit(prompt, max_new, sampling, **kw)
        if kw.get("request_id") is None and sampling is not None:  # warm-up's sampling one
            with open(marker, "w") as f:
                f.write("submitted")
            time.sleep(3.0)
        return request

    e.submit = marking
    return e


def _warming(ep):
    """ep.warm_up() on a thread; returns (thread, outcome dict)."""
    out = {}

    def run():
        try:
            ep.warm_up()
            out["done"] = True
        except EngineError as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _streaming(r, timeout=20):
    deadline = time.monotonic() + timeout
    while r.streamed == 0 and r.completion is None:
        assert time.monotonic() < deadline, "the request submitted in the warm-up never streamed"
        time.sleep(0.01)
    assert r.completion is None, f"the request ended before it streamed: {r.completion}"


def _streaming_during_the_warm_up(ep):
    """ep.warm_up() on a thread, a request of LONG tokens submitted during it (0.5 s in: the
    warm-up's first prefill call), waited for until it streams; returns (thread, outcome,
    request)."""
    t, warm = _warming(ep)
    time.sleep(0.5)
    r = ep.submit([1, 2, 3], LONG, stop_token_ids=[])
    _streaming(r)
    return t, warm, r


def _kill(ep):
    if ep._process.is_alive():
        ep._process.kill()
        ep._process.join(10)


def test_a_cancel_of_a_request_submitted_during_the_warm_up_is_read_before_it_ends():
    """A request submitted while the engine's process warms up is handled at the next
    warm-up request (read_during_warm_up -> handle -> engine.submit), and the warm-up's
    run_until_idle() then serves it to its last token without reading the pipe: its cancel,
    sent once it streams, is read only at the next warm-up request, after the request ended
    by length. (Before 5164fbf the submit and the cancel were read together after the
    warm-up: the request ended cancelled; the in-process Engine sees a cancel at its next
    step, warm-up or not.)"""
    ep = EngineProcess(engine_slow_warm_up_and_decode)
    try:
        t, warm, r = _streaming_during_the_warm_up(ep)
        r.cancel()
        deadline = time.monotonic() + 28
        while r.completion is None and time.monotonic() < deadline:
            time.sleep(0.05)
        c = r.completion
        assert c is not None, "the request was never finished"
        assert c.finish_reason == FINISH_CANCELLED, (
            f"a request cancelled as it streamed, during the warm-up, ended "
            f"{c.finish_reason!r} with {len(c.tokens)} tokens: the engine's process served it "
            f"inside warm_up's run_until_idle and read the cancel only after its last token"
        )
    finally:
        _kill(ep)


def test_a_close_during_the_warm_up_is_not_held_up_by_a_request_submitted_during_it(
    monkeypatch,
):
    """Same interleaving, with a close: read_during_warm_up runs only between warm-up
    requests, and the request submitted during the warm-up is served to its end inside it
    (LONG tokens, >= 12 s here) before the close is read. close() then gets no answer within
    _JOIN_S (5 s here; 30 s in the server: a request of a few thousand tokens), raises, and
    kills the engine's process, which 5164fbf set out to avoid (a close stops the warm-up at
    its next request, about one prefill call, here 1 s)."""
    monkeypatch.setattr(engine_process, "_JOIN_S", 5.0)
    ep = EngineProcess(engine_slow_warm_up_and_decode)
    try:
        t, warm, r = _streaming_during_the_warm_up(ep)
        error = None
        try:
            ep.close()
        except EngineError as e:
            error = e
        t.join(10)
        assert error is None, f"close() during the warm-up raised: {error}"
        assert ep._process.exitcode == 0, (
            f"the engine's process was killed by close() (exit code {ep._process.exitcode}): "
            f"it was serving the request submitted during the warm-up (ended: "
            f"{r.completion and r.completion.finish_reason!r}) and read no pipe meanwhile"
        )
    finally:
        _kill(ep)


def test_a_request_submitted_during_the_warm_up_is_not_refused_for_the_warm_ups_own_queue(
    monkeypatch, tmp_path
):
    """EngineProcess.submit counts the queue as the engine last reported it plus the submits
    in flight (0 + 0 < max_queue=1: accepted). During the warm-up the engine's process now
    hands the submit to engine.submit at once, whose queue holds the warm-up's own request:
    QueueFull inside the engine's process, and the accepted request ends with an error.
    Before 5164fbf it was read after the warm-up, into an empty queue, and served."""
    marker = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    ep = EngineProcess(engine_queue_of_one_marking_its_last_warm_up_requests)
    try:
        t, warm = _warming(ep)
        deadline = time.monotonic() + 25
        while not marker.exists():
            assert time.monotonic() < deadline, "the warm-up never reached its last requests"
            time.sleep(0.01)
        r = ep.submit([1, 2, 3], 4, stop_token_ids=[])
        deadline = time.monotonic() + 25
        while r.completion is None and time.monotonic() < deadline:
            time.sleep(0.02)
        c = r.completion
        assert c is not None, "the request was never finished"
        assert c.error is None, (
            f"a request EngineProcess.submit accepted during the warm-up ended "
            f"{c.finish_reason!r}: {c.error}"
        )
        t.join(25)
        assert warm.get("done"), warm
    finally:
        _kill(ep)


def test_a_request_submitted_during_the_warm_up_does_not_take_a_buckets_compile_away():
    """warm_up sends one request per prefill bucket (16, 32, 64, 128, 256) so that every
    bucket is compiled before the server is ready. A request submitted during it (here
    0.5 s in: read at the 16- or 32-token bucket's request, >= 2 s before the 64's) now
    joins the queue at once and is packed into that bucket's call (n + 3 tokens: bucket 2n):
    bucket n is never compiled, and the first request that needs it after the warm-up waits
    for the compile. Before 5164fbf the submit was read after the warm-up."""
    ep = EngineProcess(engine_slow_warm_up)  # prefill calls 1.5 s apart
    try:
        t, warm = _warming(ep)
        time.sleep(0.5)  # the warm-up is in its first prefill call (bucket 16)
        r = ep.submit([1, 2, 3], 2, stop_token_ids=[])
        t.join(40)
        assert warm.get("done"), warm
        deadline = time.monotonic() + 10
        while r.completion is None and time.monotonic() < deadline:
            time.sleep(0.02)
        compiled = sorted(ep.snapshot().stats.prefill_buckets)
        assert compiled == [16, 32, 64, 128, 256], (
            f"after the warm-up the prefill buckets called are {compiled}: the request "
            f"submitted during it was packed into a warm-up request's call"
        )
    finally:
        _kill(ep)
