"""The Engine's host work per step at a serving geometry, with the device steps stubbed out:
what Python costs per scheduling iteration, apart from the GPU (issue 21's "host time per step").

The cache has the 8B run's shape in granules (64 slots x 32k tokens, 32 layers x K/V = 64
bindings, 1,024 tokens per granule) on the host arena, with 64 KiB granules and 64-byte
tokens, so that it fits a CPU machine. The compiled steps are stubbed (random tokens at once,
the caches returned as they came): each step does the scheduling, commits, releases, prefix
blocks and emits, but computes nothing. The host time is split as on the device: exposed (the
device would wait for it: planning, the inputs' write, the tokens' delivery) and beside the
call (the work `Engine._call` does while a call runs: releases, commits ahead, the next
prefill's commits and admissions), which a GPU step of ~10 ms hides. It also times the
benchmark's per-step reads (held, committed and live bytes).

    python bench/engine_host.py [--requests 200] [--no-prefix] [--decode-only] [--profile]
        [--listeners] [--driver]   # the server's per-token wake-up; delivered beside the call

The host driver zeroes committed granules with memset and maps each with mmap; the CUDA driver
does both asynchronously. Those lines of the profile are this stand-in's cost. The zero mappings
need `vm.max_map_count` above 262k: `sysctl -w vm.max_map_count=2000000`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import pstats
import threading
import time

import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv.engine import Engine
from jax_kv.memory import host_arena


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument(
        "--decode-steps", type=int, default=1, help="Engine(decode_steps): tokens per decode call"
    )
    ap.add_argument("--no-prefix", action="store_true", help="the prefix cache off")
    ap.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=None,
        help="Engine(prefix_cache_bytes=N): the most bytes of blocks no request maps",
    )
    ap.add_argument("--decode-only", action="store_true", help="100-token prompts, 400 out")
    ap.add_argument("--profile", action="store_true", help="cProfile the steps (top 25)")
    ap.add_argument(
        "--no-hand-over",
        action="store_true",
        help="an ended slot is released and committed again, never handed over",
    )
    ap.add_argument(
        "--listeners",
        action="store_true",
        help="each request gets the server's listener (an event loop's call_soon_threadsafe)",
    )
    ap.add_argument(
        "--driver",
        action="store_true",
        help="step as the background driver does (tokens delivered beside the next call)",
    )
    ap.add_argument(
        "--qwen",
        action="store_true",
        help="Qwen2.5-0.5B's geometry: 24 layers, 8,192 tokens to a granule (512 KiB here)",
    )
    args = ap.parse_args()

    # 1 KV head of 32 bf16: 64-byte tokens, 1,024 to a 64 KiB granule, as 2 KiB tokens are to
    # the 8B's 2 MiB granule.
    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_layers=24 if args.qwen else 32, num_q_heads=1,
        num_kv_heads=1, head_dim=32, hidden_size=32, intermediate_size=32,
        max_position_embeddings=32768, rope_scaling=None,
    )  # fmt: skip
    model = jm.random_model(config, seed=0, dtype=jnp.bfloat16)
    t0 = time.perf_counter()
    # The slots' ranges (64 bindings of 32k 64-byte tokens each) and as much again for the
    # prefix store.
    arena = host_arena(reserve_bytes=max(20 << 30, args.slots * 64 * 32768 * 64 * 5 // 2),
                       granule=(512 if args.qwen else 64) << 10)  # fmt: skip
    eng = Engine(model, max_slots=args.slots, max_len=32768, prefill_chunk_tokens=512,
                 arena=arena, prefix_cache=not args.no_prefix,
                 prefix_cache_bytes=args.prefix_cache_bytes,
                 decode_steps=args.decode_steps)  # fmt: skip
    print(f"engine built in {time.perf_counter() - t0:.2f} s", flush=True)
    rng = np.random.default_rng(0)
    B, n = eng.max_slots, args.requests

    status = jnp.zeros((B,), jnp.int32)

    def step_stub(caches_at):
        def run(params, *step_args):  # (logits, status [B], caches, positions [B])
            # The "logits" are the tokens themselves; the greedy picker passes them on. The
            # decode step returns its status in its `status` input (the Engine's field, taken
            # back), the 5th of its arguments after the params.
            sampled = jnp.asarray(rng.integers(3, 500, B).astype(np.int32))
            out_status = step_args[4] if caches_at == 2 else status
            return sampled, out_status, step_args[caches_at - 1], status

        return run

    eng._prefill, eng._decode = step_stub(3), step_stub(2)  # caches: argnum 3 / 2 of run()
    # (the tokens input, the picked tokens and the status as one [2, B] array; a decode
    # bucket's row index, if any, ignored: the stub's tokens are every row's)
    eng._greedy = lambda tokens, status, field, *rows: (field, jnp.stack([tokens, status]))
    k = args.decode_steps

    def steps_stub(params, tokens, caches, *rest):  # Engine._decode_steps_fn's outputs
        picked = jnp.asarray(rng.integers(3, 500, (k, B)).astype(np.int32))
        return tokens, jnp.concatenate([picked, status[None]]), caches

    eng._decode_steps = {False: steps_stub, True: steps_stub}
    eng._accept = lambda caches, verify: None  # nothing computed: nothing to write back
    if args.no_hand_over:
        eng.cache.hands_over_in_place = lambda b, tokens: False  # fresh granules: recommit
    counts0 = arena.stats()
    stats0 = dataclasses.replace(eng.stats)
    if args.decode_only:
        prompts, outs = np.full(n, 100), np.full(n, 400)
    else:  # bench/serve.py's mixed workload
        prompts = np.minimum(rng.lognormal(np.log(300), 1.0, n).astype(int) + 1, 8192)
        outs = np.minimum(rng.lognormal(np.log(200), 1.0, n).astype(int) + 1, 2048)
    loop = None
    if args.listeners:  # as jax_kv/server/app.py registers it, on a running event loop
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        woken = asyncio.Event()
    for p, o in zip(prompts, outs, strict=True):
        r = eng.submit([int(t) for t in rng.integers(3, 500, p)], int(o), stop_token_ids=[])
        if loop is not None:
            r.add_listener(lambda: loop.call_soon_threadsafe(woken.set))
    cache, profile = eng.cache, cProfile.Profile()
    step_s, read_s, full = [], [], []
    while eng.has_work():
        t = time.perf_counter()
        if args.profile:
            profile.enable()
        eng._step(defer_delivery=args.driver)
        if args.profile:
            profile.disable()
        step_s.append(time.perf_counter() - t)
        full.append(eng.last_step.decode_rows >= 0.9 * B and not eng.last_step.prefill_tokens)
        t = time.perf_counter()
        _ = (cache.held_bytes, cache.committed_bytes, cache.live_bytes)
        read_s.append(time.perf_counter() - t)
    steps = np.array(step_s) * 1e3
    busy = steps[np.array(full)]
    st = eng.stats
    exposed = (st.host_seconds - stats0.host_seconds) / len(steps) * 1e3
    beside = (st.step_seconds - stats0.step_seconds) / len(steps) * 1e3 - exposed
    print(
        f"{len(steps)} steps, {int(outs.sum())} tokens out: host {np.mean(steps):.2f} ms/step "
        f"(p50 {np.median(steps):.2f}, p99 {np.percentile(steps, 99):.2f}); decode-only steps "
        f"at >= 90% busy slots: {len(busy)}, "
        f"{np.median(busy) if len(busy) else float('nan'):.2f} ms median; the bench's reads "
        f"{np.mean(read_s) * 1e3:.3f} ms/step; host {np.sum(steps) / outs.sum() * 1e3:.2f} us "
        f"a token out (decode_steps {k})"
    )  # fmt: skip
    print(
        f"of which exposed {exposed:.2f} ms/step, beside the call {beside:.2f} ms/step; "
        f"admissions {st.submitted - stats0.submitted}: beside a call "
        f"{getattr(st, 'admitted_ahead', 0)}, slot commits with no call in flight "
        f"{getattr(st, 'planning_commits', '(not counted)')}, pieces committed ahead "
        f"{getattr(st, 'pieces_ahead', 0)}; before the next call's dispatch "
        f"{getattr(st, 'before_next_seconds', float('nan')) * 1e3 / max(1, st.calls_ahead):.3f}"
        f" ms per call dispatched ahead ({st.calls_ahead})"
    )
    c = arena.stats()
    kinds = ("map", "unmap", "set_access", "zero_map", "zero_access", "zero_fill")
    calls = {k: getattr(c, f"{k}_calls") - getattr(counts0, f"{k}_calls") for k in kinds}
    print(
        "driver calls per request: "
        + ", ".join(f"{k} {v / n:.0f}" for k, v in calls.items())
        + f"; slots handed over {eng.stats.slots_handed_over}, releases beside a call "
        f"{eng.stats.releases_beside_step}, commits ahead {eng.stats.commits_ahead}"
    )
    if args.profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    eng.close()
    arena.close()
    if loop is not None:
        loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
