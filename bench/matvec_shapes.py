"""Runs each decode projection of a model shape at B=1 through `matvec` and `xla_matvec`, a few
times each, for a kernel profiler to read:

    ncu --clock-control none -k regex:"Matvec|reduce" --launch-skip 8 --launch-count 8 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 bench/matvec_shapes.py --model qwen2.5-0.5b

or, with --time, under JAX's profiler: the device time of each implementation's kernels per
call (their sum: XLA runs the norm, the dot and the epilogue as several kernels), the weight
bytes over it, printed as a table and saved as JSON (--out). The timed calls cycle through
copies of w that together pass L2 (>= 128 MB), so each call reads its weights from DRAM as a
decode step does (there the other layers' weights evict them).

The projections are the models' fused forms: attn_norm + q/k/v (+ bias), o + residual,
mlp_norm + gate/up + SwiGLU, down + residual; random bf16 weights of the preset's shape.
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv.ops.matvec import matvec, xla_matvec

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from step_profile import device_kernels  # noqa: E402


def projections(config) -> dict[str, tuple[int, int, dict]]:
    """name -> (rows of w, K, keyword arguments) of one layer's four projections."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
    o_in = config.num_q_heads * config.head_dim
    return {
        "qkv+norm": (qkv, h, dict(norm=True)),
        "o+residual": (h, o_in, dict(residual=True)),
        "gate_up+norm+swiglu": (2 * i, h, dict(norm=True, activation="swiglu")),
        "down+residual": (h, i, dict(residual=True)),
    }


L2_PASS_BYTES = 128 << 20


def device_us_per_call(fn, x, ws, g, r, calls: int) -> tuple[float, list[str]]:
    """Device time per call of fn's kernels (sum of kernel durations / calls) and their names;
    call i reads ws[i % len(ws)]."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(x, ws[0], g, r))  # compiled and warm outside the trace
    # Writing 2 x L2_PASS_BYTES evicts the copies of w that making them left in L2.
    jax.block_until_ready(jnp.ones((L2_PASS_BYTES // 2,), jnp.float32))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(calls):
                y = fn(x, ws[i % len(ws)], g, r)
            jax.block_until_ready(y)
        data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    events = device_kernels(data)
    total = sum(e - s for s, e, _ in events)
    names = {name[:60] for _, _, name in events}
    return total / calls / 1e3, sorted(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="preset(s), comma-separated")
    ap.add_argument("--calls", type=int, default=12, help="calls of each projection and impl")
    ap.add_argument("--time", action="store_true", help="device time per call (JAX profiler)")
    ap.add_argument("--out", type=pathlib.Path, help="folder for matvec_shapes.json (--time)")
    args = ap.parse_args()
    rows = []
    for model in args.model.split(","):
        config = jm.preset(model)
        rng = np.random.default_rng(0)
        for name, (W, K, kw) in projections(config).items():
            act = kw.get("activation")
            N = W // 2 if act else W
            x = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((W, K)) / np.sqrt(K), jnp.bfloat16)
            g = jnp.asarray(rng.standard_normal(K), jnp.bfloat16) if kw.get("norm") else None
            r = (
                jnp.asarray(rng.standard_normal((1, N)), jnp.bfloat16)
                if kw.get("residual")
                else None
            )
            row = dict(model=model, projection=name, w=[W, K], weight_bytes=W * K * 2)
            for impl in (matvec, xla_matvec):
                fn = jax.jit(
                    lambda x, w, g, r, impl=impl, act=act: impl(
                        x, w, norm=g, activation=act, residual=r
                    )
                )
                if args.time:
                    copies = -(-L2_PASS_BYTES // row["weight_bytes"])
                    ws = [w] + [jnp.array(w, copy=True) for _ in range(copies - 1)]
                    us, kernels = device_us_per_call(fn, x, ws, g, r, args.calls)
                    row[impl.__name__] = dict(us=us, kernels=kernels)
                else:
                    for _ in range(args.calls):
                        y = fn(x, w, g, r)
                    jax.block_until_ready(y)
                    print(f"{name:22s} {impl.__name__:10s} w {W}x{K} -> y {tuple(y.shape)}")
            rows.append(row)
    if not args.time:
        return
    print(f"device us per call, {jax.devices()[0].device_kind}, bf16, B=1, {args.calls} calls")
    print("| model | projection | w | matvec us | GB/s | XLA us | GB/s | XLA / matvec |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        a, b = row["matvec"]["us"], row["xla_matvec"]["us"]
        gb_a, gb_b = (row["weight_bytes"] / us / 1e3 if us else float("nan") for us in (a, b))
        print(
            f"| {row['model']} | {row['projection']} | {row['w'][0]}x{row['w'][1]} | {a:.2f} |"
            f" {gb_a:.0f} | {b:.2f} | {gb_b:.0f} | {b / a if a else float('nan'):.2f} |"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "matvec_shapes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
