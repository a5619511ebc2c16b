"""Where a decode token's time goes: device kernels, launches and host work, per XLA flag set.

    python bench/step_profile.py --out DIR [--model qwen2.5-0.5b] [--batch 1] [--tokens 64]
        [--impls jax_kv-seq,plain-jax] [--variants default,cmdbuf-min1,cmdbuf-off]

Each (variant, impl) runs in its own process (XLA reads XLA_FLAGS once, at backend start). A
child warms the loop up, times `--tokens` tokens without a profiler (wall per token), then
records the same loop under `jax.profiler.trace` (Python tracer off) and reads the XSpace back
with `jax.profiler.ProfileData`: device events per token, device-busy time per token (the
union of kernel intervals), and the host threads' events ranked by total time. The XLA
optimized HLO is dumped per variant so the command buffers can be counted. Prints one table,
writes DIR/step_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "default": "",
    "cmdbuf-min1": "--xla_gpu_graph_min_graph_size=1",
    "cmdbuf-off": "--xla_gpu_enable_command_buffer=",
    "cmdbuf-while": "--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer="
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}
# (The "+kN" variants, JAX_KV_DECODE_KERNEL=N, went with that variable in issue 20; the "+mv"
# variants of the CUDA matvec are on branch cuda-matvec.)


MAX_GAP_NS = 20_000


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals: device time with any kernel running."""
    total, end = 0, -1
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def device_kernels(data) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every kernel or copy on the GPU streams of a ProfileData."""
    out = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                # XLA Ops / XLA Modules lines repeat the stream's kernels at another level.
                if line.name.startswith("Stream"):
                    for e in line.events:
                        out.append((int(e.start_ns), int(e.start_ns + e.duration_ns), e.name))
    return out


def summarize(xplane: str, tokens: int) -> dict:
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    host, host_n, kernels = collections.Counter(), collections.Counter(), collections.Counter()
    events = device_kernels(data)
    device = [(s, e) for s, e, _ in events]
    names = [name[:110] for _, _, name in events]
    for (s, e), name in zip(device, names, strict=True):
        kernels[name] += e - s
    for plane in data.planes:
        if plane.name == "/host:CPU":
            for line in plane.lines:
                if line.name == "python":
                    continue
                for e in line.events:
                    host[e.name[:70]] += int(e.duration_ns)
                    host_n[e.name[:70]] += 1
    span = (max(e for _, e in device) - min(s for s, _ in device)) if device else 0
    # Idle device time before each kernel, charged to that kernel: a launch gap inside one
    # graph is a microsecond or two, so gaps over MAX_GAP_NS (host syncs between calls) are
    # left out. Tells whether a node kind (an FFI call's captured child graph, a memset) pays
    # more to start than an XLA fusion.
    gaps = collections.Counter()
    order = sorted(range(len(device)), key=lambda i: device[i][0])
    for prev, cur in itertools.pairwise(order):
        gap = device[cur][0] - device[prev][1]
        if 0 < gap <= MAX_GAP_NS:
            gaps[names[cur]] += gap
    return dict(
        device_events_per_token=len(device) / tokens,
        device_busy_us_per_token=_busy_ns(device) / tokens / 1e3,
        device_span_us_per_token=span / tokens / 1e3,
        top_kernels_us_per_token={k: v / tokens / 1e3 for k, v in kernels.most_common(40)},
        launch_gap_us_per_token=sum(gaps.values()) / tokens / 1e3,
        top_gaps_us_per_token={k: v / tokens / 1e3 for k, v in gaps.most_common(12)},
        top_host_us_per_token={
            k: [round(v / tokens / 1e3, 2), host_n[k] / tokens] for k, v in host.most_common(25)
        },
    )


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kv.models as jm
    from jax_kv.decode import Generator
    from jax_kv.layout import Layout

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from generate import call_options, plain_jax_loop

    config = jm.preset(args.model)
    model = jm.random_model(config, seed=0, dtype=jnp.bfloat16)
    model.fuse_projections()  # as the Generator does; the plain loop gets the same params
    prompts = (
        np.random.default_rng(0)
        .integers(3, config.vocab_size, (args.batch, args.prompt))
        .astype(np.int32)
    )
    n = args.tokens
    extra: dict = {}
    if args.impl.startswith("jax_kv"):
        per_call = args.impl.partition("@")[2]
        gen = Generator(model, layout=Layout.SEQ_MAJOR, **call_options(per_call))

        def loop():
            r = gen.generate(prompts.tolist(), n + 1, stop_tokens=())
            extra.update(
                host_overhead_us=r.stats.host_overhead_us,
                dispatch_us=r.stats.dispatch_us,
                captures=r.stats.captures,
                host_calls=r.stats.host_calls_per_step[:6] if r.stats.host_calls_per_step else None,
            )
            return r.stats.decode_seconds
    else:
        step, state0 = plain_jax_loop(model, prompts, 4096)
        holder = [step(*state0)]
        np.asarray(holder[0][0])

        def loop():
            t0 = time.perf_counter()
            state = holder[0]
            dispatch = []
            for _ in range(n):
                t = time.perf_counter()
                state = step(*state)
                dispatch.append(time.perf_counter() - t)
                np.asarray(state[0])
            holder[0] = state
            extra["dispatch_us"] = float(np.median(dispatch) * 1e6)
            return time.perf_counter() - t0

    loop()  # compile and warm
    wall = min(loop() for _ in range(3))
    out = dict(wall_us_per_token=wall / n * 1e6, tok_s=args.batch * n / wall, **extra)
    with tempfile.TemporaryDirectory() as d:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        with jax.profiler.trace(d, profiler_options=opts):
            loop()
        xplane = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        out.update(summarize(xplane[0], n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--impls", default="jax_kv-seq,plain-jax")
    ap.add_argument("--variants", default="default,cmdbuf-min1,cmdbuf-off")
    ap.add_argument("--runs", help="variant:impl pairs, instead of variants x impls")
    ap.add_argument("--impl", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    if args.impl:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.runs:
        pairs = [tuple(r.split(":")) for r in args.runs.split(",")]
    else:
        pairs = [(v, i) for v in args.variants.split(",") for i in args.impls.split(",")]
    plan: dict[str, list[str]] = {}
    for variant, impl in pairs:
        plan.setdefault(variant, []).append(impl)
    for variant, impls in plan.items():
        dump = args.out / f"hlo-{variant}"
        for impl in impls:
            if variant not in VARIANTS:
                raise SystemExit(f"variant {variant}: expected one of {sorted(VARIANTS)}")
            flags = VARIANTS[variant]
            if impl == impls[0]:
                flags += f" --xla_dump_to={dump}"
            env = dict(os.environ, XLA_FLAGS=flags.strip())
            cmd = [sys.executable, __file__, "--out", str(args.out), "--impl", impl]
            cmd += ["--model", args.model, "--batch", str(args.batch)]
            cmd += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            row = dict(variant=variant, impl=impl, flags=flags)
            if lines:
                row.update(json.loads(lines[-1][7:]))
            else:
                row["error"] = (p.stderr or p.stdout)[-1500:]
            rows.append(row)
            print(f"--- {variant} {impl} ({time.perf_counter() - t0:.0f} s)")
            print(json.dumps(row, indent=1)[:4000], flush=True)
        # The decode steps only: jax_kv's jitted step is `counted`, the plain loop's `step`.
        files = glob.glob(f"{dump}/*jit_counted*after_optimizations.txt")
        files += glob.glob(f"{dump}/*jit_step*after_optimizations.txt")
        counts = {}
        for f in files:
            text = pathlib.Path(f).read_text()
            counts[pathlib.Path(f).name[:90]] = dict(
                command_buffers=text.count("command_buffer"),
                fusions=text.count(" fusion("),
                custom_calls=text.count("custom-call("),
            )
        print(f"HLO {variant}: {json.dumps(counts, indent=1)}")
        # Keep the largest decode-step module (the one-token step) at the top of --out and
        # drop the rest of the dump (hundreds of files).
        if files:
            decode = [f for f in files if "jax_kv_gqa_decode" in pathlib.Path(f).read_text()]
            biggest = max(decode or files, key=lambda f: pathlib.Path(f).stat().st_size)
            shutil.copy(biggest, args.out / f"hlo-{variant}.txt")
        shutil.rmtree(dump, ignore_errors=True)
        rows.append(dict(variant=variant, hlo=counts))
    (args.out / "step_profile.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{args.model} B={args.batch}, {args.tokens} tokens, bf16 random weights")
    print(
        "| variant | impl | tok/s | wall us/tok | busy us/tok | launch gaps us/tok | events/tok"
        " | dispatch us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "impl" in r and "error" not in r:
            print(
                f"| {r['variant']} | {r['impl']} | {r['tok_s']:.0f} | {r['wall_us_per_token']:.0f}"
                f" | {r['device_busy_us_per_token']:.0f} | {r['launch_gap_us_per_token']:.0f}"
                f" | {r['device_events_per_token']:.0f}"
                f" | {r.get('dispatch_us', float('nan')):.0f} |"
            )


if __name__ == "__main__":
    main()
