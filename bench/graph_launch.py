"""What one XLA command-buffer (CUDA graph) execution costs the host, by graph size and by
whether the step's buffers keep their addresses from call to call.

    python bench/graph_launch.py --out DIR [--layers 32,128,256] [--calls 200]

A synthetic step of `layers` x (gemv + elementwise) on [1, 512] bf16, jitted with its state
donated. Variants: `aliased` (every output is a donated input's buffer: addresses never
change), `fresh` (one extra output allocated per call: its address alternates), each run
synchronously (block per call) and pipelined (one call in flight). Per variant: median wall
per call, and from a profiler trace the host time per call inside `cuGraphLaunch`,
`command_buffer::update` and `command_buffer::execute`, and device events per call.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

WATCH = ("cuGraphLaunch", "command_buffer::update", "command_buffer::execute", "PjitFunction")


def host_events(xplane: str, calls: int) -> dict:
    from jax.profiler import ProfileData

    total, count, device = collections.Counter(), collections.Counter(), 0
    for plane in ProfileData.from_file(xplane).planes:
        for line in plane.lines:
            if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                device += sum(1 for _ in line.events)
            elif plane.name == "/host:CPU":
                for e in line.events:
                    for w in WATCH:
                        if e.name.startswith(w):
                            total[w] += e.duration_ns
                            count[w] += 1
    out = {w: round(total[w] / calls / 1e3, 1) for w in WATCH}
    out.update({f"{w} per call": count[w] / calls for w in WATCH})
    out["device_events_per_call"] = device / calls
    return out


def run(layers: int, fresh: bool, pipelined: bool, calls: int) -> dict:
    key = jax.random.key(0)
    ws = jax.random.normal(key, (layers, 512, 512), jnp.bfloat16) * 0.04

    def step(ws, x, count):
        for i in range(layers):
            x = jnp.tanh(x @ ws[i]) * 1.01 + 0.001  # keeps values O(1) over many layers
        out = (x, count + 1)
        return out + (x.sum(),) if fresh else out

    f = jax.jit(step, donate_argnums=(1, 2))
    state = (jnp.ones((1, 512), jnp.bfloat16), jnp.zeros((), jnp.int32))

    def loop(n):
        nonlocal state
        t0, pending = time.perf_counter(), None
        for _ in range(n):
            out = f(ws, *state)
            state = out[:2]
            if not pipelined:
                np.asarray(out[-1])
            elif fresh:  # read one call late, as the Generator does
                if pending is not None:
                    np.asarray(pending)
                pending = out[2]
            # pipelined + aliased: nothing to read (every output is donated to the next call)
        np.asarray(state[1])
        return (time.perf_counter() - t0) / n

    loop(20)
    wall = float(np.median([loop(calls // 4) for _ in range(4)]))
    with tempfile.TemporaryDirectory() as d:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        with jax.profiler.trace(d, profiler_options=opts):
            loop(calls)
        xplane = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        events = host_events(xplane, calls)
    return dict(layers=layers, fresh=fresh, pipelined=pipelined, wall_us=wall * 1e6, **events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--layers", default="32,128,256")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        for fresh in (False, True):
            for pipelined in (False, True):
                r = run(layers, fresh, pipelined, args.calls)
                rows.append(r)
                print(json.dumps(r), flush=True)
    (args.out / "graph_launch.json").write_text(json.dumps(rows, indent=2))
    print(
        "\n| layers | outputs | mode | device events/call | wall us/call | cuGraphLaunch us |"
        " update us | execute us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layers']} | {'fresh' if r['fresh'] else 'aliased'} | "
            f"{'pipelined' if r['pipelined'] else 'sync'} | {r['device_events_per_call']:.0f} | "
            f"{r['wall_us']:.0f} | {r['cuGraphLaunch']} | {r['command_buffer::update']} | "
            f"{r['command_buffer::execute']} |"
        )


if __name__ == "__main__":
    main()
