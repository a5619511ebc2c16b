"""Issue 21's table: the continuous-batching Engine against the static Generator and a
JetStream-style dense slot engine (bench/dense_slots.py), on one seeded workload.

Workload 1, mixed: prompt and output lengths lognormal (medians 300 and 200 tokens, capped at
8k and 2k; prompt + output <= max_len), random token ids, Poisson arrivals at each rate
(`inf`: all at once, offline). Random weights of a named shape, greedy, stop tokens off.

Per engine and rate: output tokens/s, requests/s, TTFT and inter-token latency p50/p99 (ms);
for the Engine also peak and mean committed KV bytes against live KV bytes (and the floor of
one granule per binding and slot in use), decode and prefill compiles after warm-up,
preemptions, host time per step, and the decode step's time at >= 90% busy slots against the
bandwidth roofline (weight bytes + live KV bytes per step / 4.8 TB/s, the issue's H200 figure;
`decode_roofline_ratio_card` divides by the card's own HBM bandwidth, from engine_step's table).

How each engine is timed: the Engine and the dense engine run for real on a wall clock that
starts at the first arrival, requests submitted as their arrival time passes (between steps),
each token stamped when its step returns. The static Generator processes arrival-order
batches of `slots`: its prefill and decode times are measured (compiles excluded, as the
Generator reports them) and its timeline is built from them, each batch starting when the
previous one ended and its last request arrived. `--static-requests` limits it to the first
N requests (the 8B static run of 1,000 requests takes minutes).

    python bench/serve.py --model llama-3-8b --dtype bfloat16 --slots 64 --max-len 32768 \\
        --requests 1000 --rates 4,8,16,inf --out bench/results
    python bench/serve.py --model tiny-llama --dtype float32 --slots 8 --max-len 1024 \\
        --requests 60 --prompt-median 40 --output-median 20 --rates 50,inf   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import json
import math
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dense_slots import DenseSlotEngine  # noqa: E402
from engine_step import HBM_BYTES_PER_S  # noqa: E402

import jax_kv.models as jm  # noqa: E402
from jax_kv import _ffi  # noqa: E402
from jax_kv.decode import Generator  # noqa: E402
from jax_kv.engine import Engine  # noqa: E402
from jax_kv.memory import ArenaExhausted  # noqa: E402

ISSUE_HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e: issue 21 defines its roofline by it, on any card


class Heartbeat:
    """A progress line every `every` seconds (stderr): a slow run shows where it is instead of
    going silent until its row (the first 8B run was killed at its limit with no line)."""

    def __init__(self, eng: Engine, n: int) -> None:
        every = float(os.environ.get("SERVE_HEARTBEAT_S", 15))
        self.eng, self.n, self.every, self.next = eng, n, every, every
        # warm_up's requests are not the workload's (the H100 run printed "finished 155" of 150)
        self.finished0 = sum(eng.stats.finished.values())
        self.steps0, self.decode0 = eng.stats.steps, eng.stats.decode_tokens

    def __call__(
        self, now: float, submitted: int, steps: list, host: list, host_calls: list
    ) -> None:
        if now < self.next:
            return
        self.next = now + self.every
        s, k = self.eng.stats, min(len(steps), 50)
        recent = f"{np.mean(steps[-k:]) * 1e3:.1f} ms/step ({np.mean(host[-k:]) * 1e3:.1f} host)"
        if host_calls:  # a run cut short by its limit still shows whether the graph replays
            last = host_calls[-50:]
            recent += (
                f", graph re-recorded in {sum(1 for c in last if c)} of {len(last)} decode steps"
            )
        print(
            f"  [{now:.0f} s] submitted {submitted}/{self.n}, running {self.eng.num_running}, "
            f"waiting {self.eng.num_waiting}, finished {sum(s.finished.values()) - self.finished0}"
            f", steps {s.steps - self.steps0}, decode tokens {s.decode_tokens - self.decode0}, "
            f"last {k} steps "
            f"{recent if k else '-'}",
            file=sys.stderr, flush=True,
        )  # fmt: skip


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    news: list[int]

    @property
    def output_tokens(self) -> int:
        return int(sum(self.news))


def make_workload(rng, args, vocab: int) -> Workload:
    if args.workload == "shared-prefix":
        return shared_prefix_workload(rng, args, vocab)
    return mixed_workload(rng, args, vocab)


def shared_prefix_workload(rng, args, vocab: int) -> Workload:
    """Workload 2, shaped like SGLang's generated-shared-prefix benchmark: groups of prompts
    that share a system prompt, each with its own question; groups interleaved in order."""
    prompts, news = [], []
    systems = [[int(t) for t in rng.integers(3, vocab, args.system_tokens)]
               for _ in range(args.groups)]  # fmt: skip
    for i in range(args.groups * args.per_group):
        question = [int(t) for t in rng.integers(3, vocab, args.question_tokens)]
        prompts.append(systems[i % args.groups] + question)
        news.append(args.output_tokens)
    return Workload(prompts, news)


def mixed_workload(rng, args, vocab: int) -> Workload:
    def lognormal(median, cap, lo):
        x = rng.lognormal(math.log(median), args.sigma, args.requests)
        return np.clip(np.round(x), lo, cap).astype(int)

    plens = lognormal(args.prompt_median, args.prompt_max, 1)
    news = lognormal(args.output_median, args.output_max, 1)
    news = np.minimum(news, args.max_len - plens).clip(1)
    plens = np.minimum(plens, args.max_len - news)
    prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in plens]
    return Workload(prompts, [int(n) for n in news])


def arrival_times(rng, n: int, rate: float) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros((n,))
    return np.cumsum(rng.exponential(1.0 / rate, n)) - 0.0


def latency_metrics(times: list[list[float]], arrivals: np.ndarray, wl: Workload) -> dict:
    ttft = np.array([t[0] - a for t, a in zip(times, arrivals, strict=True) if t])
    itl = np.concatenate([np.diff(t) for t in times if len(t) > 1] or [np.zeros(0)])
    end = max(t[-1] for t in times if t)
    start = float(arrivals.min())
    produced = sum(len(t) for t in times)
    assert produced == wl.output_tokens, (produced, wl.output_tokens)

    def pct(x, q):
        return float(np.percentile(x, q) * 1e3) if x.size else float("nan")

    return dict(
        output_tokens=produced,
        seconds=end - start,
        output_tok_s=produced / (end - start),
        requests_s=len(times) / (end - start),
        ttft_p50_ms=pct(ttft, 50),
        ttft_p99_ms=pct(ttft, 99),
        itl_p50_ms=pct(itl, 50),
        itl_p99_ms=pct(itl, 99),
    )


def weight_bytes(params) -> int:
    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(params)))


def prefix_cache_bytes(args) -> int | None:
    """Engine(prefix_cache_bytes): the cap on cached blocks no running request maps."""
    return None if args.prefix_cache_gib is None else int(args.prefix_cache_gib * 2**30)


def run_engine(model, wl: Workload, arrivals: np.ndarray, args, prefix=None,
               decode_ahead: bool = True, decode_steps: int = 1) -> dict:  # fmt: skip
    eng = Engine(
        model, max_slots=args.slots, max_len=args.max_len,
        prefill_chunk_tokens=args.chunk, max_queue=len(wl.prompts) + 1, prefix_cache=prefix,
        arena=make_arena(args), prefix_cache_bytes=prefix_cache_bytes(args),
        decode_ahead=decode_ahead, decode_steps=decode_steps,
    )  # fmt: skip
    try:
        eng.warm_up()
        s0 = dataclasses.replace(
            eng.stats,
            finished=dict(eng.stats.finished),
            decode_bucket_calls=dict(eng.stats.decode_bucket_calls),
        )
        p0 = dataclasses.replace(eng.prefix.stats) if eng.prefix else None
        cache = eng.cache
        a0 = cache.arena.stats() if cache.is_vmm else None
        n = len(wl.prompts)
        order = np.argsort(arrivals, kind="stable")
        reqs: list = [None] * n
        times: list[list[float]] = [[] for _ in range(n)]
        # The requests whose tokens or ending arrived in a step, named by a listener each
        # (engine.Request.add_listener; as a server's wake-up, inside the step's delivery):
        # polling every request not yet done instead cost ~0.8 ms a step with 1,000 waiting
        # on this CPU, which the engine's steps, not the dense engine's, paid.
        touched: set[int] = set()
        held, committed, live_kv, floors, roofline = [], [], [], [], []
        cached_only: list[int] = []  # prefix blocks no slot maps (evicted when memory is short)
        # Issue 23's bound on the shared-prefix workload, per step: one copy of each group's
        # system prompt + the running requests' tails past it + the floor.
        shared = args.workload == "shared-prefix"
        prefix_once = args.groups * args.system_tokens * cache.token_bytes * cache.bindings
        bounds: list[int] = []
        host, steps = [], []
        wbytes = weight_bytes(eng.params)
        card_bandwidth = HBM_BYTES_PER_S.get(jax.devices()[0].device_kind)
        cuda = _ffi.cuda_module()
        calls = (lambda: int(sum(cuda.host_calls().values()))) if cuda is not None else None
        host_calls: list[int] = []  # per decode-only step: 0 = the recorded graph replayed
        prefill_host_calls: list[int] = []  # the same per prefill step (a bucket's own graph)
        # --profile: cProfile over the engine's steps (its own cost inflates the host time).
        profiler = cProfile.Profile() if args.profile else None
        nxt, t0 = 0, time.perf_counter()
        beat = Heartbeat(eng, n)
        while nxt < n or eng.has_work():
            now = time.perf_counter() - t0
            beat(now, nxt, steps, host, host_calls)
            while nxt < n and arrivals[order[nxt]] <= now:
                i = int(order[nxt])
                reqs[i] = eng.submit(wl.prompts[i], wl.news[i], stop_token_ids=[])
                reqs[i].add_listener(functools.partial(touched.add, i))
                nxt += 1
            if not eng.has_work():
                time.sleep(max(0.0, min(0.01, arrivals[order[nxt]] - now)))
                continue
            live_before = live_kv[-1] if live_kv else eng.live_bytes  # none ran since
            calls0 = calls() if calls else 0
            if profiler is not None:
                profiler.enable()
            eng.step()
            if profiler is not None:
                profiler.disable()
            t = time.perf_counter() - t0
            for i in touched:
                k = reqs[i].streamed
                times[i].extend([t] * (k - len(times[i])))
            touched.clear()
            rec = eng.last_step
            in_use = eng.num_running
            held.append(cache.held_bytes)
            cached_only.append(cache.cached_only_bytes if eng.prefix is not None else 0)
            committed.append(cache.committed_bytes)
            live_kv.append(eng.live_bytes)  # running requests' only
            floors.append(cache.floor_bytes(in_use))
            if shared:
                tails = np.maximum(cache.lengths.astype(np.int64) - args.system_tokens, 0).sum()
                bounds.append(prefix_once + floors[-1] + tails * cache.token_bytes * cache.bindings)
            host.append(rec.seconds - rec.prefill_seconds - rec.decode_seconds)
            steps.append(rec.seconds)
            if calls and rec.prefill_tokens == 0 and rec.decode_rows:
                host_calls.append(calls() - calls0)
            elif calls and rec.prefill_tokens:
                prefill_host_calls.append(calls() - calls0)
            if rec.prefill_tokens == 0 and rec.decode_rows >= 0.9 * args.slots:
                # Over the whole step: a call dispatched ahead (Engine(decode_ahead)) runs
                # across step boundaries, so no part of a step is its device time alone.
                roofline.append((wbytes + live_before) / rec.seconds)  # bytes/s, divided below
        for i, r in enumerate(reqs):
            c = r.result()
            assert len(c.tokens) == wl.news[i], (i, c.finish_reason)
        if profiler is not None:
            print("cProfile of Engine.step, by own time:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        s = eng.stats
        a1 = cache.arena.stats() if cache.is_vmm else None
        out = latency_metrics(times, arrivals, wl)
        # Where the host time goes on VMM: the arena's driver work (commits of new granules,
        # second mappings into the prefix store, unmaps with their device synchronize and
        # zero-granule remap), per step; the rest is Python scheduling and the input copy.
        arena_ms = {
            f"host_{k}_ms_per_step": (getattr(a1, f"{k}_seconds") - getattr(a0, f"{k}_seconds"))
            * 1e3 / max(1, len(host))
            for k in ("commit", "share", "decommit")
        } if a0 else {}  # fmt: skip
        out.update(
            decode_compiles_after_warmup=s.decode_compiles - s0.decode_compiles,
            prefill_compiles_after_warmup=s.prefill_compiles - s0.prefill_compiles,
            sampler_compiles_after_warmup=s.sampler_compiles - s0.sampler_compiles,
            preemptions=s.preemptions - s0.preemptions,
            steps=s.steps - s0.steps,
            # Calls: the decode step's, the prefill step's, and those of them that also
            # advanced decoding rows (one pass over the weights for both).
            decode_calls=s.decode_calls - s0.decode_calls,
            prefill_calls=s.prefill_calls - s0.prefill_calls,
            mixed_calls=s.mixed_calls - s0.mixed_calls,
            # Decode calls dispatched before the previous call's tokens were read, and their
            # rows computed for a request that had ended (Engine(decode_ahead)).
            calls_ahead=s.calls_ahead - s0.calls_ahead,
            wasted_rows=s.wasted_rows - s0.wasted_rows,
            # Decode calls per decode bucket (Engine(decode_row_buckets)): rows computed.
            decode_bucket_calls={
                str(n): c - s0.decode_bucket_calls.get(n, 0)
                for n, c in sorted(s.decode_bucket_calls.items())
            },
            peak_committed_kv_bytes=int(max(committed)),
            mean_committed_kv_bytes=float(np.mean(committed)),
            peak_held_kv_bytes=int(max(held)),
            mean_held_kv_bytes=float(np.mean(held)),
            mean_live_kv_bytes=float(np.mean(live_kv)),
            mean_floor_bytes=float(np.mean(floors)),
            held_over_live_plus_floor=float(
                np.mean(held) / max(1.0, np.mean(live_kv) + np.mean(floors))
            ),
            host_ms_per_step=float(np.mean(host) * 1e3),
            host_fraction=float(np.sum(host) / np.sum(steps)),
            **arena_ms,
            # Unmaps of ended requests' slots done while the next call ran (inside the calls'
            # time): host work the device hid, or did not, if it passed the call's own time.
            release_beside_step_ms_per_step=(
                s.release_beside_step_seconds - s0.release_beside_step_seconds
            )
            * 1e3
            / max(1, len(host)),
            commit_ahead_ms_per_step=(s.commit_ahead_seconds - s0.commit_ahead_seconds)
            * 1e3
            / max(1, len(host)),
            # All the work done while calls ran (releases, commits ahead, the next prefill's
            # commits and admissions), and the calls it outlasted (the device may have waited).
            beside_ms_per_step=(s.beside_seconds - s0.beside_seconds) * 1e3 / max(1, len(host)),
            beside_overran_calls=s.beside_overran - s0.beside_overran,
            # Of that work, what came before the next decode call's dispatch (the part that
            # delays that call; Engine._complete), per call dispatched ahead.
            before_next_ms_per_call_ahead=(s.before_next_seconds - s0.before_next_seconds)
            * 1e3
            / max(1, s.calls_ahead - s0.calls_ahead),
            admitted_beside_a_call=s.admitted_ahead - s0.admitted_ahead,
            admissions=s.submitted - s0.submitted,
            planning_commits=s.planning_commits - s0.planning_commits,
            mean_prefix_cached_only_bytes=float(np.mean(cached_only)),
            # held / the issue's bound at the step it is largest, with and without the blocks
            # no slot maps (a cache the admission evicts when it needs the memory).
            held_over_prefix_bound=float(np.max(np.divide(held, bounds))) if bounds else None,
            requests_held_over_prefix_bound=float(
                np.max(np.divide(np.subtract(held, cached_only), bounds))
            )
            if bounds
            else None,
            prefix_bound_at_peak_bytes=int(bounds[int(np.argmax(held))]) if bounds else None,
            requests_held_over_live_plus_floor=float(
                (np.mean(held) - np.mean(cached_only))
                / max(1.0, np.mean(live_kv) + np.mean(floors))
            ),
            decode_roofline_ratio=(
                float(np.median(roofline)) / ISSUE_HBM_BYTES_PER_S if roofline else None
            ),
            decode_roofline_ratio_card=(
                float(np.median(roofline)) / card_bandwidth if roofline and card_bandwidth else None
            ),
            arena="vmm" if cache.is_vmm else "eager",
            prefill_tokens_computed=s.prefill_tokens_computed - s0.prefill_tokens_computed,
            prefill_tokens_real=s.prefill_tokens - s0.prefill_tokens,
            prompt_tokens=int(sum(len(p) for p in wl.prompts)),
            unique_prompt_tokens=unique_prompt_tokens(wl),
            prefix_cache=eng.prefix is not None,
            prefix_hit_tokens=(eng.prefix.stats.hit_tokens - p0.hit_tokens) if p0 else 0,
            prefix_evicted_blocks=(eng.prefix.stats.evicted_blocks - p0.evicted_blocks)
            if p0
            else 0,
            cow_copies=(a1.cow_copies - a0.cow_copies) if a0 else 0,
            decode_steps_rerecorded=sum(1 for c in host_calls if c) if calls else None,
            decode_only_steps=len(host_calls) if calls else None,
            # Recorded once per bucket in warm-up: a prefill step that records again is one
            # whose graph XLA could not replay.
            prefill_steps_rerecorded=sum(1 for c in prefill_host_calls if c) if calls else None,
            prefill_steps=len(prefill_host_calls) if calls else None,
        )
        return out
    finally:
        eng.close()


def make_arena(args):
    """--arena host: the host driver's VmmArena (a CPU run of the VMM and prefix paths)."""
    if args.arena == "host":
        from jax_kv.memory import host_arena

        return host_arena(reserve_bytes=64 << 30, granule=64 << 10)
    return None


def unique_prompt_tokens(wl: Workload) -> int:
    """Prompt tokens counting each distinct prefix once (a trie of the prompts)."""
    root: dict = {}
    n = 0
    for p in wl.prompts:
        node = root
        for t in p:
            if t not in node:
                node[t] = {}
                n += 1
            node = node[t]
    return n


def run_engine_no_prefix(model, wl: Workload, arrivals: np.ndarray, args) -> dict:
    return run_engine(model, wl, arrivals, args, prefix=False)


def run_engine_serial(model, wl: Workload, arrivals: np.ndarray, args) -> dict:
    """The Engine with every call waiting for the host between calls (no decode call
    dispatched ahead): the comparator of Engine(decode_ahead), in the same run."""
    return run_engine(model, wl, arrivals, args, decode_ahead=False)


def run_engine_steps(model, wl: Workload, arrivals: np.ndarray, args) -> dict:
    """Engine(decode_steps=--decode-steps): that many tokens per decode-only call, in the same
    run as jax_kv (one token per call)."""
    return run_engine(model, wl, arrivals, args, decode_steps=args.decode_steps)


# XLA's temporaries: an 8k prefill's fresh cache, its activations, cuDNN's work. 6 GiB was too
# little for the Llama-3-8B shape on the H100 (8d40951: 13 rows of 32k, then 832 MiB requests
# retried until the stage's limit).
DENSE_HEADROOM_BYTES = 14 << 30


def dense_slots_that_fit(model, args) -> int:
    """--dense-slots (default --slots), lowered to the dense [slots, max_len] rows that the
    device's free memory holds beside DENSE_HEADROOM_BYTES, as the issue's comparator is sized
    ("the largest that fits memory"). Asking for more does not fail fast: on the H100 XLA
    retried a 1.5 GiB allocation every 10 s until the stage's limit."""
    want = args.dense_slots or args.slots
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return want
    c = model.config
    row = 2 * c.num_layers * args.max_len * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    # XLA's limit is a fraction of the card, blind to other processes' memory: the driver's
    # free bytes are not (8d40951 on the H100: XLA's figure said 11 rows fit while the parent
    # process still held its weights, and the child retried allocations until its limit).
    free = min(free, driver_free_bytes() or free) - DENSE_HEADROOM_BYTES
    fits = int(max(0, free) // row)
    if fits < want:
        print(f"dense: {want} slots of {row / 2**30:.2f} GiB do not fit {free / 2**30:.1f} GiB "
              f"free: {fits} slots", flush=True)  # fmt: skip
    return min(want, fits)


def driver_free_bytes() -> int | None:
    """The device's free memory as the CUDA driver counts it (every process's use), or None
    where cuda-python or a current context is missing."""
    try:
        from cuda.bindings import driver as cu

        err, free, _ = cu.cuMemGetInfo()
    except ImportError:
        return None
    return int(free) if err == cu.CUresult.CUDA_SUCCESS else None


def run_dense(model, wl: Workload, arrivals: np.ndarray, args) -> dict:
    slots = dense_slots_that_fit(model, args)
    if slots == 0:
        raise MemoryError("dense: not one slot of max_len fits the device's free memory")
    eng = DenseSlotEngine(model, slots, args.max_len)
    eng.warm_up(max(len(p) for p in wl.prompts))
    t0 = time.perf_counter()
    times = eng.run(arrivals, wl.prompts, wl.news, lambda: time.perf_counter() - t0)
    out = latency_metrics(times, arrivals, wl)
    out.update(slots=slots, dense_cache_bytes=eng.cache_bytes)
    eng.caches = None
    return out


DENSE_PROCESS_MEM_FRACTION = "0.95"


def run_dense_in_own_process(rate_name: str) -> dict:
    """The dense engine in a child process, where XLA's pool may take 95% of the card. In this
    process it is capped at XLA's default 75% (the rest is the VMM arena's), which left the
    dense comparator 9 rows of 32k on the H100 where ~13 fit beside the 8B weights. The child
    runs this script's own command line with `--engines dense --rates RATE` appended (argparse
    keeps the last value), so it builds the same seeded weights, workload and arrivals. main()
    runs it before this process builds its model: run after, it shared the card with this
    process's weights and pool (8d40951, H100: the 8B child's cache did not fit)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "dense.json"
        argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--engines",
                "dense", "--rates", rate_name, "--child-result", str(result)]  # fmt: skip
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=DENSE_PROCESS_MEM_FRACTION)
        subprocess.run(argv, env=env, check=True)
        out = json.loads(result.read_text())
    out["process"] = f"own (XLA memory fraction {DENSE_PROCESS_MEM_FRACTION})"
    return out


def run_static(model, wl: Workload, arrivals: np.ndarray, args) -> dict:
    """Arrival-order batches of `slots`, each generated to its longest output; the timeline
    from the measured prefill and decode seconds (compiles excluded)."""
    n = min(len(wl.prompts), args.static_requests or len(wl.prompts))
    sub = Workload(wl.prompts[:n], wl.news[:n])
    arr = arrivals[:n]
    order = [int(i) for i in np.argsort(arr, kind="stable")]
    gen = Generator(model, max_len=args.max_len)
    times: list[list[float]] = [[] for _ in range(n)]
    clock = float(arr.min())
    compile_s = 0.0
    batches = [order[k : k + args.slots] for k in range(0, n, args.slots)]
    sizes, splits = [], 0
    while batches:
        batch = batches.pop(0)
        most = max(sub.news[i] for i in batch)
        try:
            res = gen.generate([sub.prompts[i] for i in batch], most, stop_tokens=[])
        except ArenaExhausted:
            # Every row runs to the batch's longest output (each row's own prompt + that, on
            # seq-major VMM): a batch that does not fit runs as two, one after the other, as a
            # user would.
            if len(batch) == 1:
                raise
            half, splits = len(batch) // 2, splits + 1
            batches[:0] = [batch[:half], batch[half:]]
            continue
        sizes.append(len(batch))
        st = res.stats
        compile_s += st.compile_seconds
        start = max(clock, max(arr[i] for i in batch))
        per_token = st.decode_seconds / max(1, most - 1)
        first = start + st.prefill_seconds
        for i in batch:
            times[i] = [first + j * per_token for j in range(sub.news[i])]
        clock = first + st.decode_seconds
    out = latency_metrics(times, arr, sub)
    out.update(
        requests=n, compile_seconds_excluded=compile_s, batch_sizes=sizes, batch_splits=splits
    )
    return out


def fmt_bytes(x) -> str:
    return f"{x / 2**30:.2f} GiB"


def print_header(args) -> None:
    if args.workload == "shared-prefix":
        workload = (
            f"{args.groups} groups x {args.per_group} prompts: a {args.system_tokens}-token "
            f"system prompt per group, {args.question_tokens}-token questions, "
            f"{args.output_tokens} output tokens"
        )
    else:
        workload = (
            f"{args.requests} requests, prompt median {args.prompt_median} (max "
            f"{args.prompt_max}), output median {args.output_median} (max {args.output_max})"
        )
    print(
        f"\n{args.model} shape, {args.dtype}, random weights, greedy; {args.slots} slots, max_len "
        f"{args.max_len}, chunk {args.chunk}; {workload}; {jax.devices()[0].device_kind}"
    )
    print("| rate | engine | out tok/s | req/s | TTFT p50/p99 ms | ITL p50/p99 ms | notes |")
    print("|" + "---|" * 7, flush=True)


def print_row(rate: str, name: str, m: dict, args) -> None:
    """One engine's row, printed as soon as it ran (a later engine can exhaust the call)."""
    notes = ""
    if name.startswith("jax_kv"):
        physical = (
            ""
            if m["arena"] == "vmm"
            else f" (eager arena: {fmt_bytes(m['peak_committed_kv_bytes'])} dense)"
        )
        notes = (
            f"KV held mean {fmt_bytes(m['mean_held_kv_bytes'])} (live "
            f"{fmt_bytes(m['mean_live_kv_bytes'])} + floor "
            f"{fmt_bytes(m['mean_floor_bytes'])}), peak "
            f"{fmt_bytes(m['peak_held_kv_bytes'])}{physical}; decode compiles "
            f"{m['decode_compiles_after_warmup']}, prefill compiles "
            f"{m['prefill_compiles_after_warmup']}, picker compiles "
            f"{m.get('sampler_compiles_after_warmup', '-')}; preemptions {m['preemptions']}; "
            f"decode calls dispatched ahead {m.get('calls_ahead', 0)} of "
            f"{m['decode_calls']}, rows computed for ended requests {m.get('wasted_rows', 0)}; "
            f"scheduling {m['host_ms_per_step']:.2f} ms/step "
            f"({100 * m['host_fraction']:.1f}%"
            + (
                f"; arena work per step: commit {m['host_commit_ms_per_step']:.2f} (of which "
                f"{m.get('commit_ahead_ms_per_step', 0.0):.2f} ahead, beside the call), share "
                f"{m['host_share_ms_per_step']:.2f}, unmap {m['host_decommit_ms_per_step']:.2f}"
                f" ms, of which {m['release_beside_step_ms_per_step']:.2f} ms released ended "
                f"requests' slots beside the next call"
                if "host_commit_ms_per_step" in m
                else ""
            )
            + (
                f"; beside the calls {m['beside_ms_per_step']:.2f} ms/step, outlasting "
                f"{m['beside_overran_calls']} calls, {m['before_next_ms_per_call_ahead']:.2f} ms "
                f"before the next call's dispatch; admitted beside a call "
                f"{m['admitted_beside_a_call']} of {m['admissions']}, slot commits the device "
                f"waited for {m['planning_commits']}"
                if "beside_ms_per_step" in m
                else ""
            )
            + ")"
            + (
                f"; prefix blocks no slot maps mean {fmt_bytes(m['mean_prefix_cached_only_bytes'])}"
                f"{'' if args.prefix_cache_gib is None else f' (cap {args.prefix_cache_gib} GiB)'}"
                f", requests' KV {m['requests_held_over_live_plus_floor']:.2f}x (live + floor)"
            )
            + (
                f"; against one copy of each group's prefix + tails + floor: at most "
                f"{m['held_over_prefix_bound']:.2f}x ({m['requests_held_over_prefix_bound']:.2f}x"
                f" without the blocks no slot maps), the bound at the peak "
                f"{fmt_bytes(m['prefix_bound_at_peak_bytes'])}"
                if m.get("held_over_prefix_bound") is not None
                else ""
            )
            + (
                f"; prefill computed {m['prefill_tokens_computed']:,} positions for "
                f"{m['prompt_tokens']:,} prompt tokens ({m['unique_prompt_tokens']:,} "
                f"unique), prefix hits {m['prefix_hit_tokens']:,} tokens "
                f"({m['prefix_hit_tokens'] / max(1, m['prompt_tokens']):.1%} of the prompts'), "
                f"copies on write {m['cow_copies']}"
            )
            + (
                f"; decode at roofline x{m['decode_roofline_ratio']:.2f} of 4.8 TB/s"
                + (
                    f", x{m['decode_roofline_ratio_card']:.2f} of this card's"
                    if m.get("decode_roofline_ratio_card")
                    else ""
                )
                if m["decode_roofline_ratio"]
                else ""
            )
        )
    elif name == "dense":
        notes = f"{m['slots']} slots, dense KV {fmt_bytes(m['dense_cache_bytes'])}"
        if "process" in m:
            notes += f"; its own process, {m['process'][5:-1]}"
    elif name == "static":
        notes = f"first {m['requests']} requests, timeline from measured times" + (
            f"; {m['batch_splits']} batches did not fit and ran as halves (sizes "
            f"{m['batch_sizes']})"
            if m.get("batch_splits")
            else ""
        )
    print(
        f"| {rate} | {name} | {m['output_tok_s']:.0f} | {m['requests_s']:.2f} | "
        f"{m['ttft_p50_ms']:.0f}/{m['ttft_p99_ms']:.0f} | "
        f"{m['itl_p50_ms']:.1f}/{m['itl_p99_ms']:.1f} | {notes} |"
    )


def plot(results: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted({n for e in results.values() for n in e})
    for name in names:
        pts = [
            (e[name]["ttft_p99_ms"], e[name]["output_tok_s"]) for e in results.values() if name in e
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def run_multiturn(model, args, prefix: bool | None) -> dict:
    """Issue 23's chat workload: conversations of `turns` turns, all starting at once; each
    turn resubmits the whole history (prompt + answer + a new message) when the previous
    turn ended. New tokens per turn: its message and the previous answer's last token (the
    one token of the history no step wrote); the first turn's prompt is all new."""
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    eng = Engine(model, max_slots=args.slots, max_len=args.max_len, prefix_cache=prefix,
                 prefill_chunk_tokens=args.chunk, max_queue=args.conversations + 1,
                 arena=make_arena(args), prefix_cache_bytes=prefix_cache_bytes(args))  # fmt: skip
    try:
        eng.warm_up()
        s0 = dataclasses.replace(eng.stats, finished=dict(eng.stats.finished))
        history = [[int(t) for t in rng.integers(3, vocab, args.question_tokens)]
                   for _ in range(args.conversations)]  # fmt: skip
        new_tokens = sum(len(h) for h in history)
        turn = [0] * args.conversations
        live = {i: eng.submit(history[i], args.output_tokens, stop_token_ids=[])
                for i in range(args.conversations)}  # fmt: skip
        sent = {i: time.perf_counter() for i in live}
        ttft, out_tokens, t0 = [], 0, time.perf_counter()
        while live:
            eng.step()
            now = time.perf_counter()
            for i, r in list(live.items()):
                if r.streamed and i in sent:
                    ttft.append(now - sent.pop(i))
                if not r.done:
                    continue
                c = r.result()
                out_tokens += len(c.tokens)
                del live[i]
                turn[i] += 1
                if turn[i] < args.turns:
                    message = [int(t) for t in rng.integers(3, vocab, args.turn_tokens)]
                    history[i] = history[i] + c.tokens + message
                    new_tokens += len(message) + 1
                    if len(history[i]) + args.output_tokens <= args.max_len:
                        live[i] = eng.submit(history[i], args.output_tokens, stop_token_ids=[])
                        sent[i] = time.perf_counter()
        seconds = time.perf_counter() - t0
        s = eng.stats
        computed = s.prefill_tokens - s0.prefill_tokens
        return dict(
            output_tok_s=out_tokens / seconds, seconds=seconds,
            ttft_p50_ms=float(np.percentile(ttft, 50) * 1e3),
            ttft_p99_ms=float(np.percentile(ttft, 99) * 1e3),
            new_tokens=new_tokens, prefill_tokens_real=computed,
            prefill_over_new=computed / new_tokens,
            prefix_cache=eng.prefix is not None,
            partial_hits=eng.prefix.stats.partial_hits if eng.prefix else 0,
            cow_copies=eng.cache.arena.stats().cow_copies if eng.cache.is_vmm else 0,
            preemptions=s.preemptions - s0.preemptions,
        )  # fmt: skip
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3-8b", choices=list(jm.PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument(
        "--prefix-cache-gib", type=float, default=None,
        help="cap the prefix cache's blocks that no running request owns: those no request "
        "maps and the shared ones running requests map (Engine(prefix_cache_bytes)); "
        "default: kept until admission needs the memory",
    )  # fmt: skip
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument(
        "--rates", default="4,8,16,inf", help="requests/s, comma-separated; inf: offline"
    )
    ap.add_argument(
        "--engines",
        default=None,
        help="comma-separated of jax_kv, jax_kv-noprefix (the prefix cache off), jax_kv-serial "
        "(no decode call dispatched ahead), jax_kv-steps (Engine(decode_steps=--decode-steps)), "
        "dense, static (default: jax_kv,dense,static; multi-turn: jax_kv,jax_kv-noprefix, the "
        "only two it runs)",
    )
    ap.add_argument(
        "--decode-steps", type=int, default=4, help="jax_kv-steps: tokens per decode-only call"
    )
    ap.add_argument("--prompt-median", type=int, default=300)
    ap.add_argument("--prompt-max", type=int, default=8192)
    ap.add_argument("--output-median", type=int, default=200)
    ap.add_argument("--output-max", type=int, default=2048)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--workload", choices=["mixed", "shared-prefix", "multi-turn"],
                    default="mixed")  # fmt: skip
    ap.add_argument("--conversations", type=int, default=200, help="multi-turn: conversations")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-tokens", type=int, default=64, help="multi-turn: a new message")
    ap.add_argument(
        "--arena", choices=["auto", "host"], default="auto",
        help="host: the host driver's VmmArena (CPU runs of the VMM and prefix paths)",
    )  # fmt: skip
    ap.add_argument("--groups", type=int, default=64, help="shared-prefix: groups")
    ap.add_argument("--per-group", type=int, default=16, help="shared-prefix: prompts per group")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--dense-slots", type=int, default=0, help="0: --slots")
    ap.add_argument(
        "--dense-process",
        choices=["own", "shared"],
        default=None,
        help="run the dense engine in a child process where XLA may take 95%% of the GPU "
        "(own, the default on a GPU) or in this one (shared, the default on CPU)",
    )
    ap.add_argument("--child-result", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--static-requests", type=int, default=0, help="0: all")
    ap.add_argument("--static-rates", default="inf", help="rates the static Generator runs at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print the top N functions of a cProfile of the Engine's steps",
    )
    args = ap.parse_args()
    multi_turn = args.workload == "multi-turn"
    args.engines = args.engines or (
        "jax_kv,jax_kv-noprefix" if multi_turn else "jax_kv,dense,static"
    )
    if multi_turn and (unknown := set(args.engines.split(",")) - {"jax_kv", "jax_kv-noprefix"}):
        ap.error(f"--engines: multi-turn runs jax_kv and jax_kv-noprefix, not {sorted(unknown)}")

    child = args.child_result is not None
    if child:  # the child's command line repeats the parent's --dense-process
        args.dense_process = "shared"
    elif args.dense_process is None:
        args.dense_process = "own" if jax.default_backend() == "gpu" else "shared"
    dense_rows = {}  # rate -> the dense child's result, run before this process holds memory
    own = args.dense_process == "own" and not multi_turn
    if own and "dense" in args.engines.split(","):
        dense_rows = {r: run_dense_in_own_process(r) for r in args.rates.split(",")}

    config = dataclasses.replace(
        jm.PRESETS[args.model],
        max_position_embeddings=max(
            args.max_len, jm.PRESETS[args.model].max_position_embeddings or 0
        ),
    )
    model = jm.random_model(config, seed=args.seed, dtype=jnp.dtype(args.dtype))
    # Fused once, in place: every engine runs the fused projections, and none holds a fused
    # copy beside the separate weights (14 GiB at 8B, memory the dense cache needs).
    model.fuse_projections()
    rng = np.random.default_rng(args.seed)
    if args.workload == "multi-turn":
        print(
            f"\n{args.model} shape, {args.dtype}; {args.conversations} conversations x "
            f"{args.turns} turns, first message {args.question_tokens} tokens, then "
            f"{args.turn_tokens} per turn, {args.output_tokens} output tokens per turn"
        )
        print(
            "| engine | out tok/s | TTFT p50/p99 ms | prefill computed / new tokens | "
            "partial hits | COW copies |"
        )
        print("|---|---|---|---|---|---|")
        results = {}
        for name in args.engines.split(","):
            m = run_multiturn(model, args, None if name == "jax_kv" else False)
            results[name] = m
            print(
                f"| {name} | {m['output_tok_s']:.0f} | {m['ttft_p50_ms']:.0f}/"
                f"{m['ttft_p99_ms']:.0f} | {m['prefill_tokens_real']:,} / {m['new_tokens']:,}"
                f" = {m['prefill_over_new']:.2f}x | {m['partial_hits']} | {m['cow_copies']} |"
            )
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"serve_multiturn_{args.model}_{jax.default_backend()}.json"
            path.write_text(json.dumps(dict(meta=dict(vars(args), out=str(args.out)),
                                            results=results), indent=1))  # fmt: skip
            print(f"wrote {path}")
        return
    wl = make_workload(rng, args, config.vocab_size)
    engines = args.engines.split(",")
    static_rates = set(args.static_rates.split(","))
    results: dict[str, dict] = {}
    meta = dict(vars(args), out=str(args.out), backend=jax.default_backend(),
                device=str(jax.devices()[0]), device_kind=jax.devices()[0].device_kind,
                output_tokens=wl.output_tokens,
                prompt_tokens=int(sum(len(p) for p in wl.prompts)))  # fmt: skip
    stem = f"serve_{args.model}_{jax.default_backend()}"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if not child:
        print_header(args)
    for rate_name in args.rates.split(","):
        rate = float(rate_name)
        arrivals = arrival_times(np.random.default_rng(args.seed + 1), len(wl.prompts), rate)
        row = results.setdefault(rate_name, {})
        for name in engines:
            if name == "static" and rate_name not in static_rates:
                continue
            fn = {"jax_kv": run_engine, "jax_kv-noprefix": run_engine_no_prefix,
                  "jax_kv-serial": run_engine_serial, "jax_kv-steps": run_engine_steps,
                  "dense": run_dense,
                  "static": run_static}[name]  # fmt: skip
            if name == "dense" and args.dense_process == "own":
                row[name] = dense_rows[rate_name]
            else:
                row[name] = fn(model, wl, arrivals, args)
            if child:
                args.child_result.write_text(json.dumps(row[name]))
                return
            print_row(rate_name, name, row[name], args)
            sys.stdout.flush()
            if args.out is not None:  # after each engine: a later one may not finish
                (args.out / f"{stem}.json").write_text(
                    json.dumps(dict(meta=meta, results=results), indent=1)
                )
    if args.out is not None:
        print(plot(results, args.out / f"{stem}.png"))
        print(f"wrote {args.out / stem}.json")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
