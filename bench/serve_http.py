"""Issue 22's load test: concurrent streaming clients against `python -m jax_kv serve` on
localhost, and the same requests on an Engine in this process (the server's overhead is the
difference).

Each client opens its own connection, POSTs /v1/completions with token ids (exact prompt
lengths), stream: true, greedy, and reads the server-sent events to [DONE]. Every request must
complete or be refused with 429; a completed one must carry the tokens the Engine gives it
alone (usage.completion_tokens equal, text equal): none lost, none truncated. Printed: TTFT and
inter-token latency p50/p99 as the clients see them, HTTP output tokens/s, Engine tokens/s on
the same workload, their ratio (target >= 0.9).

    python bench/serve_http.py --clients 200                      # default model, CPU
    python bench/serve_http.py --random-weights llama-3-8b --dtype bfloat16 --max-slots 64 \\
        --max-len 4096 --clients 200 --out bench/results          # the device
    python bench/serve_http.py --max-slots 64 --max-len 4096 --stub-device-ms 10   # on a CPU

`--stub-device-ms MS` replaces the device on a CPU machine: the Engine (here and in the server
process) runs a tiny random model whose compiled steps are stubbed, and each call's tokens
become readable MS milliseconds after the call (plus `--stub-token-us` per prefill token),
the host thread sleeping meanwhile with the GIL released, as it waits for a GPU. The server's
host work per token (the event loop's wake-ups, SSE chunks, sockets) then competes with the
Engine's for the GIL as it does beside a GPU, which a CPU-bound model (each step hundreds of
milliseconds) hides.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_one(port: int, body: dict, t_start: float, textless: bool) -> dict:
    """One client: -> status, token times (s from t_start), text, usage, finish reason."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    out: dict = dict(status=status, times=[], text="", usage=None, finish=None)
    if status != 200:
        out["error"] = (await reader.read()).decode(errors="replace")[-300:]
        writer.close()
        return out
    while True:
        line = await reader.readline()
        if not line:
            break
        # Chunked transfer: skip the size lines; events are "data: ..." lines.
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            out["done"] = True
            break
        event = json.loads(payload)
        if event.get("usage"):
            out["usage"] = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                out["finish"] = choice["finish_reason"]
            # A token event: text, or none for a model without a tokenizer (its events carry
            # empty text); a token whose text is held back sends none.
            elif choice.get("text") or (textless and "text" in choice):
                out["text"] += choice["text"]
                out["times"].append(time.perf_counter() - t_start)
    writer.close()
    return out


async def run_clients(port: int, bodies: list[dict], textless: bool) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_one(port, b, t0, textless) for b in bodies))
    return list(results), time.perf_counter() - t0


class _Delayed:
    """A stubbed step's tokens: readable `ready_at` (perf_counter seconds), like a GPU
    output: reading it earlier sleeps (the GIL released) until then."""

    is_fully_addressable = True

    def __init__(self, tokens: np.ndarray, ready_at: float) -> None:
        self.tokens, self.ready_at = tokens, ready_at

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.tokens if dtype is None else self.tokens.astype(dtype)


def _stacked(tokens: _Delayed) -> _Delayed:
    """A stubbed picker's output: the tokens over a row of zeros (every status ok)."""
    return _Delayed(np.stack([tokens.tokens, np.zeros_like(tokens.tokens)]), tokens.ready_at)


def stub_device(
    engine, step_ms: float, token_us: float, dispatch_us: float = 0.0, seed: int = 0
) -> None:
    """Stubs `engine`'s compiled steps and pickers (bench/engine_host.py's stand-in: random
    tokens, the caches returned as they came) with a simulated device: a call's tokens are
    ready step_ms (+ token_us per packed prefill token) after it is dispatched, and calls run
    one after another. The dispatch itself holds the GIL for dispatch_us (JAX's dispatch of a
    real step, its ~300 arguments)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    B = engine.max_slots
    vocab = engine.model.config.vocab_size
    status = jnp.zeros((B,), jnp.int32)
    free_at = [0.0]  # when the simulated device finishes the calls dispatched so far

    def step_stub(caches_at: int, prefill: bool):
        def run(params, *step_args):  # -> (logits, status [B], caches, positions [B])
            spin = time.perf_counter() + dispatch_us * 1e-6
            while time.perf_counter() < spin:
                pass
            busy = step_ms * 1e-3 + (token_us * 1e-6 * step_args[0].shape[0] if prefill else 0)
            free_at[0] = max(free_at[0], time.perf_counter()) + busy
            tokens = rng.integers(3, vocab, B).astype(np.int32)
            # The decode step returns its status in its `status` input (donated; the field
            # the Engine takes back), the 5th of its arguments after the params.
            out_status = status if prefill else step_args[4]
            return _Delayed(tokens, free_at[0]), out_status, step_args[caches_at - 1], status

        return run

    engine._prefill, engine._decode = step_stub(3, True), step_stub(2, False)
    # (the tokens input, the picked tokens and the status as one [2, B] array; a decode
    # bucket's row index, if any, ignored: the stub's tokens are every row's)
    engine._greedy = lambda logits, status, tokens, *rows: (tokens, _stacked(logits))
    engine._sampler = lambda logits, *a: (a[6], _stacked(logits))  # a[6]: the tokens input
    engine._accept = lambda caches, verify: None


def stub_engine(step_ms: float, token_us: float, dispatch_us: float, **engine_kwargs):
    """An Engine on the tiny random model whose calls run on stub_device: built where the
    server's engine runs (its own process, or the server's)."""
    import jax_kv.models as jm
    from jax_kv.engine import Engine

    eng = Engine(jm.random_model("tiny-llama", seed=0, dtype="float32"), **engine_kwargs)
    stub_device(eng, step_ms, token_us, dispatch_us)
    return eng


def serve_stub(argv: list[str]) -> None:
    """The server process of --stub-device-ms: `python -m jax_kv serve`'s run() with its
    Engine on stub_device."""
    step_ms, token_us, dispatch_us, port, slots, max_len, chunk, in_process = argv
    import jax_kv.server.main as server_main

    make_engine = functools.partial(
        stub_engine, float(step_ms), float(token_us), float(dispatch_us),
        max_slots=int(slots), max_len=int(max_len), prefill_chunk_tokens=int(chunk),
    )  # fmt: skip
    sys.exit(server_main.run(make_engine, model_name="bench", port=int(port),
                             log_level="warning", engine_process=in_process != "1"))  # fmt: skip


def counters(stats) -> dict[str, float]:
    """An Engine's counters by the names /metrics gives them (engine_counters)."""
    from jax_kv.server.metrics import engine_counters

    return {name: float(value) for name, (_, value) in engine_counters(stats).items()}


def scrape(port: int, names: Iterable[str]) -> dict[str, float]:
    """The server engine's counters `names` from GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted, values = set(names), {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.removeprefix("jax_kv_").removesuffix("_total")
        if key in wanted:
            values[key] = float(value)
    return values


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid` and of its child
    processes (the engine's, when serve runs it apart), from /proc (empty where there is
    none): tid == pid is the main thread, the server's event loop."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            children = (task / "children").read_text().split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
        for child in children:
            out.update(thread_cpu(int(child)))
    return out


def engine_summary(c: dict[str, float]) -> dict[str, float]:
    """Compiles, steps and time per step of a run from its counters' differences."""
    steps = max(c["engine_steps"], 1)
    return dict(
        compiles=c["decode_compiles"] + c["prefill_compiles"] + c["picker_compiles"],
        steps=c["engine_steps"], step_ms=c["engine_step_seconds"] / steps * 1e3,
        host_ms=c["engine_host_seconds"] / steps * 1e3, tokens=c["generation_tokens"],
        **{f"{part}_ms": c[f"engine_{part}_seconds"] / steps * 1e3
           for part in ("dispatch", "beside", "wait", "deliver")},
    )  # fmt: skip


def pct(x, q) -> float:
    return float(np.percentile(x, q) * 1e3) if len(x) else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--model", default=None, help="checkpoint path (default: SmolLM2-135M)")
    ap.add_argument("--random-weights", default=None, help="a preset shape with random weights")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prompt-median", type=int, default=40)
    ap.add_argument("--output-median", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--stub-device-ms",
        type=float,
        default=None,
        help="a simulated device on a CPU: each call's tokens ready after MS ms",
    )
    ap.add_argument(
        "--stub-token-us",
        type=float,
        default=20.0,
        help="with --stub-device-ms: a prefill call's extra time per token",
    )
    ap.add_argument(
        "--stub-dispatch-us",
        type=float,
        default=1000.0,
        help="with --stub-device-ms: host time (GIL held) to dispatch a call",
    )
    ap.add_argument(
        "--engine-in-process",
        action="store_true",
        help="the server runs its engine on a thread of its own process (serve's flag)",
    )
    args = ap.parse_args()
    stub = args.stub_device_ms is not None

    import jax_kv.models as jm
    from jax_kv.engine import Engine

    dtype = args.dtype or "float32"
    if stub:
        args.random_weights, dtype = "tiny-llama", "float32"
        model = jm.random_model("tiny-llama", seed=args.seed, dtype=dtype)
    elif args.random_weights:
        model = jm.random_model(args.random_weights, seed=args.seed, dtype=dtype)
    else:
        model = jm.load(args.model, dtype=dtype) if args.model else jm.default(dtype=dtype)
    rng = np.random.default_rng(args.seed)
    n = args.clients
    plens = np.clip(rng.lognormal(math.log(args.prompt_median), 0.8, n), 1, args.max_len // 2)
    news = np.clip(rng.lognormal(math.log(args.output_median), 0.8, n), 1, args.max_len // 2)
    vocab = model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, min(vocab, 30000), int(p))] for p in plens]
    news = [int(x) for x in news]
    name = "bench"
    bodies = [
        dict(model=name, prompt=p, max_tokens=k, temperature=0, stream=True,
             stream_options={"include_usage": True})
        for p, k in zip(prompts, news, strict=True)
    ]  # fmt: skip

    # The Engine alone, same requests, all at once (after its warm-up).
    eng = Engine(model, max_slots=args.max_slots, max_len=args.max_len,
                 prefill_chunk_tokens=args.chunk, max_queue=n + 1)  # fmt: skip
    if stub:
        stub_device(eng, args.stub_device_ms, args.stub_token_us, args.stub_dispatch_us)
    eng.warm_up()
    before = counters(eng.stats)
    t0 = time.perf_counter()
    reqs = [eng.submit(p, k) for p, k in zip(prompts, news, strict=True)]
    eng.run_until_idle()
    engine_s = time.perf_counter() - t0
    after = counters(eng.stats)
    alone = engine_summary({k: after[k] - before[k] for k in after})
    want = [r.result() for r in reqs]
    eng.close()
    engine_tokens = sum(c.completion_tokens for c in want)

    port = free_port()
    cmd = [sys.executable, "-m", "jax_kv", "serve", "--port", str(port),
           "--served-model-name", name, "--max-slots", str(args.max_slots),
           "--max-len", str(args.max_len), "--prefill-chunk-tokens", str(args.chunk),
           "--dtype", dtype]  # fmt: skip
    if stub:
        stub_args = (args.stub_device_ms, args.stub_token_us, args.stub_dispatch_us, port,
                     args.max_slots, args.max_len, args.chunk,
                     int(args.engine_in_process))  # fmt: skip
        cmd = [sys.executable, __file__, "--serve-stub", *map(str, stub_args)]
    elif args.random_weights:
        cmd += ["--random-weights", args.random_weights]
    elif args.model:
        cmd += ["--model", args.model]
    if args.engine_in_process and not stub:
        cmd += ["--engine-in-process"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=dict(os.environ))  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server failed: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        names = list(after)
        before, cpu0 = scrape(port, names), thread_cpu(server.pid)
        results, http_s = asyncio.run(run_clients(port, bodies, model.tokenizer is None))
        after, cpu1 = scrape(port, names), thread_cpu(server.pid)
        while True:  # the last step is counted just after its tokens reached the clients
            time.sleep(0.3)
            again = scrape(port, names)
            if again["engine_steps"] == after["engine_steps"]:
                break
            after = again
        # The event loop (the main thread) against the busiest other thread (the driver, on a
        # thread of the server or in the engine's process).
        used = {t: cpu1[t] - cpu0.get(t, 0.0) for t in cpu1}
        loop_cpu = used.pop(server.pid, math.nan)
        driver_cpu = max(used.values(), default=math.nan)
        served = engine_summary({k: after[k] - before[k] for k in names})
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(120)
    refused = sum(r["status"] == 429 for r in results)
    ok = [r for r in results if r["status"] == 200]
    bad_status = [r["status"] for r in results if r["status"] not in (200, 429)]
    lost = [i for i, r in enumerate(results) if r["status"] == 200 and not r.get("done")]
    wrong = [
        i for i, r in enumerate(results) if r["status"] == 200 and (
            r["usage"] is None or r["usage"]["completion_tokens"] != want[i].completion_tokens
            or r["text"] != (want[i].text or ""))
    ]  # fmt: skip
    http_tokens = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    ttft = [r["times"][0] for r in ok if r["times"]]
    itl = np.concatenate([np.diff(r["times"]) for r in ok if len(r["times"]) > 1] or [[]])
    m = dict(
        clients=n, completed=len(ok), refused_429=refused, other_status=bad_status,
        lost=len(lost), truncated_or_different=len(wrong), server_exit_code=code,
        http_tok_s=http_tokens / http_s, engine_tok_s=engine_tokens / engine_s,
        ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99),
        itl_p50_ms=pct(itl, 50), itl_p99_ms=pct(itl, 99),
    )  # fmt: skip
    m["http_over_engine"] = m["http_tok_s"] / m["engine_tok_s"]
    m["engine_alone"], m["engine_in_server"] = alone, served
    m["server_loop_cpu_s"], m["server_busiest_thread_cpu_s"] = loop_cpu, driver_cpu
    print(
        f"\n{args.random_weights or args.model or 'SmolLM2-135M-Instruct'} ({dtype}), "
        f"{args.max_slots} slots, {n} concurrent streaming clients, prompt median "
        f"{args.prompt_median}, output median {args.output_median}, greedy, GIL switch "
        f"interval {sys.getswitchinterval() * 1e3:g} ms, the server's engine "
        f"{'on a thread of its process' if args.engine_in_process else 'in its own process'}"
    )
    print("| completed | 429 | lost | truncated/different | TTFT p50/p99 ms | ITL p50/p99 ms "
          "| HTTP tok/s | Engine tok/s | HTTP/Engine |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(ok)} | {refused} | {len(lost)} | {len(wrong)} | {m['ttft_p50_ms']:.0f}/"
        f"{m['ttft_p99_ms']:.0f} | {m['itl_p50_ms']:.1f}/{m['itl_p99_ms']:.1f} | "
        f"{m['http_tok_s']:.0f} | {m['engine_tok_s']:.0f} | {m['http_over_engine']:.2f} |"
    )
    print(
        "\nThe engine's steps over the run (counters; the server's from /metrics), ms per step: "
        "host outside the calls; a call's dispatch, work beside it, wait for its tokens; of the "
        "host and beside time, the delivery of tokens to their requests"
    )
    print("| engine | compiles | steps | ms/step | host | dispatch | beside | wait | deliver | "
          "tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, e in (("alone", alone), ("in the server", served)):
        print(f"| {name} | {e['compiles']:.0f} | {e['steps']:.0f} | {e['step_ms']:.2f} | "
              f"{e['host_ms']:.2f} | {e['dispatch_ms']:.2f} | {e['beside_ms']:.2f} | "
              f"{e['wait_ms']:.2f} | {e['deliver_ms']:.2f} | {e['tokens']:.0f} |")  # fmt: skip
    print(
        f"The server's threads over the {http_s:.2f} s run: event loop {loop_cpu:.2f} CPU s "
        f"({loop_cpu / http_s:.0%} of the run, {loop_cpu / max(http_tokens, 1) * 1e6:.0f} us per "
        f"token), busiest other thread {driver_cpu:.2f} CPU s ({driver_cpu / http_s:.0%})"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"serve_http_{args.random_weights or 'default'}.json"
        meta = vars(args) | {"out": str(args.out), "switch_interval_s": sys.getswitchinterval()}
        path.write_text(json.dumps(dict(meta=meta, results=m), indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-stub"]:
        serve_stub(sys.argv[2:])
    else:
        main()
