"""Growth cost and committed memory of KvCache on the VMM arena.

Table 1, one growth event per layout: a cache holding L=4096 live tokens grows to 4097
(seq-major: commit one more commit step; head-major: 4096 -> 8192 bucket, re-stride the live
prefix in place). Columns: wall microseconds of ensure_capacity (device work included: the
re-stride is synchronized), the part of it spent creating physical handles (zero with a pool
created ahead of need), driver calls (map, set-access, copies), bytes moved, granules.

Table 2, committed KV bytes of a seq-major VMM cache (max_len 131072) at live lengths
1k/8k/32k against what a static max_len cache holds.

    python bench/growth.py --out bench/results/growth.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from jax_kv import Layout
from jax_kv.cache import KvCache
from jax_kv.memory import VmmArena

# (layers, Hkv, D), bf16
MODELS = {
    "Qwen2.5-0.5B": (24, 2, 64),
    "Qwen2.5-7B": (28, 4, 128),
    "Llama-3-8B": (32, 8, 128),
}
MAX_LEN = 131072
LIVE = 4096


def growth_row(arena, model, layout, batch, repeats):
    layers, hkv, d = MODELS[model]
    cache = KvCache(
        num_layers=layers,
        batch=batch,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=jnp.bfloat16,
        layout=layout,
        arena=arena,
        max_len=MAX_LEN,
        min_bucket=256,
    )
    try:
        cache.ensure_capacity(LIVE)
        cache.lengths[:] = LIVE
        arena.synchronize()
        samples, all_us = [], []
        # Seq-major: one event per commit step (256 tokens); most fit inside granules already
        # committed. Time the events that commit granules (every slot crosses a boundary),
        # and report the mean over all events as the amortized cost.
        for _ in range(400 if layout == Layout.SEQ_MAJOR else 1):
            s0 = arena.stats()
            e = cache.ensure_capacity(cache.capacity + 1)
            s1 = arena.stats()
            create_s = min(s1.create_seconds - s0.create_seconds, e.seconds)
            all_us.append(e.seconds * 1e6)
            if e.granules_committed or layout == Layout.HEAD_MAJOR:
                samples.append((e, create_s))
            cache.lengths[:] = cache.capacity if layout == Layout.SEQ_MAJOR else LIVE
            if len(samples) >= repeats:
                break
        e, create_s = sorted(samples, key=lambda x: x[0].seconds)[len(samples) // 2]
        return dict(
            model=model,
            layout=layout.name,
            B=batch,
            old_capacity=e.old_capacity,
            new_capacity=e.new_capacity,
            us=e.seconds * 1e6,
            us_median_of=len(samples),
            create_us=create_s * 1e6,
            us_with_pool=(e.seconds - create_s) * 1e6,
            map_calls=e.map_calls,
            set_access_calls=e.set_access_calls,
            copy_calls=e.copy_calls,
            bytes_moved=e.bytes_moved,
            granules=e.granules_committed,
            keeps_compiled_step=e.keeps_compiled_step,
            reason=e.reason,
            samples_us=[round(s[0].seconds * 1e6, 1) for s in samples],
            events=len(all_us),
            mean_us_all_events=statistics.mean(all_us),
        )
    finally:
        cache.close()
        arena.flush()


def memory_row(arena, model, batch, live, free_budget):
    layers, hkv, d = MODELS[model]
    tok = hkv * d * 2
    static = 2 * layers * batch * MAX_LEN * tok
    live_bytes = 2 * layers * batch * live * tok
    row = dict(model=model, B=batch, live=live, static_bytes=static, live_bytes=live_bytes)
    if live_bytes * 1.1 > free_budget:
        row.update(committed_bytes=None, note="exceeds free device memory: not run")
        return row
    cache = KvCache(
        num_layers=layers,
        batch=batch,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=jnp.bfloat16,
        layout=Layout.SEQ_MAJOR,
        arena=arena,
        max_len=MAX_LEN,
        min_bucket=256,
    )
    try:
        cache.ensure_capacity(live)
        row.update(
            committed_bytes=cache.committed_bytes,
            reserved_bytes=cache.reserved_bytes,
            committed_over_live=cache.committed_bytes / live_bytes,
            static_over_committed=static / cache.committed_bytes,
        )
    finally:
        cache.close()
        arena.flush()
    return row


def fmt_bytes(x):
    if x is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x} B"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/growth.json")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args()
    models = args.models.split(",")

    jnp.zeros(()).block_until_ready()
    arena = VmmArena(pool_bytes=0)
    st = arena.stats()
    print(
        f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, granule "
        f"{fmt_bytes(arena.granule)}, reservation ladder tried {st.reservation_ladder}, "
        f"reserved {fmt_bytes(arena.reserved_bytes)} ({arena.reserved_bytes} bytes)"
    )
    # warm the driver paths once (first cuMemMap/cuMemcpy2D calls pay one-time setup)
    growth_row(arena, "Qwen2.5-0.5B", Layout.HEAD_MAJOR, 1, 1)
    growth_row(arena, "Qwen2.5-0.5B", Layout.SEQ_MAJOR, 1, 2)

    growth = []
    print(
        "\n## One growth event from L=4096 live (bf16, max_len 131072, pool empty: the "
        "event creates its own handles). Seq-major: median of the events that commit "
        "granules, and the mean over all events; head-major: the 4096->8192 re-stride\n"
    )
    print(
        "| model | B | layout | capacity | us | us w/o cuMemCreate | map | set-access | "
        "copies | granules | bytes moved | keeps step | events | mean us/event |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for batch in (1, 32):
            for layout in (Layout.SEQ_MAJOR, Layout.HEAD_MAJOR):
                r = growth_row(arena, model, layout, batch, args.repeats)
                growth.append(r)
                print(
                    f"| {model} | {batch} | {layout.name} | {r['old_capacity']}->"
                    f"{r['new_capacity']} | {r['us']:.0f} | {r['us_with_pool']:.0f} | "
                    f"{r['map_calls']} | {r['set_access_calls']} | {r['copy_calls']} | "
                    f"{r['granules']} | {fmt_bytes(r['bytes_moved']) if r['bytes_moved'] else 0}"
                    f" | {r['keeps_compiled_step']} | {r['events']} | "
                    f"{r['mean_us_all_events']:.0f} |",
                    flush=True,
                )

    memory = []
    free = arena.available_bytes()
    print(
        f"\n## Committed KV bytes, seq-major VMM vs a static max_len={MAX_LEN} cache "
        f"(bf16; device free {fmt_bytes(free)})\n"
    )
    print(
        "| model | B | live | live KV | committed (VMM) | static max_len | committed/live | "
        "static/committed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        for batch in (1, 32):
            for live in (1024, 8192, 32768):
                r = memory_row(arena, model, batch, live, free)
                memory.append(r)
                c = r["committed_bytes"]
                print(
                    f"| {model} | {batch} | {live} | {fmt_bytes(r['live_bytes'])} | "
                    f"{fmt_bytes(c) if c else r.get('note')} | {fmt_bytes(r['static_bytes'])} |"
                    f" {r.get('committed_over_live', 0):.3f} | "
                    f"{r.get('static_over_committed', 0):.1f}x |",
                    flush=True,
                )

    final = arena.stats()
    arena.close()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = None
    result = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        python=platform.python_version(),
        commit=commit,
        granule=arena.granule,
        reserved_bytes=final.reserved_bytes,
        reservation_ladder=list(final.reservation_ladder),
        growth=growth,
        memory=memory,
        arena_totals=dict(
            map_calls=final.map_calls,
            set_access_calls=final.set_access_calls,
            create_calls=final.create_calls,
            unmap_calls=final.unmap_calls,
            release_calls=final.release_calls,
            commit_seconds=final.commit_seconds,
        ),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        env={k: v for k, v in os.environ.items() if k.startswith(("JAX_KV_", "XLA_"))},
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
