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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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
    args = ap.parse_args()

    import jax_kv.models as jm
    from jax_kv.engine import Engine

    dtype = args.dtype or "float32"
    if args.random_weights:
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
    eng.warm_up()
    t0 = time.perf_counter()
    reqs = [eng.submit(p, k) for p, k in zip(prompts, news, strict=True)]
    eng.run_until_idle()
    engine_s = time.perf_counter() - t0
    want = [r.result() for r in reqs]
    eng.close()
    engine_tokens = sum(c.completion_tokens for c in want)

    port = free_port()
    cmd = [sys.executable, "-m", "jax_kv", "serve", "--port", str(port),
           "--served-model-name", name, "--max-slots", str(args.max_slots),
           "--max-len", str(args.max_len), "--prefill-chunk-tokens", str(args.chunk),
           "--dtype", dtype]  # fmt: skip
    if args.random_weights:
        cmd += ["--random-weights", args.random_weights]
    elif args.model:
        cmd += ["--model", args.model]
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
        results, http_s = asyncio.run(run_clients(port, bodies, model.tokenizer is None))
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
    print(
        f"\n{args.random_weights or args.model or 'SmolLM2-135M-Instruct'} ({dtype}), "
        f"{args.max_slots} slots, {n} concurrent streaming clients, prompt median "
        f"{args.prompt_median}, output median {args.output_median}, greedy"
    )
    print("| completed | 429 | lost | truncated/different | TTFT p50/p99 ms | ITL p50/p99 ms "
          "| HTTP tok/s | Engine tok/s | HTTP/Engine |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(ok)} | {refused} | {len(lost)} | {len(wrong)} | {m['ttft_p50_ms']:.0f}/"
        f"{m['ttft_p99_ms']:.0f} | {m['itl_p50_ms']:.1f}/{m['itl_p99_ms']:.1f} | "
        f"{m['http_tok_s']:.0f} | {m['engine_tok_s']:.0f} | {m['http_over_engine']:.2f} |"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"serve_http_{args.random_weights or 'default'}.json"
        path.write_text(json.dumps(dict(meta=vars(args) | {"out": str(args.out)}, results=m),
                                   indent=1))  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
