"""The Engine's decode step at N busy slots, taken apart, against the Generator's step at the
same batch (issue 21: the decode step at 64 busy slots >= 60% of the bandwidth roofline). On
the H100 the Engine's step took 10 ms with 5 rows busy, twice the 8B weights' read time: this
says where the rest goes.

Per N (busy slots, each holding a P-token prompt, all decoding; prefix cache off):
- `step`: Engine.step() with decode work only, wall clock (median of --steps), and its host
  part (the step minus its compiled call, dispatch to tokens on the host);
- `host calls`: FFI handler host calls per step (0: XLA replayed the recorded CUDA graph);
- `pipelined`: the same compiled decode step called --steps times back to back on the same
  inputs, one wait at the end: the device time per step plus dispatch, without the engine's
  per-step wait for the tokens (and its handler host calls per call);
- `fresh inputs`: the same with new device arrays for tokens, lengths and bound at every call,
  as the Engine passed them before they had fixed addresses (jax_kv/engine/inputs.py): if XLA
  re-records the graph for them, the host calls say so and the time says what it costs;
- `bare`: the same, without the Engine's per-row sampling (argmax, no `lax.cond`);
- `Generator`: Generator.generate's decode seconds per step on the same N prompts at B=N
  (tokens_per_call 1, its second run: compiles excluded);
- `roofline`: (weight bytes + live KV bytes) / the device's HBM bandwidth.

    python bench/engine_step.py --out DIR [--model llama-3-8b] [--busy 1,16,64]
    python bench/engine_step.py --out DIR --model tiny-llama --dtype float32 --slots 8 \\
        --busy 1,8 --prompt 100 --max-len 1024 --steps 20       # a CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv import _ffi
from jax_kv.decode import Generator
from jax_kv.decode.sampling import argmax_rows
from jax_kv.engine import Engine
from jax_kv.layout import Layout

# Bytes per second by device kind (the datasheets' HBM figures); others: no roofline.
HBM_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def host_calls() -> int | None:
    cuda = _ffi.cuda_module()
    return None if cuda is None else int(sum(cuda.host_calls().values()))


def count(calls: float | None) -> str:
    return "-" if calls is None else f"{calls:.1f}"


def fill(eng: Engine, prompts: list[list[int]], new: int) -> list:
    """Submits the prompts and steps until every one is decoding (its prefill done)."""
    reqs = [eng.submit(p, new, stop_token_ids=[]) for p in prompts]
    while not all(r.streamed for r in reqs):
        eng.step()
    return reqs


def time_steps(eng: Engine, steps: int) -> dict:
    walls, hosts, calls = [], [], []
    for _ in range(steps):
        c0 = host_calls()
        eng.step()
        rec = eng.last_step
        assert rec.prefill_tokens == 0, "a prefill ran in a decode-only step"
        walls.append(rec.seconds)
        hosts.append(rec.seconds - rec.decode_seconds)
        if c0 is not None:
            calls.append(host_calls() - c0)
    return dict(
        step_ms=statistics.median(walls) * 1e3,
        host_ms=statistics.median(hosts) * 1e3,
        host_calls_per_step=(statistics.mean(calls) if calls else None),
    )


def bare_decode(eng: Engine):
    """The Engine's decode step without its sampling (greedy argmax, no `lax.cond`): the
    difference to the Engine's own is what sample_rows costs on the device."""
    model, attention = eng.model, eng._attention["decode"]

    def run(params, tokens, caches, lengths, committed, *sampling):
        del sampling
        logits, caches, status = model.decode_step(
            params, tokens, caches, lengths, layout=Layout.SEQ_MAJOR, committed=committed,
            **attention,
        )  # fmt: skip
        return argmax_rows(logits), caches, status

    return jax.jit(run, donate_argnums=(2,))


def time_pipelined(eng: Engine, steps: int, step=None, fresh: bool = False) -> tuple[float, float]:
    """(ms per call, handler host calls per call) of the Engine's compiled decode step (or
    `step`, the same arguments), called back to back (the caches fed back, the same lengths:
    each call rewrites the same positions). The per-step inputs are the Engine's own, at fixed
    addresses, or with `fresh` new device arrays every call (as the Engine passed them before
    StepInputs): the difference is what re-recording the CUDA graph costs."""
    step = eng._decode if step is None else step
    busy = [b for b, s in enumerate(eng._slots) if s is not None]
    for b in busy:  # the next token's granule, as a real step reserves it
        eng.cache.ensure_slot(b, int(eng.cache.lengths[b]) + 1)
    tokens = np.full((eng.max_slots,), 3, np.int32)
    lengths = eng._lengths()
    bound = eng._decode_bound([s for s in eng._slots if s is not None])
    eng._inputs.write(tokens=tokens, lengths=lengths, bound=bound)
    inputs = eng._inputs

    def args():
        if fresh:
            return jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(bound)
        return inputs["tokens"], inputs["lengths"], inputs["bound"]

    sampling = eng._sampling_args()
    caches = eng._caches()
    out = None
    t0, c0 = 0.0, None
    for i in range(steps + 1):
        if i == 1:  # the first call waits for nothing before it: not timed
            jax.block_until_ready(out)
            t0, c0 = time.perf_counter(), host_calls()
        tok, lens, bnd = args()
        out, caches, _ = step(eng.params, tok, caches, lens, bnd, *sampling)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    calls = None if c0 is None else (host_calls() - c0) / steps
    eng._accept(caches, verify=False)
    return seconds / steps * 1e3, calls


def generator_step_ms(model, prompts: list[list[int]], new: int, max_len: int) -> float:
    gen = Generator(model, max_len=max_len)
    gen.generate(prompts, new, stop_tokens=[])  # compiles
    st = gen.generate(prompts, new, stop_tokens=[]).stats
    return st.decode_seconds / max(1, new - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama-3-8b", choices=list(jm.PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--busy", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=1000, help="tokens per busy slot")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()

    preset = jm.PRESETS[args.model]
    config = dataclasses.replace(
        preset, max_position_embeddings=max(args.max_len, preset.max_position_embeddings or 0)
    )
    model = jm.random_model(config, seed=0, dtype=jnp.dtype(args.dtype))
    model.fuse_projections()  # once, in place: the Engine and the Generator share it
    kind = jax.devices()[0].device_kind
    bandwidth = HBM_BYTES_PER_S.get(kind)
    weight_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(model.params))
    rng = np.random.default_rng(0)
    eng = Engine(model, max_slots=args.slots, max_len=args.max_len, prefix_cache=False)
    rows = []
    try:
        eng.warm_up()
        decode0 = eng.stats.decode_compiles
        bare = bare_decode(eng)
        for n in [int(x) for x in args.busy.split(",")]:
            prompts = [[int(t) for t in rng.integers(3, config.vocab_size, args.prompt)]
                       for _ in range(n)]  # fmt: skip
            new = 3 * args.steps + 8
            reqs = fill(eng, prompts, new)
            row = dict(busy=n, prompt=args.prompt, **time_steps(eng, args.steps))
            row["pipelined_ms"], row["pipelined_host_calls"] = time_pipelined(eng, args.steps)
            row["fresh_inputs_ms"], row["fresh_inputs_host_calls"] = time_pipelined(
                eng, args.steps, fresh=True
            )
            row["bare_ms"], _ = time_pipelined(eng, args.steps, bare)
            live = eng.cache.live_bytes
            row["live_kv_bytes"] = int(live)
            for r in reqs:
                r.cancel()
            eng.run_until_idle()
            row["generator_ms"] = generator_step_ms(model, prompts, args.steps + 1, args.max_len)
            if bandwidth:
                row["roofline_ms"] = (weight_bytes + live) / bandwidth * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
        compiles = eng.stats.decode_compiles - decode0
    finally:
        eng.close()
    print(
        f"\n{args.model} shape, {args.dtype}, {kind}, {args.slots} slots, max_len {args.max_len}, "
        f"{args.prompt}-token prompts; medians of {args.steps} steps; decode compiles after "
        f"warm-up: {compiles}\n"
        "| busy | engine step ms | host ms | host calls/step | pipelined ms (host calls) "
        "| fresh inputs ms (host calls) | bare ms | Generator ms | roofline ms |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        roof = f"{r['roofline_ms']:.2f}" if "roofline_ms" in r else "-"
        print(
            f"| {r['busy']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{count(r['host_calls_per_step'])} | {r['pipelined_ms']:.2f} "
            f"({count(r['pipelined_host_calls'])}) | {r['fresh_inputs_ms']:.2f} "
            f"({count(r['fresh_inputs_host_calls'])}) | {r['bare_ms']:.2f} | "
            f"{r['generator_ms']:.2f} | {roof} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("JAX_KV_COMMIT", "")
    path = (
        args.out
        / f"engine_step_{args.model}_{jax.default_backend()}{'_' + tag if tag else ''}.json"
    )
    meta = dict(vars(args), out=str(args.out), device_kind=kind, weight_bytes=weight_bytes)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
