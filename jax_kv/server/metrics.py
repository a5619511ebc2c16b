"""/metrics in Prometheus's text format (prometheus-client): the engine's state read at scrape
time, and the latencies the server sees."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: from 1 ms (a decode step of a small model) to a minute (a long queue).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 5)


def engine_counters(s: Any) -> dict[str, tuple[str, float]]:
    """The EngineStats `s` that /metrics exports as counters: name (after `jax_kv_`, before
    `_total`) -> (help, value). bench/serve_http.py reads the same names from an Engine."""
    return {
        "generation_tokens": ("Tokens the decode steps made", s.decode_tokens),
        "prompt_tokens": ("Prompt tokens prefilled", s.prefill_tokens),
        "preemptions": ("Requests preempted for memory", s.preemptions),
        "decode_compiles": ("Compiles of the decode step", s.decode_compiles),
        "prefill_compiles": ("Compiles of the prefill step (one per bucket)", s.prefill_compiles),
        "picker_compiles": ("Compiles of the token pickers (argmax, sampler)", s.sampler_compiles),
        "engine_steps": ("Engine scheduling iterations", s.steps),
        "engine_step_seconds": ("Time in engine steps", s.step_seconds),
        "engine_host_seconds": (
            "Step time the device did not cover (planning, delivery)",
            s.host_seconds,
        ),
        # A call's time in three: dispatch + beside + wait = step - host.
        "engine_dispatch_seconds": (
            "Calls' time dispatching the step and its token picker",
            s.dispatch_seconds,
        ),
        "engine_beside_seconds": (
            "Calls' time in the work done while a call runs",
            s.beside_seconds,
        ),
        "engine_wait_seconds": (
            "Calls' time waiting for their tokens after that work",
            s.wait_seconds,
        ),
        "engine_deliver_seconds": (
            "Time handing tokens to their requests (beside a call or after it)",
            s.deliver_seconds,
        ),
    }


class _EngineCollector:
    """Gauges and counters read from the engine when scraped (no bookkeeping per step)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._last = (time.monotonic(), 0)

    def collect(self) -> Any:
        snap = self.engine.snapshot()  # in this process or the engine's (engine_process)
        s = snap.stats
        yield GaugeMetricFamily("jax_kv_requests_running", "Requests holding a slot",
                                value=snap.running)  # fmt: skip
        yield GaugeMetricFamily("jax_kv_requests_waiting", "Requests queued",
                                value=snap.waiting)  # fmt: skip
        if snap.kv is not None:
            for key, name, help_text in (
                ("committed", "committed", "Physical KV bytes of the cache"),
                ("held", "held", "KV bytes the slots' granules take"),
                ("live", "live", "KV bytes of the live tokens"),
            ):
                yield GaugeMetricFamily(f"jax_kv_kv_{name}_bytes", help_text, value=snap.kv[key])
        tokens = s.decode_tokens
        now = time.monotonic()
        t_last, n_last = self._last
        rate = (tokens - n_last) / (now - t_last) if now > t_last else 0.0
        self._last = (now, tokens)
        yield GaugeMetricFamily(
            "jax_kv_generation_tokens_per_second",
            "Decode tokens per second since the previous scrape",
            value=rate,
        )
        for name, (help_text, value) in engine_counters(s).items():
            yield CounterMetricFamily(f"jax_kv_{name}", help_text, value=value)
        if snap.prefix is not None:
            p = snap.prefix
            yield CounterMetricFamily("jax_kv_prefix_hit_tokens",
                                      "Prompt tokens served from the prefix cache",
                                      value=p.hit_tokens)  # fmt: skip
            yield CounterMetricFamily("jax_kv_prefix_lookups", "Prefix cache lookups",
                                      value=p.lookups)  # fmt: skip
            yield CounterMetricFamily(
                "jax_kv_prefix_evicted_blocks", "Prefix blocks evicted", value=p.evicted_blocks
            )
            if snap.kv is not None:
                yield GaugeMetricFamily("jax_kv_prefix_cached_only_bytes",
                                        "KV bytes of cached prefix blocks no request maps",
                                        value=snap.kv["cached_only"])  # fmt: skip
        finished = CounterMetricFamily("jax_kv_requests_finished", "Requests ended, by reason",
                                       labels=["finish_reason"])  # fmt: skip
        for reason, n in sorted(s.finished.items()):
            finished.add_metric([reason], n)
        yield finished


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.ttft = Histogram("jax_kv_time_to_first_token_seconds",
                              "Request received to first token", buckets=_TTFT_BUCKETS,
                              registry=r)  # fmt: skip
        self.itl = Histogram("jax_kv_inter_token_latency_seconds",
                             "Between tokens of a request", buckets=_ITL_BUCKETS,
                             registry=r)  # fmt: skip
        self.http = Counter("jax_kv_http_requests", "Generation requests by outcome",
                            ["outcome"], registry=r)  # fmt: skip

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def admitted(self) -> None:
        self.http.labels("admitted").inc()

    def refused(self, status: int) -> None:
        self.http.labels(str(status)).inc()

    def finished(self, completion: Any) -> None:
        self.http.labels(completion.finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
