"""A request's handle and its text: what `Engine.submit` returns, streamed, awaited or
cancelled from any thread, and the incremental detokenizer that cuts at stop strings."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

# Why a request ended (Completion.finish_reason).
FINISH_STOP = "stop"  # a stop token id or a stop string
FINISH_LENGTH = "length"  # max_new_tokens generated
FINISH_CANCELLED = "cancelled"  # Request.cancel() (or the engine shut down without draining)
FINISH_ERROR = "error"  # the engine failed it: Completion.error says why

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Delta:
    """One streamed token: its id and the text it releases (may be "": text that could still
    become a stop string, or an incomplete UTF-8 sequence, is held back until it cannot)."""

    token: int
    text: str


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request. `tokens` are the generated ids (a stop token id, if hit, is kept
    as the last, as in Generator); `text` is their text up to any stop string, which it
    excludes (and without the stop token's text)."""

    request_id: str
    prompt_tokens: int
    tokens: list[int]
    text: str | None
    finish_reason: str
    error: BaseException | None = None
    preemptions: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


class RequestError(RuntimeError):
    """Request.result() of a request the engine failed; its cause is chained."""


class TextStream:
    """Incremental detokenization with stop strings.

    `push(token)` returns the text released by it. The text of the tokens is decoded over a
    short window (a tokenizer may merge bytes across tokens: a window that ends in an
    incomplete character, U+FFFD, waits for the next token). Stop strings are searched in the
    whole text so far, so one split over tokens is found; the last max(len(stop)) - 1
    characters are held back until they cannot start a stop string.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to text already taken
        self._read = 0
        self.text = ""  # all text decoded so far (before any stop cut)
        self._released = 0  # characters of `text` handed out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""  # the text ended at the stop string
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def _release(self) -> str:
        if self._stop:
            start = max(0, self._released - self._hold)
            hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._take(len(self.text))
        return self._take(max(self._released, len(self.text) - self._hold))

    def finish(self) -> str:
        """The text held back, released at the end (no stop string can complete now)."""
        if self.stopped:
            return ""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self._released : end]
        self._released = max(self._released, end)
        return out

    @property
    def released(self) -> str:
        return self.text[: self._released]


class Request:
    """A submitted request: iterate it for `Delta`s as tokens arrive, `result()` to wait for
    the `Completion`, `cancel()` to end it (its slot and memory are released within one
    engine step). Safe to use from any thread."""

    def __init__(
        self,
        prompt_ids: list[int],
        request_id: str | None = None,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.id = request_id or f"req-{next(_ids)}"
        # Called (outside this request's lock) after the first cancel(): the engine then
        # looks for cancelled requests at its next step instead of asking each at every step.
        self._on_cancel = on_cancel
        self.prompt_ids = prompt_ids
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._completion: Completion | None = None
        self._cancel_requested = False
        self._listeners: list[Callable[[], None]] = []

    # -- the caller's side -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Delta]:
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda i=i: len(self._deltas) > i or self._completion)
                ready = self._deltas[i:]
                done = self._completion is not None
            yield from ready
            i += len(ready)
            if done and i >= len(self._deltas):
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Waits for the end; raises RequestError if the engine failed the request,
        TimeoutError if `timeout` seconds pass first."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._completion is not None, timeout):
                raise TimeoutError(f"{self.id}: not finished after {timeout} s")
            completion = self._completion
        assert completion is not None
        if completion.finish_reason == FINISH_ERROR:
            raise RequestError(f"{self.id}: {completion.error}") from completion.error
        return completion

    def add_listener(self, notify: Callable[[], None]) -> None:
        """Calls `notify()` (on the engine's thread, so it must be quick and thread-safe:
        an event loop's call_soon_threadsafe) after each new delta and at the end."""
        with self._cond:
            self._listeners.append(notify)
            pending = bool(self._deltas) or self._completion is not None
        if pending:
            notify()

    def deltas_from(self, start: int) -> tuple[list[Delta], Completion | None]:
        """The deltas from index `start` on and the completion if finished: a non-blocking
        read for event loops (iteration blocks)."""
        with self._cond:
            return self._deltas[start:], self._completion

    def cancel(self) -> None:
        """Asks the engine to end the request (finish reason "cancelled"); a no-op once it
        finished."""
        with self._cond:
            first = not self._cancel_requested and self._completion is None
            self._cancel_requested = True
        if first and self._on_cancel is not None:
            self._on_cancel()

    @property
    def streamed(self) -> int:
        """Tokens streamed so far."""
        with self._cond:
            return len(self._deltas)

    @property
    def done(self) -> bool:
        with self._cond:
            return self._completion is not None

    @property
    def cancel_requested(self) -> bool:
        with self._cond:
            return self._cancel_requested

    @property
    def completion(self) -> Completion | None:
        with self._cond:
            return self._completion

    # -- the engine's side -------------------------------------------------------------------

    def _push(self, deltas: list[Delta]) -> None:
        if not deltas:
            return
        with self._cond:
            self._deltas.extend(deltas)
            self._cond.notify_all()
            listeners = list(self._listeners)
        for notify in listeners:
            notify()

    def _finish(self, completion: Completion) -> None:
        with self._cond:
            if self._completion is None:
                self._completion = completion
            self._cond.notify_all()
            listeners = list(self._listeners)
        for notify in listeners:
            notify()

    def __repr__(self) -> str:
        state = self._completion.finish_reason if self._completion else "running"
        return f"Request({self.id!r}, {len(self.prompt_ids)} prompt tokens, {state})"


__all__ = [
    "FINISH_CANCELLED",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Completion",
    "Delta",
    "Request",
    "RequestError",
    "TextStream",
]
