"""What JAX's dispatch of one jitted call costs the host, by the call's arguments and outputs.

The Engine's decode step at Qwen2.5-0.5B's shape takes ~230 arrays (24 layers' 7 weights, 48
donated K/V caches, the inputs) and returns ~52; under cProfile on the H100 the step's and the
picker's dispatch took 0.67 ms a call, the host's largest item at 0.5B. This times the return
of a call (its dispatch, not its work: each call's device work is one tiny kernel per array)
for N input arrays (plain or donated) and M outputs, so the per-array cost is known before the
step's arguments are cut.

    python3 bench/experiments/dispatch_cost.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, args, donated, calls=400):
    """Median seconds from a call to its return (dispatch), the device kept busy by nothing
    else: each call's outputs are waited for before the next."""
    times = []
    for i in range(calls + 20):
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        if donated:
            args = (args[0], out[1])
        if i >= 20:
            times.append(t1 - t0)
    return float(np.median(times))


def main():
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| inputs | donated | outputs | dispatch us | us per input |")
    print("|---|---|---|---|---|")
    for n in (1, 64, 128, 256):
        for donate in (False, True):
            half = max(1, n // 2)
            weights = [jnp.full((16, 16), i, jnp.float32) for i in range(n - half)]
            caches = [jnp.zeros((16, 16), jnp.float32) for _ in range(half)]

            def step(weights, caches):
                s = sum((w[0, 0] for w in weights), jnp.float32(0))
                return s, [c.at[0, 0].add(s) for c in caches]

            fn = jax.jit(step, donate_argnums=(1,) if donate else ())
            us = timed(fn, (weights, caches), donate) * 1e6
            print(f"| {n} | {half if donate else 0} | {1 + half} | {us:.0f} | {us / n:.2f} |")


if __name__ == "__main__":
    main()
