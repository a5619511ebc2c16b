"""The server's _Waker: a batch of notifications from the engine's thread wakes the event
loop once, and every stream of the batch is woken."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("starlette")

from jax_kv.server.app import _Waker  # noqa: E402


def test_a_batch_of_notifications_wakes_the_loop_once_and_every_stream():
    async def main() -> tuple[int, list[bool], list[bool]]:
        loop = asyncio.get_running_loop()
        scheduled = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal scheduled
            scheduled += 1
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counting
        waker = _Waker(loop)
        events = [asyncio.Event() for _ in range(64)]
        # The engine's delivery: one step's tokens to 64 requests, from its own thread, while
        # the loop is busy (the wake-up runs only once the loop gets back to it).
        thread = threading.Thread(target=lambda: [waker.notify(e) for e in events[:48]])
        thread.start()
        thread.join()
        before = [e.is_set() for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[:48])), 5)
        # A later step's batch schedules its own wake-up.
        thread = threading.Thread(target=lambda: [waker.notify(e) for e in events[48:]])
        thread.start()
        thread.join()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[48:])), 5)
        return scheduled, before, [e.is_set() for e in events]

    scheduled, before, after = asyncio.run(main())
    assert not any(before)  # set on the loop, never from the engine's thread
    assert all(after)
    assert scheduled == 2
