"""Issue 28's scaling table: tensor parallelism over KV heads at tp = 1, 2, 4, ... on the devices
present. Per tp: the Generator's decode tokens/s at B=1 (one prompt, steady state, compiles
excluded, as GenerationStats reports it), the engine's output tokens/s on a batch of requests
submitted at once, and each one's scaling efficiency (speedup over tp=1 / tp). Greedy tokens
are checked against tp=1's. Random weights of a named shape. The same model for every tp.

    python bench/tp_scale.py --model llama-3-8b --dtype bfloat16 --tps 1,2,4,8 --out DIR  # GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/tp_scale.py \\
        --model tiny-llama --dtype float32 --slots 8 --requests 16 --out DIR       # CPU

On CPU the host devices share the same cores, so the times say nothing of scaling: the run
shows that the script and the sharded paths work, and that the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import jax_kv.models as jm
from jax_kv.decode import Generator
from jax_kv.engine import Engine
from jax_kv.parallel import tp_mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b", choices=list(jm.PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tps", default="1,2,4,8", help="tp values; those above the devices skip")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    model = jm.random_model(args.model, seed=0, dtype=args.dtype)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, vocab, args.prompt_tokens)]
    batch = [[int(t) for t in rng.integers(3, vocab, n)]
             for n in rng.integers(16, args.prompt_tokens, args.requests)]  # fmt: skip
    asked = [int(x) for x in args.tps.split(",")]
    hkv = model.config.num_kv_heads
    tps = [t for t in asked if t <= jax.device_count() and hkv % t == 0]
    rows, base = [], None
    for tp in tps:
        mesh = None if tp == 1 else tp_mesh(tp)
        gen = Generator(model, mesh=mesh, max_len=args.max_len)
        gen.generate([prompt], args.new_tokens, stop_tokens=[])  # compiles
        one = gen.generate([prompt], args.new_tokens, stop_tokens=[])
        eng = Engine(model, max_slots=args.slots, max_len=args.max_len, mesh=mesh)
        eng.warm_up()
        compiles = eng.stats.decode_compiles + eng.stats.prefill_compiles
        reqs = [eng.submit(p, args.new_tokens, stop_token_ids=[]) for p in batch]
        t0 = time.perf_counter()
        eng.run_until_idle()
        seconds = time.perf_counter() - t0
        out = [r.result().tokens for r in reqs]
        compiles = eng.stats.decode_compiles + eng.stats.prefill_compiles - compiles
        eng.close()
        row = dict(
            tp=tp,
            b1_tok_s=one.stats.decode_tokens_per_s,
            engine_tok_s=sum(len(t) for t in out) / seconds,
            engine_compiles_after_warmup=compiles,
        )
        if base is None:
            base = dict(row, tokens=one.tokens, engine=out)
            row.update(b1_same=True, engine_same=True)
        else:
            row.update(b1_same=one.tokens == base["tokens"], engine_same=out == base["engine"])
        for k in ("b1", "engine"):
            row[f"{k}_efficiency"] = row[f"{k}_tok_s"] / (tp * base[f"{k}_tok_s"])
        rows.append(row)
        print(f"tp={tp}: B=1 {row['b1_tok_s']:.1f} tok/s, engine {row['engine_tok_s']:.1f} tok/s",
              flush=True)  # fmt: skip
    print(
        f"\n{args.model} shape, {args.dtype}, random weights, greedy; {jax.device_count()} "
        f"{jax.devices()[0].platform} devices; B=1: {args.prompt_tokens}-token prompt + "
        f"{args.new_tokens} new; engine: {args.requests} requests at once on {args.slots} slots"
    )
    print("| tp | B=1 tok/s | efficiency | engine tok/s | efficiency | compiles after warm-up "
          "| tokens equal tp=1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tp']} | {r['b1_tok_s']:.1f} | {r['b1_efficiency']:.2f} | "
            f"{r['engine_tok_s']:.1f} | {r['engine_efficiency']:.2f} | "
            f"{r['engine_compiles_after_warmup']} | "
            f"{'yes' if r['b1_same'] and r['engine_same'] else 'NO'} |"
        )
    skipped = [t for t in asked if t not in tps]
    if skipped:
        print(f"not run: tp={skipped} ({jax.device_count()} devices, {hkv} KV heads)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"tp_scale_{args.model}_{jax.devices()[0].platform}.json"
        path.write_text(json.dumps(dict(meta=vars(args) | dict(out=str(args.out)), rows=rows),
                                   indent=1))  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
