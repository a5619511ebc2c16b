"""The tensor-parallel engine past one process (issue 28, item 4): 2 processes on localhost,
2 host devices each, one global mesh of tp=4 over both on JAX's own runtime (jax.distributed
with a local coordinator, gloo collectives). Each process drives the same engine steps; the
tokens each reads from its own copy of the replicated outputs equal the prompts generated alone
by Generator on one device."""

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
    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_q_heads=8, num_kv_heads=4, hidden_size=128
    )
    model = jm.random_model(config, seed=1)
    alone = Generator(model, arena=EagerArena(), max_len=256)
    prompts = results[0]["prompts"]
    want = [alone.generate([p], 12, stop_tokens=[]).tokens[0] for p in prompts]
    assert results[0]["tokens"] == want
    assert results[1]["tokens"] == want
