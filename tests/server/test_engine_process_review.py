"""Review of jax_kv.server.engine_process.EngineProcess: interleavings where a request is never
finished, close() hangs, or the parent's view of the engine is wrong. Every test here failed on
the code reviewed (tree aa73f70) and passes after the fixes. The engines are built in spawned
processes from the module-level factories below (what a spawned process can import)."""

import asyncio
import functools
import os
import signal
import threading
import time

import pytest
from engine_factories import chat_engine, chat_model, make_engine, slowed

import jax_kv.server.engine_process as engine_process
from jax_kv.engine import EngineError, QueueFull
from jax_kv.server.engine_process import EngineProcess

# -- factories (run in the engine's process) -------------------------------------------------


tiny_engine = chat_engine


def engine_dying_in_close():
    """An engine whose process dies while closing (a crash freeing device memory, an OOM
    kill): the parent's close() is then waiting for its acknowledgement."""
    e = tiny_engine(max_slots=2)
    e.close = lambda: os._exit(3)
    return e


def engine_failing_close():
    e = tiny_engine(max_slots=2)

    def close():
        raise RuntimeError("freeing the cache failed")

    e.close = close
    return e


def engine_failing_steps():
    """Every prefill call raises (a device error): warm_up's first step fails the engine."""
    e = tiny_engine(max_slots=2)

    def broken(*args, **kw):
        raise RuntimeError("device lost")

    e._run_prefill = broken
    return e


def engine_preempting():
    """2 slots, a KV budget of 14 granules (16 tokens each) per binding: two requests of 210
    tokens fit one at a time, so the younger is preempted half way and waits until the older
    ends (~100 decode steps). prefill_chunk_tokens=256: a re-admission needs the preempted
    request's whole re-prefill (~7 granules) at once, which the older one never leaves free;
    with small chunks (32 tokens: 2 granules) it was re-admitted at once and preempted again,
    several times, and waited for the last ~16 steps only (~15 ms, missed by the parent's
    polling about 1 run in 4). Every decode call sleeps 10 ms (decode_ahead off: a call
    dispatched ahead skips _run_decode), so the wait lasts ~1 s."""
    m = chat_model()
    c = m.config
    granule = 16 * c.num_kv_heads * c.head_dim * 4
    bindings = 2 * c.num_layers
    e = make_engine(m, max_slots=2, max_queue=1, granule_bytes=granule,
                    kv_budget_bytes=14 * granule * bindings, prefill_chunk_tokens=256,
                    decode_ahead=False)  # fmt: skip
    return slowed(e, decode_s=0.01)


# -- helpers -----------------------------------------------------------------------------------


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _streaming(requests, timeout=60):
    _wait(lambda: all(r.streamed > 0 for r in requests), timeout, "the requests never streamed")


def _in_thread(fn):
    """Runs fn on a daemon thread; returns (thread, outcome dict)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _kill(ep):
    if ep._process.is_alive():
        os.kill(ep._process.pid, signal.SIGKILL)


# -- tests -------------------------------------------------------------------------------------


def test_close_ends_every_request_when_the_engine_dies_while_closing():
    """close() sets _closed before the engine acknowledges; the process then dies, and
    _lost() returns early because _closed is set: the running requests are never finished
    (a stream waits forever), and close() raises 'close: None'."""
    ep = EngineProcess(engine_dying_in_close)
    running = [ep.submit([1, 2, 3], 200), ep.submit([4, 5], 200)]
    _streaming(running)
    try:
        t, out = _in_thread(ep.close)
        t.join(30)
        assert not t.is_alive(), "close() did not return after the engine's process died"
        deadline = time.monotonic() + 10
        while any(r.completion is None for r in running) and time.monotonic() < deadline:
            time.sleep(0.01)
        lost = [r.id for r in running if r.completion is None]
        assert not lost, (
            f"requests {lost} were never finished: the engine's process died during close() "
            f"and _lost() skipped ending them because _closed was set (close: {out})"
        )
    finally:
        _kill(ep)


def test_close_of_an_engine_that_died_while_closing_reaps_it_without_a_meaningless_error():
    """Same interleaving: close() raises EngineError('close: None') (the failure is None as
    _lost() returned early) and skips the join, the sender's stop and the pipe's close."""
    ep = EngineProcess(engine_dying_in_close)
    try:
        try:
            ep.close()
        except EngineError as e:
            assert str(e) != "close: None", "close() raised an error without a cause"
        assert ep._process.exitcode is not None, "close() left the engine's process unreaped"
        ep._sender.join(5)
        assert not ep._sender.is_alive(), "close() left the sender thread running"
    finally:
        _kill(ep)


def test_close_returns_when_the_engine_process_is_stuck(monkeypatch):
    """An engine process that never answers (a hung device call; here SIGSTOP): close()
    waits for its acknowledgement with no timeout, so it never kills the process and the
    server's main.run never exits. _JOIN_S (the time close() gives the process) is set to 2 s
    here; close() should return within a few times that."""
    monkeypatch.setattr(engine_process, "_JOIN_S", 2.0)
    ep = EngineProcess(functools.partial(tiny_engine, max_slots=2))
    try:
        os.kill(ep._process.pid, signal.SIGSTOP)
        t, out = _in_thread(ep.close)
        t.join(20)
        assert not t.is_alive(), (
            "close() blocked for 20 s on a stuck engine process: _call('close') waits for the "
            "acknowledgement forever (only the process's exit ends the wait)"
        )
    finally:
        _kill(ep)


def test_a_listener_that_raises_neither_loses_the_other_requests_nor_hangs_close():
    """A listener runs on the receiver thread; if it raises (the app's listener is
    loop.call_soon_threadsafe, which raises once the event loop is closed: a forced server
    exit, then main.run's engine.close()), the receiver thread dies: every other request is
    never finished and close() waits forever for an acknowledgement nobody reads."""
    ep = EngineProcess(functools.partial(tiny_engine, max_slots=2))
    closer = None
    try:
        loop = asyncio.new_event_loop()
        loop.close()
        a = ep.submit([1, 2, 3], 100)
        a.add_listener(lambda: loop.call_soon_threadsafe(lambda: None))  # RuntimeError
        b = ep.submit([4, 5, 6], 20)
        deadline = time.monotonic() + 60
        while b.completion is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.completion is not None, (
            "another request's listener raised on the receiver thread: the thread died and "
            "this request was never finished"
        )
        closer, out = _in_thread(ep.close)
        closer.join(30)
        assert not closer.is_alive(), "close() hung after a listener raised"
    finally:
        _kill(ep)


def test_a_warm_up_that_fails_the_engine_stops_accepting():
    """warm_up's step raises in the engine's process: the Engine there failed (it refuses
    every submit), but only an 'ack' with the error crosses the pipe, never 'failed': the
    parent stays accepting (/health 200 after a restart of the warm-up, submits accepted
    and each ended with an error) where the in-process Engine refuses with EngineError."""
    ep = EngineProcess(engine_failing_steps)
    try:
        with pytest.raises(EngineError, match=r"device lost"):
            ep.warm_up()
        assert not ep.accepting, "the engine failed in warm_up, yet accepting is True"
        with pytest.raises(EngineError):
            ep.submit([1, 2, 3], 4)
    finally:
        ep.close()


def test_two_requests_with_the_same_request_id_both_finish_or_the_second_is_refused():
    """Engine.submit accepts any request_id (the Engine keys nothing by it); EngineProcess
    keys its requests by id on both sides of the pipe, so the first request's entry is
    overwritten: it never finishes."""
    ep = EngineProcess(functools.partial(tiny_engine, max_slots=2))
    try:
        first = ep.submit([1, 2, 3], 5, request_id="same")
        try:
            second = ep.submit([4, 5, 6], 30, request_id="same")
        except ValueError:
            return  # refusing a duplicate id is a correct answer too
        deadline = time.monotonic() + 60
        while (first.completion is None or second.completion is None) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
        assert second.completion is not None
        assert first.completion is not None, (
            "the first of two requests with the same request_id was never finished"
        )
        assert first.completion.completion_tokens == 5
    finally:
        ep.close()


def test_preempted_requests_do_not_count_against_max_queue():
    """The engine's bound counts the queued requests never admitted (Engine.submit: preempted
    ones not counted); the parent counts snapshot.waiting (num_waiting: preempted included),
    so while a preempted request waits for memory, it refuses with QueueFull a submit the
    engine would take (max_queue=1 here: 429 with nothing waiting)."""
    ep = EngineProcess(engine_preempting)
    try:
        a = ep.submit([1] * 10, 200)
        _streaming([a])  # admitted: the queue (max_queue=1) has room for b
        b = ep.submit([2] * 10, 200)

        def preempted_waiting():
            s = ep.snapshot()
            return (s.stats.preemptions > 0 and s.waiting == 1 and s.queued == 0
                    and s.running == 1 and s.stats.submitted == 2 and not a.done
                    and not b.done)  # fmt: skip

        _wait(preempted_waiting, 120, "no preempted request waited")
        # The engine holds one request waiting, which is a preempted one: its own bound
        # (never-admitted requests < max_queue=1) takes this one.
        try:
            c = ep.submit([3] * 5, 5)
        except QueueFull as e:
            pytest.fail(f"refused while only a preempted request waited: {e}")
        assert c.result(120).completion_tokens == 5
    finally:
        ep.close()


def test_close_reaps_the_process_when_the_engines_close_raises():
    """The engine's close() raises: EngineProcess.close() raises from _call('close') before
    it stops the sender thread, joins the process and closes the pipe (and a second close()
    returns at once: they are never done)."""
    ep = EngineProcess(engine_failing_close)
    try:
        with pytest.raises(EngineError, match="freeing the cache failed"):
            ep.close()
        ep._sender.join(5)
        assert not ep._sender.is_alive(), "close() raised and left the sender thread running"
        assert ep._conn.closed, "close() raised and left the pipe open"
    finally:
        _kill(ep)


def test_concurrent_calls_each_get_their_own_acknowledgement():
    """_call takes whichever ('ack', what, error) comes first from one queue without looking
    at `what`: a shutdown(drain=True) waiting while a warm_up is refused (the engine is
    shutting down: its ack comes at once) takes the warm-up's refusal, raises it and returns
    before the running request drained; the warm_up then returns the shutdown's ack, later,
    as a success. (The app calls both at once when it is stopped while it warms up.)"""
    ep = EngineProcess(functools.partial(tiny_engine, max_slots=2))
    try:
        rs = [ep.submit([1, 2, 3 + i], 250) for i in range(8)]  # ~2 s of work on 2 slots
        _streaming(rs[:1])
        t, out = _in_thread(lambda: ep.shutdown(True, None))
        time.sleep(0.1)  # the shutdown is waiting for its acknowledgement
        warm = {}
        try:
            ep.warm_up()
        except EngineError as e:
            warm["error"] = e
        t.join(60)
        assert not t.is_alive()
        assert "error" not in out, f"shutdown() raised another call's answer: {out['error']!r}"
        assert all(r.done for r in rs), "shutdown(drain=True) returned before the requests drained"
        assert "error" in warm, "warm_up() after shutdown returned as if it had warmed up"
    finally:
        ep.close()
