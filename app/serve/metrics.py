"""Prometheus metrics of the engine, named like vLLM's (`vllm:time_to_first_token_seconds` here is
`phasescope:time_to_first_token_seconds`), fed by the engine's events and read at each scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engine import DecodeStep, Engine, Event, Finished, Started

from ..cli import setup_flags

PREFIX = "phasescope:"
# vLLM's buckets: latencies from a millisecond to minutes
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0)


class ServerMetrics:
    """observe(event) is a hook on the engine (it runs on the engine's thread; prometheus_client is
    thread-safe); render() is the /metrics page."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (submit to first token).",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two successive generated tokens.",
                             TOKEN_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "(E2E - TTFT) / (output tokens - 1), per request.", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Submit to last token, per request.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time in prefill forward passes, per request.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token, per request.",
                                REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        registry.register(_EngineGauges(self))

    def observe(self, event: Event) -> None:
        model = self.model
        if isinstance(event, Started):
            self.prompt_tokens.labels(model).inc(event.num_prompt_tokens)
            self.cache_queries.labels(model).inc(event.num_prompt_tokens)
            self.cache_hits.labels(model).inc(event.num_cached_tokens)
        elif isinstance(event, DecodeStep):
            self.generation_tokens.labels(model).inc()
            if event.step > 0:
                self.itl.labels(model).observe(event.latency_ms / 1000)
        elif isinstance(event, Finished):
            m = event.metrics
            self.success.labels(model, event.reason).inc()
            if m.ttft_ms is not None:
                self.ttft.labels(model).observe(m.ttft_ms / 1000)
                self.prefill.labels(model).observe(m.prefill_ms / 1000)
                self.decode.labels(model).observe(m.decode_ms / 1000)
            if m.tpot_ms is not None:
                self.tpot.labels(model).observe(m.tpot_ms / 1000)
            self.e2e.labels(model).observe(m.e2e_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineGauges:
    """What is true at the moment of a scrape: requests running and waiting, the KV pool's use; and how the
    engine runs (its precision and switches, as labels of a gauge of 1, as vLLM's cache_config_info), so
    that a dashboard's figures say how they were made."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        engine, model = self.metrics.engine, self.metrics.model
        running, waiting = engine.load()
        usage = engine.kv_usage()
        for name, doc, value in (("num_requests_running", "Requests in the running batch.", running),
                                 ("num_requests_waiting", "Requests waiting to be admitted.", waiting),
                                 ("kv_cache_usage_perc", "Share of the KV pool's blocks held by running requests "
                                                         "(1 = full).", usage.num_used / max(usage.num_blocks, 1)),
                                 ("kv_cache_cached_blocks", "KV blocks kept for prefix reuse, held by no request.",
                                  usage.num_cached)):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([model], value)
            yield gauge
        precision, flags = setup_flags(engine.setup)  # at each scrape: the page of `serve --ui` may switch it
        info = GaugeMetricFamily(PREFIX + "engine_info", "How the engine runs: the weights' precision and the "
                                 "switches set away from their defaults, as the flags that set them.",
                                 labels=["model_name", "precision", "switches"])
        info.add_metric([model, precision, flags], 1)
        yield info
