"""One process of a multi-process tensor-parallel engine run (issue 28, item 4): run as
`python multiprocess_engine.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON`, each process with 2 host
devices (XLA_FLAGS), one global mesh of tp = 2 x NUM_PROCESSES over them, on JAX's own runtime
(jax.distributed, gloo collectives on CPU). Every process runs the same engine steps on the same
requests (the followers' view of a leader's broadcast schedule); each writes the tokens it read
from its own copy of the replicated outputs."""

import json
import sys

import jax

process_id, num_processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes, process_id)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import jax_kv.models as jm  # noqa: E402
from jax_kv.engine import Engine  # noqa: E402
from jax_kv.memory import EagerArena  # noqa: E402
from jax_kv.parallel import tp_mesh  # noqa: E402


def main() -> None:
    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_q_heads=8, num_kv_heads=4, hidden_size=128
    )
    model = jm.random_model(config, seed=1)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 70, 1, 33)]
    mesh = tp_mesh(jax.device_count())  # every process's devices
    with Engine(model, max_slots=3, max_len=256, prefill_chunk_tokens=64, arena=EagerArena(),
                mesh=mesh) as eng:  # fmt: skip
        reqs = [eng.submit(p, 12, stop_token_ids=[]) for p in prompts]
        eng.run_until_idle()
        result = dict(
            process=jax.process_index(),
            devices=jax.device_count(),
            local_devices=jax.local_device_count(),
            tokens=[r.result().tokens for r in reqs],
            prompts=prompts,
        )
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
