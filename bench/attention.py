"""GQA decode and prefill on the GPU: jax_kv vs cuDNN (jax.nn.dot_product_attention) vs XLA
masked attention, device time inside one jitted lax.fori_loop, median of repeats.

bf16, Hq=32, Hkv=8, D=128, both cache layouts (the comparators read [B, S, Hkv, D] in both
rows: cuDNN takes no other layout). Prints the tables and writes attention.json (GPU name, jax
version, git commit) and attention.png (achieved live-KV GB/s per row) under --out.
--decode-kernel takes a comma list of decode kernel choices to time in the same run, beside the
same cuDNN and XLA measurements (gqa_decode's `_kernel` and `_cta_shape` test hooks): auto (what
the library runs: the tensor-core kernel mma here, keys jax_kv_<LAYOUT>), simt (the CUDA-core
kernel forced: jax_kv_simt_<LAYOUT>), mma, and any of them with a CTA shape forced: simt-narrow,
mma-wide, ... (jax_kv_simt-narrow_<LAYOUT>, ...), and any of those with the split count fixed
(`_splits`): auto@16 is the batch-invariant mode's plan (jax_kv_auto@16_<LAYOUT>).
--prefill-kernel likewise: auto, mma.

    python bench/attention.py --out /tmp/bench --decode-kernel auto,simt,mma-narrow,auto@16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_kv import Layout, gqa_decode, gqa_prefill
from jax_kv.ops._common import CTA_SHAPES, DECODE_KERNELS, PREFILL_KERNELS

HQ, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16
DECODE_ROWS = [  # (B, S, live)
    (1, 4096, 4096),
    (1, 32768, 32768),
    (1, 131072, 131072),
    (1, 32768, 4096),
    (8, 8192, 8192),
    (32, 8192, 8192),
    (64, 4096, 1024),
    (128, 2048, 2048),
]
PREFILL_ROWS = [(1024, 0), (4096, 0), (16384, 0), (512, 8192)]  # (T, past), B = 1
REPEATS = 5
# One timed call holds about this much kernel time: the call's own cost (dispatch, launch,
# the host's wait for the result: `call_overhead_s` in the JSON) then adds < 5% to a step.
# Before this, prefill rows at T >= 4096 ran 2 iterations a call and carried half of it each.
CALL_SECONDS = 0.02


def iterations(estimate_s: float, lo: int, hi: int) -> int:
    """Iterations per timed call: the power of two nearest CALL_SECONDS / estimate_s, clamped to
    [lo, hi] (powers of two, so a multiple of the decode loop's unroll of 8)."""
    n = 2 ** round(math.log2(max(CALL_SECONDS / estimate_s, 1.0)))
    return max(lo, min(hi, n))


def in_layout(x_bshd: jax.Array, layout: Layout) -> jax.Array:
    """A [B, S, Hkv, D] array in `layout`'s axis order (the comparators read BSHD)."""
    return jnp.transpose(x_bshd, ["BSHD".index(a) for a in layout.axes])


def time_loop(step: Callable, carry, consts, iters: int, unroll: int) -> tuple[float, float]:
    """(median seconds per step, compile seconds) of `iters` steps `carry = step(carry, consts)`
    in one jitted fori_loop. Arrays go in as arguments: closed-over arrays would become XLA
    constants (constant-folded at compile time, not read like a cache)."""
    # The carry is donated and chained call to call: caches stay in place, no copy per call.
    carry = jax.tree.map(jnp.copy, carry)
    loop = jax.jit(
        lambda c, x: lax.fori_loop(0, iters, lambda _, c: step(c, x), c, unroll=unroll),
        donate_argnums=0,
    )
    t0 = time.perf_counter()
    compiled = loop.lower(carry, consts).compile()
    compile_s = time.perf_counter() - t0
    carry = jax.block_until_ready(compiled(carry, consts))  # warm-up
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(compiled(carry, consts))
        times.append(time.perf_counter() - t0)
    del carry
    return statistics.median(times) / iters, compile_s


def call_overhead() -> float:
    """Median wall seconds of one call of a jitted one-iteration loop over a tiny carry: what
    every timed call pays besides its kernels, divided by its iterations in each figure."""
    return time_loop(lambda c, x: c + x, jnp.zeros((8,), jnp.float32), jnp.float32(1), 1, 1)[0]


def guarded(fn: Callable) -> tuple[float | None, str | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - a comparator that cannot run is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def rand(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(DTYPE)


# --- decode -------------------------------------------------------------------------------


def xla_decode(q, k, v, n):
    """Masked attention over all S slots, f32 softmax: the plain-JAX static-cache step."""
    B, S = k.shape[:2]
    qg = q.reshape(B, HKV, HQ // HKV, D)
    s = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(D))
    mask = jnp.arange(S)[None, :] < n[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(DTYPE)
    return jnp.einsum("bhgs,bshd->bhgd", p, v).reshape(B, HQ, D)


KERNEL_SPECS = tuple(
    k + ("" if c == "auto" else f"-{c}") for k in DECODE_KERNELS for c in CTA_SHAPES
)


def decode_key(kernel: str, layout: Layout) -> str:
    """Row key of jax_kv's time with decode kernel spec `kernel` ("auto" keeps the plain key)."""
    return f"jax_kv_{layout.name}" if kernel == "auto" else f"jax_kv_{kernel}_{layout.name}"


def decode_hooks(kernel: str) -> dict[str, str | int]:
    """gqa_decode's test hooks of kernel spec `kernel` (a KERNEL_SPECS entry, then optionally
    @n): "simt-wide" -> _kernel="simt", _cta_shape="wide"; "auto@16" -> _splits=16 too."""
    spec, _, splits = kernel.partition("@")
    name, _, shape = spec.partition("-")
    return dict(_kernel=name, _cta_shape=shape or "auto", _splits=int(splits or 0))


def bad_kernel_spec(kernel: str) -> bool:
    """Whether `kernel` is not KERNEL_SPECS entry[@n] with 1 <= n <= 256."""
    spec, at, splits = kernel.partition("@")
    fixed_ok = splits.isdigit() and 0 < int(splits) <= 256
    return spec not in KERNEL_SPECS or (bool(at) and not fixed_ok)


def bench_decode(B, S, live, iters, kernels=("auto",)):
    keys = jax.random.split(jax.random.key(B * 7 + S), 6)
    q = rand(keys[0], (B, HQ, D))
    k_new, v_new = rand(keys[1], (B, HKV, D)), rand(keys[2], (B, HKV, D))
    lengths = jnp.full((B,), live - 1, jnp.int32)  # the new token makes `live` attended
    kv_seq = jnp.full((B,), live, jnp.int32)
    row = {"B": B, "S": S, "live": live, "iters": iters}
    bytes_live = B * live * HKV * D * 2 * 2
    k_bshd, v_bshd = rand(keys[3], (B, S, HKV, D)), rand(keys[4], (B, S, HKV, D))

    consts = (k_new, v_new, lengths)
    ours = []
    for kernel in kernels:
        hooks = decode_hooks(kernel)
        for layout in Layout:
            kc, vc = in_layout(k_bshd, layout), in_layout(v_bshd, layout)

            def step(c, x, layout=layout, hooks=hooks):
                q, kc, vc = c
                k_new, v_new, lengths = x
                return gqa_decode(q, k_new, v_new, kc, vc, lengths, layout=layout, **hooks)

            key = decode_key(kernel, layout)
            ours.append(key)
            t, err = guarded(lambda c=(q, kc, vc), f=step: time_loop(f, c, consts, iters, 8))
            row[key] = None if t is None else t[0]
            row[f"compile_{key}"] = None if t is None else t[1]
            if err:
                row[f"error_{key}"] = err

    def cudnn_step(q, x):
        k, v, n = x
        out = jax.nn.dot_product_attention(
            q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn"
        )
        return out[:, 0]

    consts = (k_bshd, v_bshd, kv_seq)
    t, err = guarded(lambda: time_loop(cudnn_step, q, consts, iters, 8)[0])
    row["cudnn"], row["error_cudnn"] = t, err
    t, err = guarded(lambda: time_loop(lambda q, x: xla_decode(q, *x), q, consts, iters, 8)[0])
    row["xla"], row["error_xla"] = t, err
    for name in (*ours, "cudnn", "xla"):
        row[f"gbps_{name}"] = None if row[name] is None else bytes_live / row[name] / 1e9
    return row


# --- prefill ------------------------------------------------------------------------------


def xla_prefill(q, k, v, past):
    """Masked causal attention with f32 scores: [B, Hkv, G, T, S] materialised."""
    B, T = q.shape[:2]
    S = k.shape[1]
    qg = q.reshape(B, T, HKV, HQ // HKV, D)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(D))
    mask = jnp.arange(S)[None, :] <= (past + jnp.arange(T))[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(DTYPE)
    return jnp.einsum("bhgts,bshd->bthgd", p, v).reshape(B, T, HQ, D)


def prefill_key(kernel: str, layout: Layout) -> str:
    """Row key of jax_kv's prefill time with prefill kernel `kernel` ('auto' keeps the old key)."""
    return f"jax_kv_{layout.name}" if kernel == "auto" else f"jax_kv_{kernel}_{layout.name}"


def bench_prefill(T, past, iters, kernels=("auto",)):
    keys = jax.random.split(jax.random.key(T + past), 6)
    S = past + T
    q = rand(keys[0], (1, T, HQ, D))
    k_new, v_new = rand(keys[1], (1, T, HKV, D)), rand(keys[2], (1, T, HKV, D))
    lengths = jnp.asarray([past], jnp.int32)
    pairs = T * past + T * (T + 1) // 2
    flops = 4 * HQ * D * pairs  # QK^T and PV, causal pairs only
    row = {"T": T, "past": past, "flops": flops, "iters": iters}
    k_bshd, v_bshd = rand(keys[3], (1, S, HKV, D)), rand(keys[4], (1, S, HKV, D))
    k_bshd = k_bshd.at[:, past:].set(k_new)
    v_bshd = v_bshd.at[:, past:].set(v_new)

    consts = (k_new, v_new, lengths)
    for kernel, layout in ((k, lay) for k in kernels for lay in Layout):
        kc, vc = in_layout(k_bshd, layout), in_layout(v_bshd, layout)

        def step(c, x, layout=layout, kernel=kernel):
            q, kc, vc = c
            k_new, v_new, lengths = x
            return gqa_prefill(q, k_new, v_new, kc, vc, lengths, layout=layout, _kernel=kernel)

        key = prefill_key(kernel, layout)
        t, err = guarded(lambda c=(q, kc, vc), f=step: time_loop(f, c, consts, iters, 1)[0])
        row[key] = t
        row[f"tflops_{key}"] = None if t is None else flops / t / 1e12
        if err:
            row[f"error_{key}"] = err

    # jax's is_causal is top-left aligned; with a past the mask must be bottom-right.
    mask = (jnp.arange(S)[None, :] <= (past + jnp.arange(T))[:, None])[None, None]

    def cudnn_step(q, x):
        k, v, mask = x
        if past == 0:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")

    consts = (k_bshd, v_bshd, mask)
    t, err = guarded(lambda: time_loop(cudnn_step, q, consts, iters, 1)[0])
    row["cudnn"], row["error_cudnn"] = t, err
    t, err = guarded(
        lambda: time_loop(lambda q, x: xla_prefill(q, x[0], x[1], past), q, consts, iters, 1)[0]
    )
    row["xla"], row["error_xla"] = t, err
    for name in ("cudnn", "xla"):
        row[f"tflops_{name}"] = None if row[name] is None else flops / row[name] / 1e12
    return row


# --- report -------------------------------------------------------------------------------


def fmt(x, scale=1.0, spec="8.1f"):
    return f"{'-':>8}" if x is None else format(x * scale, spec)


def ratio(a, b):
    return None if a is None or b is None else b / a


def print_decode(rows, kernels=("auto",)):
    print(
        "\nDecode (bf16, Hq=32, Hkv=8, D=128): time in us, live-KV GB/s, x = cuDNN time / ours; "
        "k = decode kernel choice"
    )
    print(
        f"{'B':>4} {'S':>7} {'live':>7} | {'layout':>10} {'k':>11} {'jax_kv':>8} {'GB/s':>8} | "
        f"{'cuDNN':>8} {'GB/s':>8} | {'XLA':>8} {'GB/s':>8} | {'x cuDNN':>7} {'x XLA':>7}"
    )
    for r in rows:
        for lay, kernel in ((lay, k) for lay in Layout for k in kernels):
            key = decode_key(kernel, lay)
            ours = r.get(key)
            print(
                f"{r['B']:>4} {r['S']:>7} {r['live']:>7} | {lay.name:>10} {kernel:>11} "
                f"{fmt(ours, 1e6)} "
                f"{fmt(r.get(f'gbps_{key}'), 1, '8.0f')} | {fmt(r['cudnn'], 1e6)} "
                f"{fmt(r['gbps_cudnn'], 1, '8.0f')} | {fmt(r['xla'], 1e6)} "
                f"{fmt(r['gbps_xla'], 1, '8.0f')} | {fmt(ratio(ours, r['cudnn']), 1, '7.2f')} "
                f"{fmt(ratio(ours, r['xla']), 1, '7.2f')}"
            )


def print_prefill(rows, kernels=("auto",)):
    print(
        "\nPrefill (bf16, B=1, Hq=32, Hkv=8, D=128, causal): time in ms, TFLOP/s, "
        "x = ours / cuDNN TFLOP/s"
    )
    print(
        f"{'T':>6} {'past':>6} | {'layout':>10} {'kernel':>6} {'jax_kv':>8} {'TFLOP/s':>8} | "
        f"{'cuDNN':>8} {'TFLOP/s':>8} | {'XLA':>8} {'TFLOP/s':>8} | {'x cuDNN':>7}"
    )
    for r in rows:
        for lay, kernel in ((lay, k) for lay in Layout for k in kernels):
            key = prefill_key(kernel, lay)
            ours = r.get(key)
            print(
                f"{r['T']:>6} {r['past']:>6} | {lay.name:>10} {kernel:>6} {fmt(ours, 1e3, '8.3f')} "
                f"{fmt(r.get(f'tflops_{key}'))} | {fmt(r['cudnn'], 1e3, '8.3f')} "
                f"{fmt(r['tflops_cudnn'])} | {fmt(r['xla'], 1e3, '8.3f')} "
                f"{fmt(r['tflops_xla'])} | {fmt(ratio(ours, r['cudnn']), 1, '7.2f')}"
            )


def plot(decode, prefill, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [3, 1]})
    names = [
        (decode_key(k, lay), f"jax_kv {lay.name.lower()}" + ("" if k == "auto" else f", {k}"))
        for k in KERNEL_SPECS
        for lay in Layout
    ]
    names += [(prefill_key("mma", lay), f"jax_kv {lay.name.lower()}, mma.sync") for lay in Layout]
    names += [("cudnn", "cuDNN"), ("xla", "XLA masked")]
    present = {k for r in decode + prefill for k in r}
    names = [(n, t) for n, t in names if n in present]
    for ax, rows, key, label, ylabel in (
        (axes[0], decode, "gbps_", lambda r: f"B{r['B']}\nS{r['S']}\nL{r['live']}", "live-KV GB/s"),
        (axes[1], prefill, "tflops_", lambda r: f"T{r['T']}\npast{r['past']}", "TFLOP/s"),
    ):
        x = np.arange(len(rows))
        w = 0.8 / len(names)
        for i, (name, text) in enumerate(names):
            vals = [r.get(key + name) or 0.0 for r in rows]
            ax.bar(x + (i - (len(names) - 1) / 2) * w, vals, w, label=text)
        ax.set_xticks(x, [label(r) for r in rows], fontsize=7)
        ax.set_ylabel(ylabel)
    axes[0].axhline(4300, color="gray", ls="--", lw=0.8, label="~4.3 TB/s copy ceiling")
    axes[0].set_title("GQA decode, bf16, Hq=32 Hkv=8 D=128")
    axes[1].set_title("GQA prefill, causal, B=1")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_commit() -> str:
    if os.environ.get("JAX_KV_COMMIT"):  # a copied tree without .git (device runs)
        return os.environ["JAX_KV_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for attention.json and attention.png")
    ap.add_argument(
        "--decode-iters",
        type=int,
        default=None,
        help="iterations per timed call (default: ~CALL_SECONDS of kernel time per call)",
    )
    ap.add_argument("--quick", action="store_true", help="first decode/prefill rows only")
    ap.add_argument(
        "--decode-kernel",
        default="auto",
        help=f"comma list of decode kernel choices to time: {', '.join(KERNEL_SPECS)}, "
        "each optionally with @n, a fixed split count (auto@16: the batch-invariant mode's)",
    )
    ap.add_argument(
        "--prefill-kernel",
        default="auto",
        help="comma list of CUDA prefill kernels to time: auto (wgmma on an H100/H200), mma",
    )
    ap.add_argument("--parts", default="decode,prefill", help="tables to measure")
    args = ap.parse_args()
    kernels = tuple(args.decode_kernel.split(","))
    bad = [k for k in kernels if bad_kernel_spec(k)]
    if bad:
        ap.error(f"--decode-kernel: expected a comma list of {KERNEL_SPECS} (each with an "
                 f"optional @n, 1 <= n <= 256), got {bad}")  # fmt: skip
    prefill_kernels = tuple(args.prefill_kernel.split(","))
    if any(k not in PREFILL_KERNELS for k in prefill_kernels):
        ap.error(f"--prefill-kernel: expected a comma list of {PREFILL_KERNELS}")
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, commit {git_commit()[:12]}")

    decode_rows = DECODE_ROWS[:2] if args.quick else DECODE_ROWS
    prefill_rows = PREFILL_ROWS[:2] if args.quick else PREFILL_ROWS
    parts = args.parts.split(",")
    decode_rows = decode_rows if "decode" in parts else []
    prefill_rows = prefill_rows if "prefill" in parts else []
    meta = {
        "gpu": dev.device_kind,
        "jax": jax.__version__,
        "commit": git_commit(),
        "dtype": "bfloat16",
        "Hq": HQ,
        "Hkv": HKV,
        "D": D,
        "repeats": REPEATS,
        "decode_iters": args.decode_iters,
        "call_seconds_target": CALL_SECONDS,
        "call_overhead_s": call_overhead(),
        "decode_kernels": list(kernels),
        "prefill_kernels": list(prefill_kernels),
        "timing": "median wall time of one jitted lax.fori_loop call / iterations (row 'iters')",
    }
    decode, prefill = [], []

    def save():  # after every row: a run cut short still leaves its rows
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump({"meta": meta, "decode": decode, "prefill": prefill}, f, indent=1)

    for B, S, live in decode_rows:
        # Estimated at 4 TB/s of live K/V.
        iters = args.decode_iters or iterations(B * live * HKV * D * 4 / 4e12, 256, 8192)
        decode.append(bench_decode(B, S, live, iters, kernels))
        save()
        r = decode[-1]
        ours = ", ".join(
            f"{k} {fmt(r.get(decode_key(k, Layout.SEQ_MAJOR)), 1e6).strip()}" for k in kernels
        )
        print(
            f"  decode B={B} S={S} live={live}: jax_kv {ours} us "
            f"(seq-major), cuDNN {fmt(r['cudnn'], 1e6)} us, XLA {fmt(r['xla'], 1e6)} us",
            flush=True,
        )
    print_decode(decode, kernels)
    for T, past in prefill_rows:
        # Estimated at 400 TFLOP/s.
        iters = iterations(4 * HQ * D * (T * past + T * (T + 1) // 2) / 400e12, 2, 256)
        prefill.append(bench_prefill(T, past, iters, prefill_kernels))
        save()
        r = prefill[-1]
        ours = ", ".join(
            f"{k} {fmt(r.get(prefill_key(k, Layout.SEQ_MAJOR)), 1e3, '8.3f').strip()}"
            for k in prefill_kernels
        )
        print(
            f"  prefill T={T} past={past}: jax_kv {ours} ms (seq-major), "
            f"cuDNN {fmt(r['cudnn'], 1e3, '8.3f')} ms",
            flush=True,
        )
    print_decode(decode, kernels)
    print_prefill(prefill, prefill_kernels)
    errors = {
        f"{i}:{k}": v
        for i, r in enumerate(decode + prefill)
        for k, v in r.items()
        if k.startswith("error_") and v
    }
    for k, v in errors.items():
        print(f"  {k}: {v}")
    try:
        plot(decode, prefill, os.path.join(args.out, "attention.png"))
    except ImportError as e:
        print(f"no plot: {e}")
    print(f"wrote {args.out}/attention.json and attention.png")


if __name__ == "__main__":
    main()
