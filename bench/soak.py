"""Soak: many decode steps with growth and cache close/reopen cycles on one VmmArena, printing
the arena's counters per cycle. Nothing may drift: handles live, committed bytes after each
close, the zero-mapped address space, device free memory, and the must-be-zero fault counters
(issue 19, item 8's evidence).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/soak.py --steps 20000 [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import jax.numpy as jnp

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.memory import VmmArena


def device_free() -> int:
    from cuda.bindings import driver as cu

    err, free, _ = cu.cuMemGetInfo()
    assert err == cu.CUresult.CUDA_SUCCESS
    return int(free)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000, help="decode steps in total")
    ap.add_argument("--tokens", type=int, default=500, help="new tokens per cycle")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model = jm.random_model("tiny-llama", seed=0, dtype=jnp.bfloat16)
    arena = VmmArena(pool_bytes=0)
    gen = Generator(model, max_len=4096, min_bucket=16, tokens_per_call=8, arena=arena)
    prompts = [[1 + b, 2, 3, 4 + b][: 2 + b % 3] for b in range(args.batch)]
    cycles = -(-args.steps // (args.tokens - 1))
    rows, steps, t0 = [], 0, time.perf_counter()
    for cycle in range(cycles):
        out = gen.generate(prompts, args.tokens, stop_tokens=())
        gc.collect()
        s, st = arena.stats(), out.stats
        steps += st.decode_tokens // args.batch
        rows.append(
            dict(
                cycle=cycle,
                steps=steps,
                growth_events=st.growth_events,
                growth_keeps=st.growth_keeps,
                captures=st.captures,
                invalidations=st.invalidations,
                kv_bytes_moved=st.kv_bytes_moved,
                committed_during=st.committed_bytes,
                committed_after_close=s.committed_bytes,
                handles_live=s.handles_live,
                pooled_bytes=s.pooled_bytes,
                zero_mapped_bytes=s.zero_mapped_bytes,
                live_views=s.live_views,
                regions=s.regions,
                ref_underflows=s.ref_underflows,
                unaccounted_committed_bytes=s.unaccounted_committed_bytes,
                unbacked_bytes=s.unbacked_bytes,
                quarantined_bytes=s.quarantined_bytes,
                device_free=device_free(),
            )
        )
        r = rows[-1]
        if cycle < 3 or cycle % 10 == 0 or cycle == cycles - 1:
            print(
                f"cycle {cycle:3d} steps {steps:6d}: growth {r['growth_events']} "
                f"(kept {r['growth_keeps']}), captures {r['captures']}, committed "
                f"{r['committed_during'] >> 20} MiB -> {r['committed_after_close']} after close, "
                f"handles live {r['handles_live']}, zero-mapped {r['zero_mapped_bytes']}, "
                f"faults {r['ref_underflows']}/{r['unaccounted_committed_bytes']}/"
                f"{r['unbacked_bytes']}/{r['quarantined_bytes']}, device free "
                f"{r['device_free'] >> 20} MiB",
                flush=True,
            )
    seconds = time.perf_counter() - t0
    first, last = rows[0], rows[-1]
    counted = ("handles_live", "committed_after_close", "zero_mapped_bytes", "regions")
    drift = {k: (first[k], last[k]) for k in counted if first[k] != last[k]}
    free_drift = last["device_free"] - first["device_free"]  # XLA's allocator moves it too
    faults = sum(
        r[k]
        for r in rows
        for k in ("ref_underflows", "unaccounted_committed_bytes", "unbacked_bytes")
    )
    keeps_all = all(r["growth_keeps"] == r["growth_events"] for r in rows)
    print(
        f"\nsoak: {steps} decode steps in {cycles} cycles ({seconds:.1f} s); growth events "
        f"{sum(r['growth_events'] for r in rows)}, all kept: {keeps_all}; drift between the "
        f"first and last cycle: {drift or 'none'}; fault counters summed: {faults}; device "
        f"free memory moved {free_drift / 2**20:+.0f} MiB"
    )
    gen = None
    gc.collect()
    arena.close()
    s = arena.stats()
    print(
        f"after arena.close(): committed {s.committed_bytes}, handles live {s.handles_live} "
        f"(created {s.create_calls}, released {s.release_calls})"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(dict(rows=rows, seconds=seconds, drift=drift, faults=faults), f, indent=1)
    ok = not drift and faults == 0 and keeps_all and s.handles_live == 0
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
