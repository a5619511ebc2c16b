"""Lockstep (issue 28, item 4) in one process: a leader and a follower engine joined by a
mailbox standing in for the broadcast. The follower replays the leader's submits and cancels at
the same steps, so both run one schedule: the same tokens, finish reasons and step count.
(tests/parallel/test_multiprocess.py runs it across two processes on jax.distributed.)"""

import pytest

from jax_kv.engine import FINISH_CANCELLED, FINISH_LENGTH, Engine, Lockstep
from jax_kv.memory import EagerArena


class Mailbox:
    def __init__(self):
        self.value = None

    def __call__(self, value, is_source):
        if is_source:
            self.value = value
        return self.value


def test_the_follower_runs_the_leaders_schedule(model, rng):
    box = Mailbox()
    engines = [Engine(model, max_slots=2, max_len=256, prefill_chunk_tokens=32,
                      arena=EagerArena()) for _ in range(2)]  # fmt: skip
    leader = Lockstep(engines[0], broadcast=box, is_leader=True)
    follower = Lockstep(engines[1], broadcast=box, is_leader=False)
    ps = [[int(t) for t in rng.integers(3, 200, n)] for n in (40, 7, 90, 3)]
    first = [leader.submit(p, 10, stop_token_ids=[]) for p in ps[:2]]
    go = True
    while go:
        go_leader, go = leader.step(idle_sleep=0), follower.step(idle_sleep=0)
        assert go_leader == go
        if leader.steps == 2:
            late = [leader.submit(p, 10, stop_token_ids=[]) for p in ps[2:]]
        if leader.steps == 4:
            leader.cancel(late[0])
        if leader.steps > 4 and not engines[0].has_work() and not leader.stopped:
            leader.stop()
    mine = [r.result() for r in [*first, *late]]
    theirs = [follower.request(r.id).result() for r in [*first, *late]]
    assert [c.tokens for c in mine] == [c.tokens for c in theirs]
    assert [c.finish_reason for c in mine] == [c.finish_reason for c in theirs] == [
        FINISH_LENGTH, FINISH_LENGTH, FINISH_CANCELLED, FINISH_LENGTH
    ]  # fmt: skip
    assert leader.steps == follower.steps
    with pytest.raises(RuntimeError, match=r"submit: only the leader \(process 0\)"):
        follower.submit([1, 2], 3)
    for e in engines:
        e.close()
