"""One process of a multi-process tensor-parallel engine run (issue 28, item 4): run as
`python multiprocess_engine.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON`, each process with 2 host
devices (XLA_FLAGS), one global mesh of tp = 2 x NUM_PROCESSES over them, on JAX's own runtime
(jax.distributed, gloo collectives on CPU).

The leader (process 0) takes the requests through `Lockstep`: two at the start, two after
three steps, and a cancel of the third after six; followers only step. Each process writes the
tokens and finish reasons it read from its own copies of the replicated outputs."""

import dataclasses
import json
import sys

import jax
import numpy as np

import jax_kv.models as jm
from jax_kv.engine import Engine, Lockstep
from jax_kv.memory import EagerArena
from jax_kv.parallel import tp_mesh

CONFIG = dict(num_q_heads=8, num_kv_heads=4, hidden_size=128)
NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 70, 1, 33)]


def main() -> None:
    process_id, num_processes, port, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                            sys.argv[4])  # fmt: skip
    # Before any computation: JAX's backends start on first use, across the processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes, process_id)
    model = jm.random_model(dataclasses.replace(jm.PRESETS["tiny-llama"], **CONFIG), seed=1)
    mesh = tp_mesh(jax.device_count())  # every process's devices
    eng = Engine(model, max_slots=3, max_len=256, prefill_chunk_tokens=64, arena=EagerArena(),
                 mesh=mesh)  # fmt: skip
    lock = Lockstep(eng)
    ps, ids = prompts(), [f"r{i}" for i in range(4)]
    if lock.is_leader:
        for i in (0, 1):
            lock.submit(ps[i], NEW_TOKENS, stop_token_ids=[], request_id=ids[i])
    while True:
        go = lock.step()
        if lock.is_leader:
            if lock.steps == 3:
                for i in (2, 3):
                    lock.submit(ps[i], NEW_TOKENS, stop_token_ids=[], request_id=ids[i])
            if lock.steps == 6:
                lock.cancel(lock.request(ids[2]))
            if lock.steps > 6 and not eng.has_work() and not lock.stopped:
                lock.stop()
        if not go:
            break
    done = [lock.request(i).result() for i in ids]
    result = dict(
        process=jax.process_index(), devices=jax.device_count(),
        local_devices=jax.local_device_count(), steps=lock.steps,
        tokens=[c.tokens for c in done], finish=[c.finish_reason for c in done],
    )  # fmt: skip
    eng.close()
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
