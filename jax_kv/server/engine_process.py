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

import dataclasses
import multiprocessing
import queue
import signal
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


def build_engine(load_model: Callable[[], Any], tp: int = 1, **engine_kwargs: Any) -> Engine:
    """An Engine on `load_model()`, its KV heads over the first `tp` devices: what runs where
    the engine lives (this process or the engine's)."""
    from jax_kv.parallel import tp_mesh

    mesh = tp_mesh(tp) if tp > 1 else None
    return Engine(load_model(), mesh=mesh, **engine_kwargs)


class EngineProcess:
    """An Engine built by `make_engine()` (a picklable callable: module-level function or a
    functools.partial of one) in a spawned process; this object stands for it in the server.
    Construction waits until the engine is built and raises EngineError with its error if
    building failed."""

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
            raise EngineError(f"the engine process failed to build: {first[1]}")
        info = first[1]
        self.model = info["model"]  # tokenizer, chat template, config; no weights
        self.limits = info["limits"]
        self.max_len, self.max_slots = info["max_len"], info["max_slots"]
        self.max_queue = info["max_queue"]
        self.prefill_chunk_tokens = info["prefill_chunk_tokens"]
        self._snapshot = info["snapshot"]
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # guarded by _lock
        self._submits = self._received = 0  # sent / received by the engine; under _lock
        self._accepting = True
        self._failure: EngineError | None = None
        self._closed = self._gone = False
        self._acks: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
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
        """Engine.submit, across the pipe: checked here, queued for the engine."""
        ids, max_new, sampling, stops, stop_ids = self.limits.check(
            self.model, prompt, max_new_tokens, sampling, stop, stop_token_ids
        )
        with self._lock:
            if self._failure is not None:
                raise EngineError(str(self._failure)) from self._failure
            if not self._accepting:
                raise EngineError("the engine is shutting down: it accepts no new requests")
            waiting = self._snapshot.waiting + self._submits - self._received
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

    @property
    def stats(self) -> Any:
        """The engine's EngineStats as of its last delivery."""
        return self._snapshot.stats

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
        self._accepting = False
        if self._failure is None:
            self._call("shutdown", drain, timeout)

    def close(self) -> None:
        """Shuts down without draining, frees the engine's cache and ends its process."""
        if self._closed:
            return
        self._closed = True
        self._accepting = False
        if not self._gone:
            self._call("close")  # a failed engine's cache is freed there too
        self._outgoing.put(None)
        self._process.join(_JOIN_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(_JOIN_S)
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipe ---------------------------------------------------------------------------

    def _cancel(self, request: Request) -> None:
        self._outgoing.put(("cancel", request.id))

    def _call(self, what: str, *args: Any) -> None:
        """Sends `what` and waits for the engine's acknowledgement."""
        if self._gone:
            raise EngineError(f"{what}: {self._failure}")
        self._outgoing.put((what, *args))
        while True:
            try:
                done, error = self._acks.get(timeout=1.0)
                break
            except queue.Empty:
                if self._gone:
                    raise EngineError(f"{what}: {self._failure}") from None
        if done == "lost":
            raise EngineError(f"{what}: {self._failure}")
        if error is not None:
            raise EngineError(f"{what}: {error}")

    def _send_loop(self) -> None:
        # The event loop only queues: a pipe full while the engine runs a step would block it.
        while (message := self._outgoing.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the receiver sees the engine gone and ends every request

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
                        request._finish(item)
                    else:
                        request._push(item)
            elif kind == "ack":
                self._acks.put((message[1], message[2]))
            elif kind == "failed":
                self._failure = EngineError(f"the engine failed: {message[1]}")

    def _lost(self) -> None:
        """The engine's process is gone: every request it held ends with an error."""
        self._process.join(1.0)
        self._gone = True
        if self._closed:
            return  # closed on purpose
        error = EngineError(
            f"the engine process exited (code {self._process.exitcode}) with requests running"
        )
        if self._failure is None:
            self._failure = error
        with self._lock:
            pending, self._requests = list(self._requests.values()), {}
        for r in pending:
            r._finish(Completion(r.id, len(r.prompt_ids), [], None, FINISH_ERROR, error))
        self._acks.put(("lost", None))


# -- the engine's side ----------------------------------------------------------------------


def _portable(completion: Completion) -> Completion:
    """A completion whose error pickles whatever its type (the parent sees its text)."""
    if completion.error is None:
        return completion
    e = completion.error
    return dataclasses.replace(completion, error=EngineError(f"{type(e).__name__}: {e}"))


class _EngineSide:
    """The engine's process: one thread that reads the pipe between steps and steps while
    there is work; each step's tokens go to the parent in one message (Engine.on_delivered)."""

    def __init__(self, conn: Any, engine: Engine) -> None:
        self.conn, self.engine = conn, engine
        self.requests: dict[str, tuple[Request, int]] = {}  # id -> (request, deltas sent)
        self.changed: list[str] = []
        self.received = 0
        self.drain_deadline: float | None = None
        self.draining = self.closing = False
        engine.on_delivered = self.flush

    def run(self) -> None:
        engine = self.engine
        while not self.closing:
            busy = engine.has_work()
            wait = 0 if busy else (0.05 if self.draining else None)
            while self.conn.poll(wait):
                self.handle(self.conn.recv())
                wait = 0
                if self.closing:
                    return
            if engine.has_work():
                try:
                    engine._step(defer_delivery=True)
                except BaseException as error:  # noqa: BLE001 - _fail ended every request
                    self.flush()
                    self.conn.send(("failed", f"{type(error).__name__}: {error}"))
                self.flush(always=True)  # the step's counters, with what it delivered last
            if self.draining:
                if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
                    for request, _ in self.requests.values():
                        request.cancel()
                    self.drain_deadline = None
                if not engine.has_work():
                    self.draining = False
                    self.conn.send(("ack", "shutdown", None))

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
        elif kind == "warm_up":
            self.ack("warm_up", engine.warm_up)
        elif kind == "shutdown":
            _, drain, timeout = message
            engine.shutdown(drain=drain)  # no driver thread: stops accepting (cancels all)
            self.draining = True
            self.drain_deadline = None if timeout is None else time.monotonic() + timeout
        elif kind == "close":
            self.flush()
            self.ack("close", engine.close)
            self.closing = True

    def ack(self, what: str, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as error:  # noqa: BLE001 - reported to the caller
            self.conn.send(("ack", what, f"{type(error).__name__}: {error}"))
            return
        self.flush(always=True)  # the counters after it (a warm-up's steps deliver nothing)
        self.conn.send(("ack", what, None))

    def flush(self, always: bool = False) -> None:
        """Sends the tokens and endings delivered since the last flush; with always (after a
        step: outside the call's time), also when none were, with the engine's snapshot."""
        if not self.changed and not always:
            return
        items: list[tuple[str, Any]] = []
        for rid in dict.fromkeys(self.changed):
            request, sent = self.requests[rid]
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
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    model = dataclasses.replace(engine.model, params={})  # what the parent needs: no weights
    info = dict(model=model, limits=engine.limits, max_len=engine.max_len,
                max_slots=engine.max_slots, max_queue=engine.max_queue,
                prefill_chunk_tokens=engine.prefill_chunk_tokens,
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
