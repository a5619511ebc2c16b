"""Prefill of mixed prompts (issue 30): the Generator's packed, chunked prefill against the padded
[B, T] form it replaced (every row computed up to the next power of two above the longest
prompt), same model, same prompts, same run. Random weights, bf16, Llama-3-8B shape by default.

    python bench/prefill.py --out DIR                  # GPU: the table below, timed
    python bench/prefill.py --out DIR --memory-only    # any machine: XLA's temporary bytes only

Workloads (seeded): (a) 64 mixed prompts, lognormal lengths (median ~300) clipped to 8..8192;
(b) 1 prompt of 32,768 tokens; (c) 64 prompts of 128 tokens; (d) (a)'s lengths clipped to
4,096, where the padded form fits on an H200 (a's does not), so "before" has a number; (e)
(a)'s first 16 draws, the long document included, whose padded form (T = 8,192) fits an H100. Per
workload and form: real prompt tokens, token positions computed, XLA's temporary bytes of the
compiled prefill (lowered from shapes: `compile().memory_analysis()`), and (timed runs) seconds
from the first prefill call to the first token and real tokens per second (median of --repeats
after a warm-up that compiles).
The padded form's cache holds T positions per row, as the old Generator's did.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv import Layout
from jax_kv.cache import bucket_for
from jax_kv.decode import Generator
from jax_kv.decode.generator import PREFILL_CHUNK_TOKENS, PREFILL_MIN_TOKENS
from jax_kv.models import llama

LAYOUT = Layout.SEQ_MAJOR


def workloads(vocab: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(0)
    mixed = np.clip(rng.lognormal(np.log(300), 1.2, 64), 8, 8192).astype(int)
    mixed[0] = 8192 - 8  # one long document in the batch, as in the measurement
    # (d): the same draws clipped to 4,096, so the padded form's T is 4,096: the largest mixed
    # batch whose padded prefill fits a 141 GB H200 beside its cache (a's needs ~114 GiB).
    shorter = np.minimum(mixed, 4096 - 8)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, int(n)).tolist()

    return {
        "a: 64 mixed (8..8192)": [ids(n) for n in mixed],
        "b: 1 x 32768": [ids(32768)],
        "c: 64 x 128": [ids(128) for _ in range(64)],
        "d: 64 mixed (8..4096)": [ids(n) for n in shorter],
        # (e): (a)'s first 16 draws, its 8,184-token document included: the padded form's T is
        # (a)'s 8,192 and fits an 80 GB card (16 GiB of cache, ~14 GiB of temporaries).
        "e: 16 mixed (8..8192)": [ids(n) for n in mixed[:16]],
    }


def sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def abstract_params(config, dtype):
    shapes = llama.param_shapes(config)
    return jax.tree_util.tree_map(
        lambda s: sds(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def cache_sds(config, batch, capacity, dtype):
    shape = LAYOUT.cache_shape(batch, capacity, config.num_kv_heads, config.head_dim)
    return [(sds(shape, dtype), sds(shape, dtype)) for _ in range(config.num_layers)]


def padded_step(config):
    def run(params, tokens, new_lengths, caches, lengths):
        return llama.prefill(
            params, config, tokens, new_lengths, caches, lengths, layout=LAYOUT, last_only=True
        )

    return jax.jit(run, donate_argnums=(3,))


def padded_temp_bytes(config, params, batch, T, dtype) -> int:
    args = (
        params,
        sds((batch, T)),
        sds((batch,)),
        cache_sds(config, batch, T, dtype),
        sds((batch,)),
    )
    # Autotuning off for this compile only: on a GPU it would run the padded GEMMs
    # ([B*T, 4096] x [28672, 4096] for (a)) on real buffers, and XLA's allocator keeps them
    # (on the H100 it took more than 150 s and left the packed form's KV no room).
    options = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
    compiled = padded_step(config).lower(*args).compile(compiler_options=options)
    return compiled.memory_analysis().temp_size_in_bytes


def packed_plan(lengths: list[int], chunk: int) -> tuple[int, int, int]:
    """(calls, positions computed, largest call N) of the Generator's packing."""
    real = sum(lengths)
    calls = -(-real // chunk)
    last = real - (calls - 1) * chunk
    computed = (calls - 1) * chunk + min(bucket_for(last, PREFILL_MIN_TOKENS), chunk)
    return calls, computed, chunk if calls > 1 else min(bucket_for(last, PREFILL_MIN_TOKENS), chunk)


def time_padded(model, prompts, repeats) -> tuple[float, str]:
    config, B = model.config, len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    T = bucket_for(int(lens.max()), PREFILL_MIN_TOKENS)
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    step = padded_step(config)
    params = model.params  # fused, as the Generator runs, packed or padded
    times = []
    try:
        for _ in range(repeats + 1):
            caches = llama.init_caches(config, B, T, layout=LAYOUT, dtype=model.dtype)
            t0 = time.perf_counter()
            logits, caches = step(
                params,
                jnp.asarray(tokens),
                jnp.asarray(lens),
                caches,
                jnp.zeros(B, jnp.int32),
            )
            jnp.argmax(logits, -1).block_until_ready()
            times.append(time.perf_counter() - t0)
            del caches, logits
    except Exception as e:  # noqa: BLE001 - an out-of-memory is this form's result
        return float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return statistics.median(times[1:]), ""


def padded_would_not_fit(config, batch, T, temp_bytes, dtype) -> tuple[float, str] | None:
    """(nan, why) when the padded call's cache + temporaries exceed what XLA can still allocate.

    Running it anyway does not fail fast: XLA's allocator retries the allocation every ~10 s.
    """
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    cache = 2 * config.num_layers * batch * T * config.num_kv_heads * config.head_dim
    need = temp_bytes + cache * dtype.itemsize
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if need <= free:
        return None
    return float("nan"), f"does not fit: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def time_packed(gen, prompts, repeats) -> tuple[float, str, int]:
    """(median prefill seconds, error, the cache's committed KV bytes)."""
    times, committed = [], 0
    try:
        for _ in range(repeats + 1):
            out = gen.generate(prompts, 1, stop_tokens=())
            times.append(out.stats.prefill_seconds)
            committed = out.stats.committed_bytes
    except Exception as e:  # noqa: BLE001
        return float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", committed
    return statistics.median(times[1:]), "", committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK_TOKENS)
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="a,b,c", help="first letters of the workloads to run")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="float32 for --memory-only on a CPU: its compiler widens bf16 dots to f32 and counts "
        "f32 copies of the weights as temporaries, which a GPU compile does not",
    )
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    config = jm.preset(args.model)
    if args.memory_only:
        params = abstract_params(config, dtype)
        model = None
    else:
        model = jm.random_model(args.model, seed=0, dtype=dtype)
        model.fuse_projections()  # once, in place: no fused copy beside the separate weights
        params = model.params
    rows = []
    for name, prompts in workloads(config.vocab_size).items():
        if name[0] not in args.workloads.split(","):
            continue
        lengths = [len(p) for p in prompts]
        B, real = len(prompts), sum(lengths)
        T = bucket_for(max(lengths), PREFILL_MIN_TOKENS)
        calls, computed, N = packed_plan(lengths, args.chunk)
        if model is None:  # shapes only: lowering needs no weights (and fusing would)
            gen = Generator(jm.Model(config, params), fuse_projections=False)
        else:
            gen = Generator(model, prefill_chunk_tokens=args.chunk, max_len=max(lengths) + 1)
        row = dict(
            workload=name, batch=B, real_tokens=real,
            packed=dict(
                computed=computed, calls=calls,
                temp_bytes=gen.prefill_temp_bytes(B, T, N),
            ),
        )  # fmt: skip
        timed = {}
        if model is not None:
            # Packed first: compiling the padded form autotunes its GEMMs on buffers of the
            # padded shape, and XLA's allocator keeps that memory (on the H200, (a)'s padded
            # compile left the arena 36.8 GB of the 64 GiB its packed cache needs).
            *timed["packed"], committed = time_packed(gen, prompts, args.repeats)
            # Issue 30 item 3: XLA's peak (weights + temporaries; the VMM arena's KV is outside
            # XLA's allocator) while only the packed form has run: peak - weights <= 4 GiB.
            stats = jax.devices()[0].memory_stats() or {}
            row["packed"].update(
                xla_peak_bytes=stats.get("peak_bytes_in_use"),
                weight_bytes=int(sum(x.nbytes for x in jax.tree_util.tree_leaves(params))),
                kv_committed_bytes=committed,
            )
            # The packed figures, before the padded form's compile (which may not finish in time).
            print(json.dumps(dict(row, packed_timed=timed["packed"])), flush=True)
        row["padded"] = dict(
            computed=B * T, temp_bytes=padded_temp_bytes(config, params, B, T, dtype)
        )
        if model is not None:
            timed["padded"] = padded_would_not_fit(
                config, B, T, row["padded"]["temp_bytes"], dtype
            ) or time_padded(model, prompts, args.repeats)
            for form, (seconds, error) in timed.items():
                row[form].update(ttft_s=seconds, tokens_per_s=real / seconds, error=error)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{args.model}, {dtype.name}, {jax.devices()[0].device_kind}, chunk {args.chunk}\n"
        "| workload | real tokens | computed padded / packed | temp GiB padded / packed "
        "| real tok/s padded / packed | TTFT s padded / packed |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        p, k = r["padded"], r["packed"]
        speed = " / ".join(
            f"{x['tokens_per_s']:,.0f}" if x.get("ttft_s", np.nan) == x.get("ttft_s") else "-"
            for x in (p, k)
        )
        ttft = " / ".join(
            f"{x['ttft_s']:.3f}" if x.get("ttft_s", np.nan) == x.get("ttft_s") else "-"
            for x in (p, k)
        )
        print(
            f"| {r['workload']} | {r['real_tokens']:,} | {p['computed'] / r['real_tokens']:.2f}x / "
            f"{k['computed'] / r['real_tokens']:.2f}x | {p['temp_bytes'] / 2**30:.2f} / "
            f"{k['temp_bytes'] / 2**30:.2f} | {speed} | {ttft} |"
        )
    for r in rows:
        k = r["packed"]
        if k.get("xla_peak_bytes") is not None:
            peak, weights = k["xla_peak_bytes"] / 2**30, k["weight_bytes"] / 2**30
            print(
                f"{r['workload']}, packed: XLA peak so far {peak:.2f} GiB = weights "
                f"{weights:.2f} + {peak - weights:.2f} GiB (bound: 4 GiB) beside the arena's KV "
                f"{k['kv_committed_bytes'] / 2**30:.2f} GiB"
            )
        for form in ("padded", "packed"):
            if r[form].get("error"):
                print(f"{r['workload']}, {form}: {r[form]['error']}")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("JAX_KV_COMMIT", "")
    kind = "memory" if args.memory_only else "timed"
    path = args.out / f"prefill_{kind}_{jax.default_backend()}{'_' + tag if tag else ''}.json"
    record = dict(model=args.model, dtype=dtype.name, chunk=args.chunk, rows=rows)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
