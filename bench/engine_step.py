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
  per-step wait for the tokens (and its handler host calls per call); on the smallest decode
  bucket that holds the N rows (`bucket`, what the Engine runs: Engine.decode_buckets), and
  as `all rows` on every slot's row (the max_slots bucket: the projections, the MLP and the
  logits on all max_slots rows, as the step ran before decode buckets), in the same run;
- `fresh inputs`: the same with new device arrays for tokens, lengths and bound at every call,
  as the Engine passed them before they had fixed addresses (jax_kv/engine/inputs.py): if XLA
  re-records the graph for them, the host calls say so and the time says what it costs;
- `bare`: the decode step and its argmax in one compiled call, on the same bucket (the Engine
  picks the tokens in a second call, chosen on the host: argmax or the sampler);
- `Generator`: Generator.generate's decode seconds per step on the same N prompts at B=N
  (tokens_per_call 1, its second run: compiles excluded);
- `roofline`: (weight bytes + live KV bytes) / the device's HBM bandwidth.

With `--piece P` (P a prefill bucket; busy < slots), the Engine's mixed call is taken apart
too, pipelined as above: a P-token piece packed into an idle slot beside the N decoding rows
(`mixed`), the same piece with the decoding rows idle (`piece only`: their B tokens still pass
through the projections and the MLP, their attention reads nothing), and the share a piece
token costs (`(mixed - decode) / P`, against the GEMMs' FLOPs at the device's dense bf16
rate). With `--profile`, each call is recorded once under `jax.profiler.trace` and its device
time split into GEMMs, the attention ops and the rest (bench/step_profile.py's reader).

    python bench/engine_step.py --out DIR [--model llama-3-8b] [--busy 1,16,64]
    python bench/engine_step.py --out DIR --slots 256 --max-len 8192 --busy 1,64,255 \\
        --prompt 1000 --piece 512 --profile                     # the mixed call at 256 slots
    python bench/engine_step.py --out DIR --model tiny-llama --dtype float32 --slots 16 \\
        --busy 1,9,16 --prompt 100 --max-len 1024 --steps 20    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import tempfile
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
# Dense bf16 FLOP/s by device kind (the SXM datasheets' figure without sparsity).
BF16_FLOP_PER_S = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}
# Device kernels by what they are, first match wins (cuBLAS / cuBLASLt / CUTLASS GEMM names;
# the jax_kv attention kernels; everything else is XLA's fusions, copies, sort and reductions).
KERNEL_KINDS = (
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|sm80_|cublas", re.I)),
    ("attention", re.compile(r"gqa|Gqa|attention", re.I)),
)


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
    # The last step may have dispatched a call ahead (Engine(decode_ahead)): wait for it and
    # drop its tokens, so that the timings after this one call the steps on idle inputs.
    eng._settle()
    return dict(
        step_ms=statistics.median(walls) * 1e3,
        host_ms=statistics.median(hosts) * 1e3,
        host_calls_per_step=(statistics.mean(calls) if calls else None),
    )


def engine_decode(eng: Engine):
    """The Engine's decode call as it runs it: the compiled step, then the greedy picker
    (every row here is greedy) -> (int32 [2, B]: the tokens and the status, caches). `rows`:
    the row index of a decode bucket below max_slots (none: every row)."""

    def call(params, tokens, caches, lengths, committed, *rows):
        logits, status, caches, _ = eng._decode(
            params, tokens, caches, lengths, committed, eng._inputs["status"], *rows
        )
        eng._inputs.replace("status", status)  # returned in the donated input, as the Engine does
        return greedy(eng, logits, status, *rows), caches

    return call


def greedy(eng: Engine, logits, status, *rows):
    """The Engine's argmax picker as it calls it: the tokens written into its `tokens` input
    in place (donated, taken back); returns the picked tokens and the status, int32 [2, B]."""
    field, picked = eng._greedy(logits, status, eng._inputs["tokens"], *rows)
    eng._inputs.replace("tokens", field)
    return picked


def bare_decode(eng: Engine):
    """The Engine's decode step with its argmax inside one compiled call (on the bucket's rows
    where given a row index): the difference to the Engine's own is what the picker's second
    call costs on the device."""
    model, attention = eng.model, eng._attention["decode"]

    def run(params, tokens, caches, lengths, committed, rows=None):
        bucket = {} if rows is None else {"rows": rows}
        logits, caches, _ = model.decode_step(
            params, tokens, caches, lengths, layout=Layout.SEQ_MAJOR, committed=committed,
            **bucket, **attention,
        )  # fmt: skip
        return argmax_rows(logits), caches

    return jax.jit(run, donate_argnums=(2,))


def time_pipelined(
    eng: Engine, steps: int, step=None, fresh: bool = False, all_rows: bool = False
) -> tuple[float, float]:
    """(ms per call, handler host calls per call) of the Engine's compiled decode step (or
    `step`, the same arguments), called back to back (the caches fed back, the same lengths:
    each call rewrites the same positions). The per-step inputs are the Engine's own, at fixed
    addresses, or with `fresh` new device arrays every call (as the Engine passed them before
    StepInputs): the difference is what re-recording the CUDA graph costs. The call computes
    the smallest decode bucket that holds the busy rows (as the Engine's would), or with
    `all_rows` every slot's row (the max_slots bucket)."""
    step = engine_decode(eng) if step is None else step
    rows = [s for s in eng._slots if s is not None]
    for s in rows:  # the next token's granule, as a real step reserves it
        eng.cache.ensure_slot(s.slot, int(eng.cache.lengths[s.slot]) + 1)
    bucket = eng.max_slots if all_rows else eng._decode_bucket(len(rows))
    tokens = np.full((eng.max_slots,), 3, np.int32)
    lengths = eng._lengths()
    bound = eng._decode_bound(rows)
    index = eng._row_index(rows, bucket)  # {} for the max_slots bucket
    eng._inputs.write(tokens=tokens, lengths=lengths, bound=bound, **index)
    inputs = eng._inputs

    def args():
        if fresh:
            fixed = (jnp.asarray(a) for a in (tokens, lengths, bound, *index.values()))
        else:
            fixed = (inputs[k] for k in ("tokens", "lengths", "bound", *index))
        return tuple(fixed)

    caches = eng._caches()
    out = None
    t0, c0 = 0.0, None
    for i in range(steps + 1):
        if i == 1:  # the first call waits for nothing before it: not timed
            jax.block_until_ready(out)
            t0, c0 = time.perf_counter(), host_calls()
        tok, lens, bnd, *rows_arg = args()
        out, caches = step(eng.params, tok, caches, lens, bnd, *rows_arg)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    calls = None if c0 is None else (host_calls() - c0) / steps
    eng._accept(caches, verify=False)
    return seconds / steps * 1e3, calls


def matmul_flops(config, tokens: int) -> float:
    """FLOPs of the projections and the MLP for `tokens` rows (the logits are per sequence,
    left out): 2 * tokens * the decoder's weight elements."""
    H, D = config.hidden_size, config.head_dim
    qkv = H * (config.num_q_heads + 2 * config.num_kv_heads) * D
    per_layer = qkv + config.num_q_heads * D * H + 3 * H * config.intermediate_size
    return 2.0 * tokens * per_layer * config.num_layers


def kernel_split(calls: int, run) -> dict:
    """Device microseconds per call of `run()` (which makes `calls` calls) by kernel kind,
    from one jax.profiler trace."""
    sys.path.insert(0, str(Path(__file__).parent))
    from jax.profiler import ProfileData
    from step_profile import device_kernels

    with tempfile.TemporaryDirectory() as d:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        with jax.profiler.trace(d, profiler_options=opts):
            run()
        (xplane,) = Path(d).rglob("*.xplane.pb")
        events = device_kernels(ProfileData.from_file(str(xplane)))
    split = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    names: dict[str, float] = {}
    for start, end, name in events:
        kind = next((k for k, rx in KERNEL_KINDS if rx.search(name)), "other")
        split[kind] += (end - start) / 1e3 / calls
        names[name[:60]] = names.get(name[:60], 0.0) + (end - start) / 1e3 / calls
    split["top"] = dict(sorted(names.items(), key=lambda kv: -kv[1])[:8])
    return split


def call_prefill(eng: Engine, name: str, holder: list, n: int) -> None:
    """n calls of the Engine's compiled prefill step on its written inputs, back to back:
    holder = [caches (fed back), the last picker's int32 [2, B]: tokens, status]; waits for
    the last."""
    inputs = eng._inputs
    for _ in range(n):
        logits, status, holder[0], _ = eng._prefill(
            eng.params, inputs[name], inputs["cu_seqlens"], holder[0], inputs["lengths"],
            eng.cache.committed, inputs["tokens"], inputs["bound"],
        )  # fmt: skip
        holder[1] = greedy(eng, logits, status)
    jax.block_until_ready(holder[1])


def time_mixed(eng: Engine, piece: int, steps: int, profile: bool) -> dict:
    """The Engine's compiled prefill call with a `piece`-token prompt piece in an idle slot,
    beside the decoding rows (`mixed`) and with them idle (`piece only`), called back to back
    on the same inputs as time_pipelined does. The piece's slot is released afterwards."""
    if piece not in eng.prefill_buckets():
        raise SystemExit(f"--piece: expected one of the prefill buckets {eng.prefill_buckets()}")
    idle = [b for b, s in enumerate(eng._slots) if s is None]
    if not idle:
        raise SystemExit("--piece: needs a free slot beside the busy ones (busy < slots)")
    s = idle[0]
    rows = [q for q in eng._slots if q is not None]
    for q in rows:
        eng.cache.ensure_slot(q.slot, int(eng.cache.lengths[q.slot]) + 1)
    eng.cache.ensure_slot(s, piece)
    counts = np.zeros((eng.max_slots,), np.int32)
    counts[s] = piece
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    name = f"prefill_tokens_{piece}"
    rng = np.random.default_rng(1)
    lengths = eng._lengths()
    tokens = rng.integers(3, eng.model.config.vocab_size, piece).astype(np.int32)
    decode_tokens = np.full((eng.max_slots,), 3, np.int32)
    out: dict = {}
    try:
        for label, bound in (
            ("mixed", eng._decode_bound(rows)),
            ("piece_only", np.zeros((eng.max_slots,), np.int32)),
        ):
            eng._inputs.write(lengths=lengths, cu_seqlens=cu, tokens=decode_tokens, bound=bound,
                              **{name: tokens})  # fmt: skip
            holder = [eng._caches(), None]
            run = functools.partial(call_prefill, eng, name, holder)
            run(1)
            t0 = time.perf_counter()
            run(steps)
            out[f"{label}_ms"] = (time.perf_counter() - t0) / steps * 1e3
            if profile:
                out[f"{label}_kernels_us"] = kernel_split(steps, functools.partial(run, steps))
            eng._accept(holder[0], verify=False)
    finally:
        eng.cache.release_slot(s)
    return out


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
    ap.add_argument(
        "--piece",
        type=int,
        default=0,
        help="also time the mixed call with a piece of this many prompt tokens",
    )
    ap.add_argument(
        "--generator",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the Generator's step at B=busy too",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="split the calls' device time by kernel kind (jax.profiler)",
    )
    ap.add_argument(
        "--decode-row-buckets",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Engine(decode_row_buckets=); default the Engine's (on from 128 slots)",
    )
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
    eng = Engine(model, max_slots=args.slots, max_len=args.max_len, prefix_cache=False,
                 decode_row_buckets=args.decode_row_buckets)  # fmt: skip
    rows = []
    try:
        eng.warm_up()
        decode0 = eng.stats.decode_compiles
        bare = bare_decode(eng)
        for n in [int(x) for x in args.busy.split(",")]:
            prompts = [[int(t) for t in rng.integers(3, config.vocab_size, args.prompt)]
                       for _ in range(n)]  # fmt: skip
            # Enough new tokens that no request ends before the timings do: the first one
            # admitted decodes through the whole fill (a prefill chunk a step) before them.
            # (With 3 * steps + 8 alone, the 128- and 256-row fills of the eleventh session
            # outlasted their first requests: 44 rows were left.)
            fill_steps = -(-n * args.prompt // eng.prefill_chunk_tokens)
            new = 3 * args.steps + 8 + fill_steps
            reqs = fill(eng, prompts, new)
            row = dict(busy=n, prompt=args.prompt, **time_steps(eng, args.steps))
            row["bucket"] = eng._decode_bucket(n)
            row["pipelined_ms"], row["pipelined_host_calls"] = time_pipelined(eng, args.steps)
            row["pipelined_all_rows_ms"], _ = time_pipelined(eng, args.steps, all_rows=True)
            row["fresh_inputs_ms"], row["fresh_inputs_host_calls"] = time_pipelined(
                eng, args.steps, fresh=True
            )
            row["bare_ms"], _ = time_pipelined(eng, args.steps, bare)
            if args.profile:
                row["decode_kernels_us"] = kernel_split(
                    args.steps + 1, lambda: time_pipelined(eng, args.steps)
                )
            if args.piece:
                row.update(time_mixed(eng, args.piece, args.steps, args.profile))
                added = (row["mixed_ms"] - row["pipelined_ms"]) / 1e3
                row["piece_token_us"] = added / args.piece * 1e6
                row["piece_tflop_s"] = matmul_flops(config, args.piece) / added / 1e12
            live = eng.cache.live_bytes
            row["live_kv_bytes"] = int(live)
            row["decoding_rows"] = eng.num_running  # what `busy` says, checked
            for r in reqs:
                r.cancel()
            eng.run_until_idle()
            if args.generator:
                row["generator_ms"] = generator_step_ms(
                    model, prompts, args.steps + 1, args.max_len
                )
            if bandwidth:
                row["roofline_ms"] = (weight_bytes + live) / bandwidth * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
        compiles = eng.stats.decode_compiles - decode0
        buckets = eng.decode_buckets()
    finally:
        eng.close()
    print(
        f"\n{args.model} shape, {args.dtype}, {kind}, {args.slots} slots, max_len {args.max_len}, "
        f"{args.prompt}-token prompts; medians of {args.steps} steps; decode buckets "
        f"{buckets}; decode compiles after warm-up: {compiles}\n"
        "| busy | bucket | engine step ms | host ms | host calls/step | pipelined ms (host calls) "
        "| all rows ms | fresh inputs ms (host calls) | bare ms | Generator ms | roofline ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        roof = f"{r['roofline_ms']:.2f}" if "roofline_ms" in r else "-"
        print(
            f"| {r['busy']} | {r['bucket']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{count(r['host_calls_per_step'])} | {r['pipelined_ms']:.2f} "
            f"({count(r['pipelined_host_calls'])}) | {r['pipelined_all_rows_ms']:.2f} | "
            f"{r['fresh_inputs_ms']:.2f} "
            f"({count(r['fresh_inputs_host_calls'])}) | {r['bare_ms']:.2f} | "
            f"{r.get('generator_ms', float('nan')):.2f} | {roof} |"
        )
    if args.piece:
        peak = BF16_FLOP_PER_S.get(kind)
        print(
            f"\nThe mixed call: a {args.piece}-token piece beside the busy rows' decode "
            "(pipelined ms; the piece's TFLOP/s counts its projections and MLP alone"
            + (f", against {peak / 1e12:.0f} dense bf16" if peak else "")
            + ")\n"
            "| busy | decode ms | mixed ms | piece only ms | added by the piece ms "
            "| per piece token us | piece TFLOP/s |\n|---|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| {r['busy']} | {r['pipelined_ms']:.2f} | {r['mixed_ms']:.2f} | "
                f"{r['piece_only_ms']:.2f} | {r['mixed_ms'] - r['pipelined_ms']:.2f} | "
                f"{r['piece_token_us']:.1f} | {r['piece_tflop_s']:.0f} |"
            )
    if args.profile:
        print("\nDevice us per call by kernel kind (gemm / attention / other), profiled")
        for r in rows:
            for label in ("decode", "mixed", "piece_only"):
                split = r.get(f"{label}_kernels_us")
                if split:
                    # The decode call's GEMMs run its bucket's rows; the mixed call's every
                    # row, busy or not, and the piece.
                    m = r["bucket"] if label == "decode" else args.slots + args.piece
                    gemm = split["gemm"]
                    rate = matmul_flops(config, m) / (gemm / 1e6) / 1e12 if gemm else 0.0
                    print(
                        f"busy {r['busy']:>3} {label:>10}: gemm {gemm:8.0f} ({rate:4.0f} "
                        f"TFLOP/s at M={m}), attention {split['attention']:7.0f}, other "
                        f"{split['other']:7.0f}; top: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in list(split["top"].items())[:4])
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
