"""Does a static slice of a parameter stacked over layers cost a copy on the GPU?

At the Qwen2.5-0.5B shape the jitted decode step takes 290 parameter leaves (24 layers of
separate arrays), and jit's per-argument work was about half of the Engine's host time per
step on the CPU (0.47 ms against 0.022 ms at tiny-llama's 21 leaves). Stacking each kind of
weight over the layers ([L, ...], 12 leaves) would cut the dispatch, if XLA feeds `w[i]` (a
static, contiguous slice) to the GEMM without copying it: a copy of every weight each step
would double the step's reads. This probe times three forms of one decode-like chain (per
layer x @ Wqkv, x @ Wo, then the MLP's gate/up and down GEMMs, at the 0.5B shape, M rows):
  separate: one leaf per weight per layer (today's params);
  stacked:  one [L, ...] leaf per kind, read as w[i] with a static i in an unrolled loop;
  scan:     the same stacked leaves under lax.scan (a dynamic slice per layer);
and prints, per form: device time per call (median of REPEAT calls, each after a sync),
host dispatch time per call (the Python call's own time, async), the number of parameter
leaves, and how many copy / dynamic-slice fusions the optimized HLO holds.

    python3 bench/experiments/stacked_params.py [M=128] [L=24]
"""

import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

M = int(sys.argv[1]) if len(sys.argv) > 1 else 128
L = int(sys.argv[2]) if len(sys.argv) > 2 else 24
HIDDEN, QKV, FFN = 896, 896 + 2 * 128, 4864  # Qwen2.5-0.5B: 14 q heads, 2 kv heads of 64
REPEAT = 20
SHAPES = {
    "wqkv": (HIDDEN, QKV),
    "wo": (HIDDEN, HIDDEN),
    "wgu": (HIDDEN, 2 * FFN),
    "wd": (FFN, HIDDEN),
}


def layer(x, w):
    x = x * jax.lax.rsqrt(
        jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
    ).astype(x.dtype)
    h = x + (x @ w["wqkv"])[:, :HIDDEN] @ w["wo"]
    gu = h @ w["wgu"]
    return h + (jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:]) @ w["wd"]


def separate(params, x):
    for w in params:
        x = layer(x, w)
    return x


def stacked(params, x):
    for i in range(L):
        x = layer(x, {k: v[i] for k, v in params.items()})
    return x


def scanned(params, x):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, params)[0]


def main() -> None:
    rng = np.random.default_rng(0)
    per_layer = [
        {
            k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, jnp.bfloat16)
            for k, s in SHAPES.items()
        }
        for _ in range(L)
    ]
    stack = {k: jnp.stack([w[k] for w in per_layer]) for k in SHAPES}
    x = jnp.asarray(rng.standard_normal((M, HIDDEN), np.float32), jnp.bfloat16)
    weight_bytes = sum(int(np.prod(s)) * 2 for s in SHAPES.values()) * L
    print(f"{jax.devices()[0].device_kind}; M {M}, L {L}, weights {weight_bytes / 2**20:.0f} MiB")
    reference = None
    for name, fn, params in (
        ("separate", separate, per_layer),
        ("stacked", stacked, stack),
        ("scan", scanned, stack),
    ):
        step = jax.jit(fn)
        hlo = step.lower(params, x).compile().as_text()
        copies = len(re.findall(r"= \S+ copy\(", hlo))
        dyn = len(re.findall(r"dynamic-slice", hlo))
        slices = len(re.findall(r"= \S+ slice\(", hlo))
        out = step(params, x).block_until_ready()
        if reference is None:
            reference = np.asarray(out, np.float32)
        gap = float(np.max(np.abs(np.asarray(out, np.float32) - reference)))
        device, host = [], []
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            y = step(params, x)
            t1 = time.perf_counter()
            y.block_until_ready()
            device.append(time.perf_counter() - t0)
            host.append(t1 - t0)
        leaves = len(jax.tree_util.tree_leaves(params))
        print(
            f"{name:9s} leaves {leaves:4d}  call {statistics.median(device) * 1e3:7.3f} ms  "
            f"dispatch {statistics.median(host) * 1e3:6.3f} ms  copies {copies:3d}  "
            f"slices {slices:3d}  dynamic-slices {dyn:3d}  max |diff| {gap:.3g}  "
            f"read {weight_bytes / statistics.median(device) / 1e12:.2f} TB/s"
        )


if __name__ == "__main__":
    main()
