"""Prometheus metrics: `tokenmill:` families plus the seed's gauge family.

Engine gauges (running, waiting, KV blocks, ...) come from the engine's stats and are kept by
one process; request counters and histograms are kept by every API process. With several
HTTP workers the request families live in prometheus_client's multiprocess files and the
supervisor's metrics port merges them (`multiprocess_registry`)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from tokenmill.engine.protocol import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


# Why a request was refused: HTTP 4xx statuses (and gRPC's matching codes) by name, and the
# two 503s (full queue; draining or engine stopped).
REJECT_STATUS = {400: "invalid", 401: "unauthorized", 404: "not_found", 405: "not_found",
                 408: "body_timeout", 409: "duplicate_id", 413: "too_large",
                 431: "headers_too_large"}
REJECT_REASONS = ("queue_full", "not_ready", *dict.fromkeys(REJECT_STATUS.values()))


class Metrics:
    """`engine_gauges=False`: an HTTP worker (the supervisor keeps the gauges);
    `request_metrics=False`: the supervisor of several HTTP workers."""

    def __init__(self, model_name: str, max_num_seqs: int,
                 registry: CollectorRegistry | None = None, engine_gauges: bool = True,
                 request_metrics: bool = True) -> None:
        self.registry = registry or CollectorRegistry()
        self.max_num_seqs = max_num_seqs
        self.model_name = model_name
        self.engine_gauges = engine_gauges
        self.request_metrics = request_metrics
        self._children: dict[tuple, object] = {}  # (metric, label values) -> labeled child
        labels = ["model_name"]
        if request_metrics:
            self._request_families(labels, self.registry)
        if engine_gauges:  # one series per engine replica ("0" with one)
            self._engine_families(labels + ["engine"], self.registry)

    def _request_families(self, labels: list[str], r: CollectorRegistry | None) -> None:
        self.requests = Counter("tokenmill:request_success", "Finished requests by outcome",
                                labels + ["outcome"], registry=r)
        self.rejected_requests = Counter(
            "tokenmill:request_rejected", "Requests refused before reaching the engine, by "
            f"reason ({', '.join(REJECT_REASONS)})", labels + ["reason"], registry=r)
        self.disconnects = Counter("tokenmill:client_disconnects",
                                   "Requests abandoned by their client before finishing",
                                   labels, registry=r)
        self.in_flight = Gauge("tokenmill:num_requests_in_flight",
                               "Requests the API processes are serving now", labels,
                               registry=r, multiprocess_mode="livesum")
        for reason in REJECT_REASONS:  # exported at 0 before the first one
            self._m(self.rejected_requests, reason=reason)
        self._m(self.disconnects)
        self._m(self.in_flight)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed",
                                     labels, registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated",
                                         labels, registry=r)
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds",
                             "Time between consecutive outputs of a request", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds",
                             "Arrival to finish of a request", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds",
                                    "Arrival to first scheduling of a request", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_hist = Histogram("tokenmill:request_prompt_tokens", "Prompt length",
                                     labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_hist = Histogram("tokenmill:request_generation_tokens",
                                         "Generated length", labels, buckets=_TOKEN_BUCKETS,
                                         registry=r)

    def _engine_families(self, labels: list[str], r: CollectorRegistry) -> None:
        self.running = Gauge("tokenmill:num_requests_running", "Requests being computed",
                             labels, registry=r)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Requests queued in the engine",
                             labels, registry=r)
        self.kv_used = Gauge("tokenmill:kv_cache_blocks_used", "KV blocks in use", labels,
                             registry=r)
        self.kv_total = Gauge("tokenmill:kv_cache_blocks_total", "KV blocks in the cache",
                              labels, registry=r)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              labels, registry=r)
        self.prefix_hit_rate = Gauge("tokenmill:prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / queried",
                                     labels, registry=r)
        self.preemptions = Gauge("tokenmill:num_preemptions", "Preemptions so far", labels,
                                 registry=r)
        self.sleep_level = Gauge("tokenmill:engine_sleep_level",
                                 "Sleep mode's level (0: awake; 1: KV cache freed; 2: weights "
                                 "too)", labels, registry=r)
        # speculative decoding: counters fed by the core's cumulative counts (their increase
        # since the replica's last report), the acceptance rate and mean accepted length
        self.spec_counters = {
            field: Counter(f"tokenmill:spec_decode_num_{name}", text, labels, registry=r)
            for field, name, text in (
                ("spec_draft_tokens", "draft_tokens", "Draft tokens verified"),
                ("spec_accepted_tokens", "accepted_tokens", "Draft tokens accepted"),
                ("spec_emitted_tokens", "emitted_tokens", "Tokens emitted by drafted steps"))}
        self._spec_seen: dict[tuple[str, str], int] = {}
        self.spec_acceptance = Gauge("tokenmill:spec_decode_draft_acceptance_rate",
                                     "Draft tokens accepted / verified", labels, registry=r)
        self.spec_length = Gauge("tokenmill:spec_decode_mean_accepted_length",
                                 "Tokens emitted per drafted step", labels, registry=r)
        # LoRA (vLLM's lora_requests_info): one series per engine, its labels the adapters
        # of running and of waiting requests (comma-separated), its value the time (s)
        self.lora_info = Gauge("tokenmill:lora_requests_info", "Running and waiting LoRA "
                               "adapters (labels); value: when observed", labels + [
                                   "max_lora", "running_lora_adapters",
                                   "waiting_lora_adapters"], registry=r)
        self._lora_labels: dict[str, tuple[str, ...]] = {}
        # The seed's family: one series per quantity, each with one label whose key equals
        # its value. Label sets differ between series, which only a custom collector can say.
        self.seed_values: dict[str, float] = {}
        r.register(_SeedGaugeCollector(self.seed_values))


    def _m(self, metric, **labels):
        """The labeled child, looked up once (`labels()` validates and locks on every call:
        ~2 us, paid per streamed token by the inter-token histogram)."""
        key = (id(metric), *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(model_name=self.model_name, **labels)
        return child

    def observe_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """One engine replica's gauges (label `engine`)."""
        if not self.engine_gauges:
            return
        e = str(engine)
        self._m(self.running, engine=e).set(stats.num_running)
        self._m(self.waiting, engine=e).set(stats.num_waiting)
        self._m(self.kv_used, engine=e).set(stats.kv_blocks_used)
        self._m(self.kv_total, engine=e).set(stats.kv_blocks_total)
        self._m(self.kv_usage, engine=e).set(stats.kv_usage)
        queried = stats.prefix_queried_tokens
        self._m(self.prefix_hit_rate, engine=e).set(stats.prefix_hit_tokens / queried
                                                    if queried else 0)
        self._m(self.preemptions, engine=e).set(stats.num_preemptions)
        self._m(self.sleep_level, engine=e).set(stats.sleeping)
        for field, counter in self.spec_counters.items():
            value, last = getattr(stats, field), self._spec_seen.get((field, e), 0)
            # (a replica that restarted counts from 0 again)
            self._m(counter, engine=e).inc(value - last if value >= last else value)
            self._spec_seen[field, e] = value
        if stats.max_loras:
            self._observe_loras(stats, e)
        if stats.spec_draft_tokens:
            self._m(self.spec_acceptance, engine=e).set(
                stats.spec_accepted_tokens / stats.spec_draft_tokens)
            self._m(self.spec_length, engine=e).set(stats.spec_emitted_tokens / stats.spec_steps)

    def _observe_loras(self, stats: SchedulerStats, e: str) -> None:
        labels = (self.model_name, e, str(stats.max_loras), ",".join(stats.running_loras),
                  ",".join(stats.waiting_loras))
        before = self._lora_labels.get(e)
        if before is not None and before != labels:  # (one series per engine, not one per set)
            self.lora_info.remove(*before)
        self._lora_labels[e] = labels
        self.lora_info.labels(*labels).set(time.time())

    def observe_totals(self, stats: SchedulerStats) -> None:
        """Every replica together: the seed's gauges."""
        if not self.engine_gauges:
            return
        free = stats.kv_blocks_total - stats.kv_blocks_used
        values = {"batch_size": stats.num_running, "block_num": free,
                  "max_batch_size": self.max_num_seqs, "max_block_num": stats.kv_blocks_total,
                  "available_resource": free / stats.kv_blocks_total
                  if stats.kv_blocks_total else 0.0}
        self.seed_values.update(values)

    def request_finished(self, outcome: str, prompt_tokens: int, generated_tokens: int,
                         e2e_s: float) -> None:
        if not self.request_metrics:
            return
        self._m(self.requests, outcome=outcome).inc()
        self._m(self.prompt_tokens).inc(prompt_tokens)
        self._m(self.prompt_hist).observe(prompt_tokens)
        self._m(self.generation_hist).observe(generated_tokens)
        self._m(self.e2e).observe(e2e_s)

    def tokens_generated(self, n: int) -> None:
        """Output tokens as they reach the API, every step (as vLLM counts them): a rate
        over the counter moves while long generations run, not only when they end."""
        if self.request_metrics:
            self._m(self.generation_tokens).inc(n)

    def rejected(self, reason: str) -> None:
        if self.request_metrics:
            self._m(self.rejected_requests, reason=reason).inc()

    def request_started(self) -> None:
        if self.request_metrics:
            self._m(self.in_flight).inc()

    def request_ended(self, disconnected: bool) -> None:
        if not self.request_metrics:
            return
        self._m(self.in_flight).dec()
        if disconnected:
            self._m(self.disconnects).inc()

    def first_token(self, ttft_s: float) -> None:
        if not self.request_metrics:
            return
        self._m(self.ttft).observe(ttft_s)

    def inter_token(self, itl_s: float) -> None:
        if not self.request_metrics:
            return
        self._m(self.itl).observe(itl_s)

    def queued(self, queue_s: float) -> None:
        if not self.request_metrics:
            return
        self._m(self.queue_time).observe(queue_s)


class _SeedGaugeCollector:
    """`inference_server_metrics{batch_size="batch_size"} 3` and its four siblings."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self):
        family = GaugeMetricFamily("inference_server_metrics",
                                   "Metrics for monitoring inference server status")
        for key, value in self.values.items():
            family.add_sample("inference_server_metrics", {key: key}, value)
        yield family


def multiprocess_registry(path: str) -> CollectorRegistry:
    """A registry that reads the request families every HTTP worker wrote under `path`.

    Also points the workers spawned after this at `path` (`share_metrics_dir`)."""
    from prometheus_client import multiprocess

    from tokenmill.config.env import share_metrics_dir

    share_metrics_dir(path)

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry
