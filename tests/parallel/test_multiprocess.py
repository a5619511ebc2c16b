"""The tensor-parallel engine past one process (issue 28, item 4): 2 processes on localhost,
2 host devices each, one global mesh of tp=4 over both on JAX's own runtime (jax.distributed
with a local coordinator, gloo collectives). The leader takes the requests (and a cancel) and
broadcasts them each step (Lockstep); the follower only steps. Both run the same number of
steps and read the same tokens and finish reasons, which equal the prompts generated alone by
Generator on one device."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.memory import EagerArena

WORKER = Path(__file__).with_name("multiprocess_engine.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_tp_4_over_two_processes_gives_the_one_device_tokens(tmp_path):
    port = free_port()
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    outs = [tmp_path / f"process_{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), "2", str(port), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(x[-3000:] for x in logs)
    results = [json.loads(o.read_text()) for o in outs]
    assert [(r["process"], r["devices"], r["local_devices"]) for r in results] == [
        (0, 4, 2), (1, 4, 2)
    ]  # fmt: skip
    sys.path.insert(0, str(WORKER.parent))
    try:
        from multiprocess_engine import CONFIG, NEW_TOKENS, prompts
    finally:
        sys.path.pop(0)
    model = jm.random_model(dataclasses.replace(jm.PRESETS["tiny-llama"], **CONFIG), seed=1)
    alone = Generator(model, arena=EagerArena(), max_len=256)
    want = [alone.generate([p], NEW_TOKENS, stop_tokens=[]).tokens[0] for p in prompts()]
    leader, follower = results
    assert leader["steps"] == follower["steps"]  # one schedule
    assert leader["finish"] == follower["finish"] == ["length", "length", "cancelled", "length"]
    assert leader["tokens"] == follower["tokens"]
    for i in (0, 1, 3):
        assert leader["tokens"][i] == want[i], i
    assert leader["tokens"][2] == want[2][: len(leader["tokens"][2])]  # cut short, not wrong
