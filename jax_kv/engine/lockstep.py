"""Lockstep: one Engine per process of a multi-process mesh, driven by a leader (issue 28,
item 4), the way JetStream and MaxText serve past one host.

Every process holds the same Engine over the global mesh; each step's compiled prefill and
decode run on every process's devices together, and each process commits and releases the same
granules in its own arenas. Their schedules stay identical because every process sees the same
requests at the same step: the leader (process 0) takes `submit` and `cancel`, and at each
`step` broadcasts the calls recorded since the last one (`multihost_utils.
broadcast_one_to_all`, JAX's own runtime: no transport of ours), every process applies them to
its engine in that order, then all run one engine step. Followers loop on `step()` until the
leader calls `stop()`.

Cancel through `Lockstep.cancel`: a `Request.cancel()` on the leader's handle alone would end
the request on the leader only and the schedules would part.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_kv.decode.sampling import Sampling
from jax_kv.engine.request import Request


def broadcast_json(value: Any, is_source: bool) -> Any:
    """The source process's JSON-able value, on every process."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_source else None
    n = int(multihost_utils.broadcast_one_to_all(np.int64(0 if data is None else data.size),
                                                 is_source=is_source))  # fmt: skip
    buf = np.zeros((n,), np.uint8) if data is None else data.copy()
    buf = multihost_utils.broadcast_one_to_all(buf, is_source=is_source)
    return json.loads(np.asarray(buf).tobytes().decode())


class Lockstep:
    """Drives `engine` in step with the same engine of every other process.

    Args:
        engine: this process's Engine (built the same way on every process, over one mesh).
        broadcast: (value, is_source) -> the source's value on every process; default
            `broadcast_json` (tests may pass a single-process stand-in).
        is_leader: default `jax.process_index() == 0`.
    """

    def __init__(self, engine: Any, *, broadcast: Any = broadcast_json,
                 is_leader: bool | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.is_leader = jax.process_index() == 0 if is_leader is None else bool(is_leader)
        self._broadcast = broadcast
        self._lock = threading.Lock()
        self._calls: list[dict[str, Any]] = []  # the leader's, since the last step
        self._handles: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stopped = False
        self.steps = 0

    # -- the leader's calls ------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 256,
        sampling: Sampling | None = None,
        *,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """The leader's Engine.submit (token ids; checked at once, as Engine.submit checks);
        every other process submits it at the next step."""
        self._require_leader("submit")
        args = dict(
            prompt=[int(t) for t in prompt], max_new_tokens=max_new_tokens,
            sampling=None if sampling is None else dataclasses.asdict(sampling),
            stop=stop if stop is None or isinstance(stop, str) else list(stop),
            stop_token_ids=None if stop_token_ids is None else [int(t) for t in stop_token_ids],
            request_id=request_id or f"lockstep-{next(self._ids)}",
        )  # fmt: skip
        with self._lock:
            request = self._submit(args)
            self._calls.append({"kind": "submit", "args": args})
        return request

    def cancel(self, request: Request) -> None:
        """Ends `request` on every process at the next step."""
        self._require_leader("cancel")
        with self._lock:
            self._calls.append({"kind": "cancel", "id": request.id})

    def stop(self) -> None:
        """After the next step, followers' `step()` returns False once their work is done."""
        self._require_leader("stop")
        with self._lock:
            self._calls.append({"kind": "stop"})

    # -- every process -----------------------------------------------------------------------

    def step(self, idle_sleep: float = 0.001) -> bool:
        """One lockstep iteration on every process: the leader's calls, then one engine step.
        Returns whether to go on (work left, or the leader has not stopped)."""
        with self._lock:  # no leader submit lands between the broadcast and the engine step
            calls = self._broadcast(self._calls if self.is_leader else None, self.is_leader)
            self._calls = []
            for call in calls:
                if call["kind"] == "submit" and not self.is_leader:
                    self._submit(call["args"])
                elif call["kind"] == "cancel":
                    self._handles[call["id"]].cancel()
                elif call["kind"] == "stop":
                    self.stopped = True
            busy = self.engine.has_work()
            if busy:
                busy = self.engine.step()
        self.steps += 1
        if not busy:
            time.sleep(idle_sleep)
        return busy or not self.stopped

    def request(self, request_id: str) -> Request:
        """This process's handle of a request (followers read their copies by id)."""
        return self._handles[request_id]

    def _submit(self, args: dict[str, Any]) -> Request:
        kw = dict(args)
        if kw["sampling"] is not None:
            kw["sampling"] = Sampling(**kw["sampling"])
        prompt = kw.pop("prompt")
        request = self.engine.submit(prompt, **kw)
        self._handles[request.id] = request
        return request

    def _require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what}: only the leader (process 0) takes requests")


__all__ = ["Lockstep", "broadcast_json"]
