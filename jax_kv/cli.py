"""`python -m jax_kv`: `generate` (the product: a model, a prompt, streamed tokens, the stats of
what the memory and the compiled step did), `serve` (an OpenAI-compatible server on the
engine) and `demo` (the ops alone)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Exit statuses: a user error (argparse's own); output cut short by a closed pipe and Ctrl-C
# (128 + SIGPIPE, 128 + SIGINT: what a shell reports for a program those signals killed).
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Input the user has to fix: printed as one `error: ...` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument raises UserError (one line, no usage block), so every
    user error leaves through the same place in `main`."""

    def error(self, message: str) -> Any:  # argparse: must not return
        raise UserError(message.removeprefix("argument "))


def _int_arg(low: int, high: int | None = None, spelled: str = "") -> Callable[[str], int]:
    expect = spelled or (f"an int >= {low}" if high is None else f"an int in [{low}, {high}]")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expect}, got {text!r}")
        return value

    return parse


def _power_of_two(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two >= 1, got {text!r}")
    return value


def _float_arg(expect: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"expected {expect}, got {text!r}")
        return value

    return parse


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


def _make_arena(kind: str) -> Any:
    """--arena: None lets the cache choose (VMM on CUDA, eager elsewhere)."""
    if kind == "auto":
        return None
    from jax_kv.memory import EagerArena, VmmArena

    if kind == "eager":
        return EagerArena()
    try:
        return VmmArena()
    except (RuntimeError, ImportError, OSError) as e:  # no CUDA device, driver or cuda-python
        raise UserError(
            f"--arena vmm: needs a CUDA GPU with virtual memory ({_one_line(e)})"
        ) from e


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
    # Everything the user typed is checked before the model loads (seconds to minutes).
    if args.model is not None and not Path(args.model).exists():
        raise UserError(f"--model: {args.model}: no such file or directory")
    import jax

    import jax_kv.models as jm
    from jax_kv.decode import Generator, Sampling

    sampling = Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    arena = _make_arena(args.arena)
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    t0 = time.perf_counter()
    model = jm.load(args.model, dtype=dtype) if args.model else jm.default(dtype=dtype)
    load_s = time.perf_counter() - t0
    prompt = args.prompt
    if args.chat:
        prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
    n = len(model.encode(prompt))
    limit = args.max_len or model.config.max_position_embeddings
    if n >= limit:
        where = "--max-len" if args.max_len else "the model's max_position_embeddings"
        raise UserError(
            f"--prompt: expected fewer than {limit} tokens ({where}) to leave room for a new "
            f"token, got {n}"
        )
    gen = Generator(
        model,
        layout=args.layout,
        max_len=args.max_len,
        min_bucket=args.min_bucket,
        arena=arena,
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
        out = dict(
            tokens=result.tokens[0],
            text=result.texts[0] if result.texts else None,
            prompt=prompt,
            model=model.source,
            dtype=dtype,
            backend=jax.default_backend(),
            stats=stats,
        )
        finish_reasons = getattr(result, "finish_reasons", None)
        if finish_reasons is not None:
            out["finish_reasons"] = list(finish_reasons)
        print(json.dumps(out))
    else:
        print("\n")
        print(f"{model.source} ({dtype}, {jax.default_backend()}), loaded in {load_s:.1f} s")
        print(_stats_table(result.stats))
    return 0


def serve(args: argparse.Namespace) -> int:
    if args.model is not None and not Path(args.model).exists():
        raise UserError(f"--model: {args.model}: no such file or directory")
    try:
        from jax_kv.server import engine_process
        from jax_kv.server import main as server_main
    except ImportError as e:
        raise UserError(
            f"serve needs the server extra ({e.name} is missing): pip install 'jax_kv[serve]'"
        ) from None
    import jax

    if args.random_weights and args.model:
        raise UserError("--random-weights: give it or --model, not both")
    # Only past one device: counting them starts this process's backend (on a GPU, a CUDA
    # context the engine's process would then share the device with).
    if args.tp > 1 and args.tp > jax.device_count():
        raise UserError(f"--tp: {args.tp} devices asked for, {jax.device_count()} present")
    if args.random_weights:
        name = args.served_model_name or f"random-{args.random_weights}"
    else:
        name = args.served_model_name or (
            Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
        )
    load = functools.partial(load_served_model, args.model, args.random_weights, args.dtype)
    make_engine = functools.partial(
        engine_process.build_engine, load, tp=args.tp, max_slots=args.max_slots,
        max_len=args.max_len, prefill_chunk_tokens=args.prefill_chunk_tokens,
        max_queue=args.max_queue,
    )  # fmt: skip
    return server_main.run(
        make_engine, model_name=name, host=args.host, port=args.port, api_key=args.api_key,
        engine_process=not args.engine_in_process, tp=args.tp,
    )  # fmt: skip


def load_served_model(path: str | None, random_weights: str | None, dtype: str | None) -> Any:
    """serve's model, loaded where the engine runs: `path`, else random weights of a preset,
    else the embedded default; dtype default bfloat16 on a GPU, float32 elsewhere."""
    import jax

    import jax_kv.models as jm

    dtype = dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if random_weights:
        return jm.random_model(random_weights, dtype=dtype)
    return jm.load(path, dtype=dtype) if path else jm.default(dtype=dtype)


def demo(args: argparse.Namespace) -> int:
    import jax

    from jax_kv import demo as demo_mod

    print(f"jax {jax.__version__} on {jax.default_backend()}")
    demo_mod.run(steps=args.steps)
    return 0


def jm_presets() -> list[str]:
    from jax_kv.models.config import PRESETS

    return list(PRESETS)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m jax_kv")
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
    g.add_argument("--max-new-tokens", type=_int_arg(1), default=32, metavar="N")
    g.add_argument("--layout", default="seq-major", choices=["seq-major", "head-major"])
    g.add_argument(
        "--max-len",
        type=_int_arg(1),
        default=None,
        metavar="N",
        help="tokens per sequence, prompt included (default: the model's)",
    )
    g.add_argument(
        "--min-bucket",
        type=_power_of_two,
        default=None,
        metavar="N",
        help="capacity floor and bucket base (default: JAX_KV_MIN_BUCKET, else 256)",
    )
    g.add_argument("--tokens-per-call", type=_int_arg(1), default=1, metavar="K")
    g.add_argument(
        "--arena",
        choices=["auto", "vmm", "eager"],
        default="auto",
        help="KV memory: vmm (CUDA virtual memory), eager (XLA buffers), auto (vmm on CUDA, "
        "eager elsewhere)",
    )
    g.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="default: bfloat16 on GPU, float32 on CPU",
    )
    g.add_argument(
        "--temperature",
        type=_float_arg("a finite number >= 0", lambda t: t >= 0),
        default=0.0,
        help="0 = greedy",
    )
    g.add_argument("--top-k", type=_int_arg(0), default=0, metavar="K", help="0 = all")
    g.add_argument(
        "--top-p",
        type=_float_arg("a number in (0, 1]", lambda p: 0 < p <= 1),
        default=1.0,
        metavar="P",
    )
    g.add_argument(
        "--seed", type=_int_arg(-(2**63), 2**63 - 1, "an int in [-2**63, 2**63)"), default=0
    )
    g.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    g.set_defaults(run=generate)
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    )
    s.add_argument("--model", help="a checkpoint directory or .gguf (default: SmolLM2-135M)")
    s.add_argument(
        "--random-weights",
        choices=sorted(jm_presets()),
        default=None,
        help="serve random weights of a preset shape (benchmarks; prompts as token ids)",
    )
    s.add_argument("--served-model-name", default=None, help="the name clients use")
    s.add_argument("--host", default="127.0.0.1", help="default: localhost only")
    s.add_argument("--port", type=_int_arg(0, 65535), default=8000)
    s.add_argument("--max-slots", type=_int_arg(1), default=8, metavar="N")
    s.add_argument("--max-len", type=_int_arg(2), default=None, metavar="N")
    s.add_argument("--prefill-chunk-tokens", type=_int_arg(16), default=512, metavar="N")
    s.add_argument("--max-queue", type=_int_arg(1), default=1024, metavar="N")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    s.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    s.add_argument(
        "--tp", type=_int_arg(1), default=1, metavar="N",
        help="tensor parallelism over the KV heads of the first N devices (default 1)",
    )  # fmt: skip
    s.add_argument(
        "--engine-in-process", action="store_true",
        help="run the engine on a thread of the server's process (default: a process of its "
        "own, so the event loop and the engine do not share a GIL)",
    )  # fmt: skip
    s.set_defaults(run=serve)
    d = sub.add_parser(
        "demo",
        help="prefill + decode through one attention layer, both "
        "layouts, and print their agreement",
    )
    d.add_argument("--steps", type=_int_arg(1), default=8, metavar="N")
    d.set_defaults(run=demo)
    return parser


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so the flush at interpreter exit does not raise
    BrokenPipeError again (the recipe of Python's signal docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor
        pass


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    A user error (a bad argument, a missing or unreadable model, input the library refuses
    with ValueError) prints one line `error: ...` to stderr and returns 2, without a
    traceback; a reader that closes the pipe early (`| head`) ends it quietly (141).
    """
    try:
        args = _parser().parse_args(argv)
        status = args.run(args)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (UserError, ValueError, OSError) as e:
        # Bad input is the user's to fix: say what and where, without a traceback.
        # (ValueError: the library's refusals name the argument; OSError: files.)
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
