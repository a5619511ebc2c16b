"""The Engine in a process of its own, behind the interface the server uses (`submit`,
`warm_up`, `start`, `shutdown`, `close`, `snapshot`, `model`, `max_len`, `accepting`).

Why: the Engine's driver is host-bound between its calls, and in one process every
microsecond the event loop spends on its streams (SSE chunks, sockets) holds the GIL the
driver needs. Measured on an H100 (Llama-3-8B shape, 64 slots, 200 streaming clients, tree
de2dd6b): 17.6 ms/step alone, 21.4 in the server, the difference the event loop's 0.94 CPU s
over the 282 steps; a shorter GIL switch interval did not move it. vLLM runs its engine core in
a separate process for the same reason.

The wire (a `multiprocessing` pipe, spawn context: the parent never forks a process that
holds a CUDA context):
- parent -> engine: ("submit", id, ids, max_new, sampling, stop strings, stop ids),
  ("cancel", id), ("warm_up",), ("shutdown", drain, timeout), ("close",).
- engine -> parent: ("hello", info) once built (or ("error", message) and exit);
  ("out", [(id, [Delta...] | Completion)...], snapshot or None, submits received) at each
  delivery (beside the next call; no snapshot) and after each step (with its counters);
  ("ack", what, error message or None); ("failed", message).

A request is checked in the parent by the engine's own RequestLimits (the model the parent
holds has the tokenizer and config, no weights), so every refusal (400, 429, 503) is known at
submit without a round trip. The queue bound counts the engine's last reported waiting
requests plus the submits it has not yet received: an upper bound of what it holds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax_kv.decode.sampling import Sampling
from jax_kv.engine import (
    FINISH_ERROR,
    Completion,
    Engine,
    EngineError,
    QueueFull,
    Request,
)

_JOIN_S = 30.0


class _EngineGone(EngineError):
    """The engine's process exited (or its pipe closed) with work or a call pending."""


def build_engine(load_model: Callable[[], Any], tp: int = 1, **engine_kwargs: Any) -> Engine:
    """An Engine on `load_model()`, its KV heads over the first `tp` devices: what runs where
    the engine lives (this process or the engine's)."""
    from jax_kv.parallel import tp_mesh

    mesh = tp_mesh(tp) if tp > 1 else None
    return Engine(load_model(), mesh=mesh, **engine_kwargs)


class EngineProcess:
    """An Engine built by `make_engine()` (a picklable callable: module-level function or a
    functools.partial of one) in a spawned process; this object stands for it in the server.
    Construction waits until the engine is built; if building failed it raises the error:
    a ValueError as itself (a bad argument), any other as EngineError naming it."""

    def __init__(self, make_engine: Callable[[], Engine], *, start_timeout: float = 1800.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_engine_main, args=(child, make_engine), name="jax_kv-engine", daemon=True
        )
        self._process.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self._process.kill()
            raise EngineError(f"the engine process was not built after {start_timeout} s")
        try:
            first = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(_JOIN_S)
            raise EngineError(
                f"the engine process exited while building (code {self._process.exitcode})"
            ) from None
        if first[0] == "error":
            self._process.join(_JOIN_S)
            _, kind, message = first
            if kind == "ValueError":  # a bad argument (a tp the KV heads refuse): the caller's
                raise ValueError(message)
            raise EngineError(f"the engine process failed to build: {kind}: {message}")
        info = first[1]
        self.model = info["model"]  # tokenizer, chat template, config; no weights
        self.limits = info["limits"]
        self.max_len, self.max_slots = info["max_len"], info["max_slots"]
        self.max_queue = info["max_queue"]
        self._snapshot = info["snapshot"]
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # guarded by _lock
        self._submits = self._received = 0  # sent / received by the engine; under _lock
        self._accepting = True  # under _lock
        self._failure: EngineError | None = None
        self._closed = self._gone = False
        # Calls waiting for their acknowledgement, by call id (each its own answer).
        self._calls: dict[int, concurrent.futures.Future[None]] = {}  # guarded by _lock
        self._call_ids = itertools.count()
        self._outgoing: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="jax_kv-engine-send",
                                        daemon=True)  # fmt: skip
        self._receiver = threading.Thread(target=self._receive_loop, name="jax_kv-engine-recv",
                                          daemon=True)  # fmt: skip
        self._sender.start()
        self._receiver.start()

    # -- what the server calls -------------------------------------------------------------

    def submit(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        sampling: Sampling | None = None,
        *,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Engine.submit, across the pipe: checked here, queued for the engine. Raises as it
        does, and ValueError for a request_id of a request still running (the wire names
        requests by id)."""
        ids, max_new, sampling, stops, stop_ids = self.limits.check(
            self.model, prompt, max_new_tokens, sampling, stop, stop_token_ids
        )
        with self._lock:
            if self._failure is not None:
                raise EngineError(str(self._failure)) from self._failure
            if not self._accepting:
                raise EngineError("the engine is shutting down: it accepts no new requests")
            if request_id is not None and request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} names a request still running")
            waiting = self._snapshot.queued + self._submits - self._received
            if waiting >= self.max_queue:
                raise QueueFull(
                    f"submit: the queue is full ({waiting} requests waiting, max_queue="
                    f"{self.max_queue}); retry later"
                )
            request = Request(ids, request_id, on_cancel=lambda: self._cancel(request))
            self._requests[request.id] = request
            self._submits += 1
            self._outgoing.put(("submit", request.id, ids, max_new, sampling, stops,
                                sorted(stop_ids)))  # fmt: skip
        return request

    @property
    def accepting(self) -> bool:
        return self._accepting and self._failure is None

    def snapshot(self) -> Any:
        """The engine's last reported EngineSnapshot (one per step)."""
        return self._snapshot

    def warm_up(self) -> None:
        """Engine.warm_up in the engine's process; returns when it is done."""
        self._call("warm_up")

    def start(self) -> None:
        """The engine's process steps whenever it has work: nothing to start."""
        if not self.accepting:
            raise EngineError("start: the engine was shut down or failed")

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Engine.shutdown: stops accepting; with drain the running and queued requests
        finish (after `timeout` s the rest are cancelled), else they are cancelled."""
        with self._lock:
            self._accepting = False
        if self._failure is None and not self._gone:
            self._call("shutdown", drain, timeout)

    def close(self) -> None:
        """Shuts down without draining, frees the engine's cache and ends its process (killed
        if it does not answer within _JOIN_S); every request still running then ends, with
        an error if the process could not end it. Raises the engine's error from closing, if
        any, after all that."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._accepting = False
        error: EngineError | None = None
        try:
            if not self._gone:
                self._call("close", timeout=_JOIN_S)
        except EngineError as e:
            error = e
        finally:
            self._outgoing.put(None)
            self._process.join(_JOIN_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(_JOIN_S)
            self._conn.close()  # the receiver's read ends: it ends what is left (_lost)
            self._receiver.join(_JOIN_S)
            self._sender.join(_JOIN_S)
        if error is not None and not isinstance(error, _EngineGone):
            raise error  # the engine's own error from closing (its exit ends requests itself)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipe ---------------------------------------------------------------------------

    def _cancel(self, request: Request) -> None:
        self._outgoing.put(("cancel", request.id))

    def _call(self, what: str, *args: Any, timeout: float | None = None) -> None:
        """Sends `what` and waits for its acknowledgement (at most `timeout` s)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._gone:
                raise _EngineGone(f"{what}: {self._failure}")
            call = next(self._call_ids)
            self._calls[call] = future
        self._outgoing.put(("call", call, what, *args))
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise EngineError(f"{what}: the engine process did not answer in {timeout} s") from None
        finally:
            with self._lock:
                self._calls.pop(call, None)

    def _send_loop(self) -> None:
        # The event loop only queues: a pipe full while the engine runs a step would block it.
        while (message := self._outgoing.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the pipe is closed: the receiver ends every request (_lost)
            except Exception as error:  # noqa: BLE001 - a message that does not pickle
                self._refuse(message, error)

    def _refuse(self, message: tuple, error: BaseException) -> None:
        """A message that could not be sent: its request or call ends with the error."""
        failure = EngineError(f"{message[0]}: could not be sent ({error})")
        if message[0] == "submit":
            with self._lock:
                request = self._requests.pop(message[1], None)
            if request is not None:
                self._end(request, failure)
        elif message[0] == "call":
            with self._lock:
                future = self._calls.get(message[1])
            if future is not None and not future.done():
                future.set_exception(failure)

    @staticmethod
    def _end(request: Request, error: BaseException) -> None:
        completion = Completion(request.id, len(request.prompt_ids), [], None, FINISH_ERROR,
                                error)  # fmt: skip
        _deliver_safely(request._finish, completion)

    def _receive_loop(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            kind = message[0]
            if kind == "out":
                _, items, snapshot, received = message
                with self._lock:
                    if snapshot is not None:  # the waiting count holds the submits received
                        self._snapshot, self._received = snapshot, received
                    ended = [rid for rid, item in items if isinstance(item, Completion)]
                    found = {rid: self._requests.get(rid) for rid, _ in items}
                    for rid in ended:
                        self._requests.pop(rid, None)
                for rid, item in items:  # outside the lock: listeners run here
                    request = found[rid]
                    if request is None:
                        continue
                    if isinstance(item, Completion):
                        _deliver_safely(request._finish, item)
                    else:
                        _deliver_safely(request._push, item)
            elif kind == "ack":
                _, call, error = message
                with self._lock:
                    future = self._calls.get(call)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(EngineError(error))
            elif kind == "failed":
                self._failure = EngineError(f"the engine failed: {message[1]}")

    def _lost(self) -> None:
        """The engine's process is gone (or its pipe closed): every request and call still
        waiting ends with an error."""
        self._process.join(1.0)
        error = _EngineGone(f"the engine process exited (code {self._process.exitcode})")
        with self._lock:
            self._gone = True
            if self._failure is None:
                self._failure = error
            pending, self._requests = list(self._requests.values()), {}
            calls = list(self._calls.values())
        for request in pending:
            self._end(request, error)
        for future in calls:
            if not future.done():
                future.set_exception(error)


def _deliver_safely(deliver: Callable[[Any], None], item: Any) -> None:
    """Hands an item to a request; a listener that raises (an event loop already closed) is
    reported, and the other requests are still served."""
    try:
        deliver(item)
    except BaseException as error:  # noqa: BLE001 - one listener must not stop the receiver
        print(f"jax_kv: a request's listener raised {type(error).__name__}: {error}",
              file=sys.stderr)  # fmt: skip


# -- the engine's side ----------------------------------------------------------------------


def _portable(completion: Completion) -> Completion:
    """A completion whose error pickles whatever its type (the parent sees its text)."""
    if completion.error is None:
        return completion
    e = completion.error
    return dataclasses.replace(completion, error=EngineError(f"{type(e).__name__}: {e}"))


class WarmUpStopped(EngineError):
    """A shutdown or close reached the engine's process during its warm-up."""


class _EngineSide:
    """The engine's process: one thread that reads the pipe between steps and steps while
    there is work; each delivery's tokens go to the parent in one message (Engine.
    on_delivered), each step's counters after it."""

    def __init__(self, conn: Any, engine: Engine) -> None:
        self.conn, self.engine = conn, engine
        self.requests: dict[str, tuple[Request, int]] = {}  # id -> (request, deltas sent)
        self.changed: list[str] = []
        self.received = 0
        self.drain_deadline: float | None = None
        self.shutdown_call: int | None = None  # acknowledged once drained
        self.closing = self.failure_sent = False
        self.deferred: list[tuple] = []  # read during a warm-up, handled after it in order
        engine.on_delivered = self.flush

    def run(self) -> None:
        engine = self.engine
        while not self.closing:
            busy = engine.has_work()
            wait = 0 if busy else (0.05 if self.shutdown_call is not None else None)
            while self.conn.poll(wait):
                self.handle(self.conn.recv())
                wait = 0
                if self.closing:
                    return
            if engine.has_work():
                try:
                    engine._step(defer_delivery=True)
                except BaseException:  # noqa: BLE001 - _fail ended every request with it
                    pass
                self.flush(always=True)  # the step's counters, with what it delivered last
                self.report_failure()
            if self.shutdown_call is not None:
                if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
                    for request, _ in self.requests.values():
                        request.cancel()
                    self.drain_deadline = None
                if not engine.has_work():
                    self.conn.send(("ack", self.shutdown_call, None))
                    self.shutdown_call = None

    def handle(self, message: tuple) -> None:
        kind, engine = message[0], self.engine
        if kind == "submit":
            _, rid, ids, max_new, sampling, stops, stop_ids = message
            self.received += 1
            try:
                request = engine.submit(ids, max_new, sampling, stop=stops,
                                        stop_token_ids=stop_ids, request_id=rid)  # fmt: skip
            except Exception as error:  # noqa: BLE001 - the parent's checks make this rare
                ended = Completion(rid, len(ids), [], None, FINISH_ERROR, error)
                self.conn.send(("out", [(rid, _portable(ended))], engine.snapshot(),
                                self.received))  # fmt: skip
                return
            self.requests[rid] = (request, 0)
            request.add_listener(lambda rid=rid: self.changed.append(rid))
        elif kind == "cancel":
            found = self.requests.get(message[1])
            if found is not None:
                found[0].cancel()
        elif kind == "call":
            self.call(message[1], message[2], *message[3:])
            while self.deferred and not self.closing:
                self.handle(self.deferred.pop(0))

    def read_during_warm_up(self) -> None:
        """Engine.warm_up's `between`: the pipe, read between compiles, so a server stopped
        while it compiles does not wait for the last compile. Every message waits, in order,
        until the warm-up ended (a request submitted now must neither run inside the warm-up,
        where its cancel would go unread, nor take a bucket's compile or a queue place from
        it); a shutdown or a close ends the warm-up at once (WarmUpStopped), then runs."""
        while self.conn.poll(0):
            message = self.conn.recv()
            self.deferred.append(message)
            if message[0] == "call" and message[2] in ("shutdown", "close"):
                raise WarmUpStopped(f"warm_up: stopped by a {message[2]} before it ended")

    def call(self, call: int, what: str, *args: Any) -> None:
        """Runs a call (warm_up, shutdown, close) and acknowledges it with its error, if any;
        a shutdown that drains is acknowledged by run() once no work is left."""
        engine = self.engine
        try:
            if what == "warm_up":
                engine.warm_up(between=self.read_during_warm_up)
            elif what == "shutdown":
                drain, timeout = args
                engine.shutdown(drain=drain)  # no driver thread: stops accepting (cancels all)
                if self.shutdown_call is not None:  # an earlier shutdown: answered with this
                    self.conn.send(("ack", self.shutdown_call, None))
                self.shutdown_call = call
                self.drain_deadline = None if timeout is None else time.monotonic() + timeout
                return
            elif what == "close":
                self.closing = True
                self.flush()
                engine.close()
            else:
                raise ValueError(f"unknown call {what!r}")
        except Exception as error:  # noqa: BLE001 - reported to the caller
            self.flush(always=not self.closing)
            self.report_failure()
            self.conn.send(("ack", call, f"{type(error).__name__}: {error}"))
            return
        finally:
            if what == "close":
                self.flush()  # the endings close() gave the requests still running
        if not self.closing:
            self.flush(always=True)  # the counters after it (a warm-up delivers nothing)
        self.conn.send(("ack", call, None))

    def report_failure(self) -> None:
        """Tells the parent once that the engine failed (a step raised, in a call too)."""
        failure = self.engine.failure
        if failure is not None and not self.failure_sent:
            self.failure_sent = True
            self.conn.send(("failed", f"{type(failure).__name__}: {failure}"))

    def flush(self, always: bool = False) -> None:
        """Sends the tokens and endings delivered since the last flush; with always (after a
        step: outside the call's time), also when none were, with the engine's snapshot."""
        if not self.changed and not always:
            return
        items: list[tuple[str, Any]] = []
        for rid in dict.fromkeys(self.changed):
            found = self.requests.get(rid)
            if found is None:
                continue
            request, sent = found
            deltas, completion = request.deltas_from(sent)
            if deltas:
                items.append((rid, deltas))
            if completion is not None:
                items.append((rid, _portable(completion)))
                del self.requests[rid]
            else:
                self.requests[rid] = (request, sent + len(deltas))
        self.changed.clear()
        # The snapshot (a copy of the counters, sums over slots) only after a step: beside a
        # call it would take host time from the next one's preparation.
        snapshot = self.engine.snapshot() if always else None
        self.conn.send(("out", items, snapshot, self.received))


def _engine_main(conn: Any, make_engine: Callable[[], Engine]) -> None:
    # The parent drains and closes the engine: a Ctrl-C or a SIGTERM sent to the whole
    # process group must not interrupt a step here (the parent's death closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = make_engine()
    except BaseException as error:  # noqa: BLE001 - reported to the parent, then exit
        conn.send(("error", type(error).__name__, str(error)))
        return
    model = dataclasses.replace(engine.model, params={})  # what the parent needs: no weights
    info = dict(model=model, limits=engine.limits, max_len=engine.max_len,
                max_slots=engine.max_slots, max_queue=engine.max_queue,
                snapshot=engine.snapshot())  # fmt: skip
    conn.send(("hello", info))
    try:
        _EngineSide(conn, engine).run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the parent is gone
    finally:
        if not engine.cache.closed:
            engine.close()


__all__ = ["EngineProcess", "build_engine"]
