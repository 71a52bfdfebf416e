"""Serving metrics, exported through Ray's metrics agent (Prometheus format, `ray_` prefixed by Ray).

gRPC proxy (clusters `folio serve` starts, folio.serve.proxy_gate):
    folio_proxy_refused_requests_total{method}  calls refused RESOURCE_EXHAUSTED in the proxy: the application full
Ingress (what a client sees):
    folio_requests_total{method, status}        requests by gRPC status name (OK, INVALID_ARGUMENT, ...)
    folio_time_to_first_token_seconds           request received -> first token
    folio_time_per_output_token_seconds         mean gap between tokens after the first, per request
Generator replicas:
    folio_generated_tokens_total                tokens sampled
    folio_prompt_tokens_total / folio_cached_prompt_tokens_total
                                                the prefix-cache hit rate is cached / prompt (rate() of both)
    folio_prefix_cache_hit_rate                 the same ratio, over the replica's lifetime
    folio_pages_in_use / folio_pages_cached / folio_pages_total   KV-cache pages
    folio_kv_page_bytes                         bytes of one KV-cache page (its kv_format's, scales included)
    folio_replica_format_info{weight_format, kv_format}   1: the replica's memory formats (join on app, replica)
    folio_host_tier_pages / folio_host_tier_bytes          the host tier's page slots and their host memory (0: off)
    folio_host_tier_pages_to_host_total / folio_host_tier_pages_from_host_total
                                                pages evicted into the host tier (kept) and copied host -> GPU
    folio_host_tier_copies_to_host_total        GPU -> host copies (evicted pages without a host copy yet)
    folio_prefix_cache_host_hit_pages_total     prefix-hit pages of first admissions that came from the host tier
    folio_engine_steps_total, folio_engine_busy_seconds_total      engine steps and the wall time inside them
    folio_engine_prompt_tokens_computed_total, folio_engine_decode_rows_total, folio_engine_preemptions_total,
    folio_engine_failed_jobs_total                                 from each step's StepStats
    folio_engine_running_jobs / folio_engine_waiting_jobs          after the last step
    folio_engine_drafted_tokens_total / folio_engine_accepted_draft_tokens_total
                                                speculative decoding: tokens drafted, and those the target accepted
                                                (a recent acceptance rate is rate() of accepted / rate() of drafted)
    folio_engine_draft_acceptance_rate          accepted / drafted over the replica's lifetime (set once it drafted)
Each object is created once per process (Ray metrics must not be re-registered per request).

Gauges are set again on every routing-stats poll (Generator.record_routing_stats, every request_routing_stats_period_s),
not only when their value changes: Ray's metrics agent drops a gauge series that no worker has reported for two
export intervals (OpenTelemetryMetricRecorder's TTL, 2 x metrics_report_interval_ms: 20 s by default), and a worker
reports only gauges set since its last export. A gauge set only when a request finished (the hit rate) vanished
from the endpoint ~30 s after a replica's last request.

What folio_requests_total counts: every request that reaches the ingress's code, whatever its outcome -- requests
refused there too: RESOURCE_EXHAUSTED for the ingress's admission bound (folio.serve.admission) and for Serve's
bound on the generator replicas (BackPressureError on the ingress's handle), INVALID_ARGUMENT for a message that
does not convert or validate. Requests refused before the ingress's code runs never reach it: folio's proxy gate
(counted in folio_proxy_refused_requests_total), Serve's gRPC proxy
refusing the ingress's own queue (BackPressureError: RESOURCE_EXHAUSTED), an unknown application (NOT_FOUND), a
draining proxy (UNAVAILABLE), request_timeout_s (DEADLINE_EXCEEDED). Serve's own proxy counters cover those, with
every other proxied request: ray_serve_num_grpc_requests_total{application, method, route, status_code} and
ray_serve_num_grpc_error_requests_total{application, method, route, error_code} (serve_num_http_* for HTTP);
transport refusals are their count minus folio_requests_total's for the same status. Bytes that do not parse as the
request message are refused in the proxy before Serve routes them (folio.serve.grpc_servicer: INVALID_ARGUMENT,
"malformed request") and appear in neither.
"""

from __future__ import annotations

from typing import Any

from ray.util import metrics

LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_GAP_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]


# folio_engine_<name>_total counters, from the engine's StepStats (summed in folio.serve.engine.StepTotals)
STEP_COUNTERS = {
    "steps": "Engine steps.",
    "busy_seconds": "Wall time inside engine steps.",
    "prompt_tokens_computed": "Prompt tokens computed (not reused from the prefix cache).",
    "decode_rows": "Decode rows (one sampled token fed each).",
    "preemptions": "Sequences preempted for want of pages.",
    "failed_jobs": "Jobs that failed inside a step (the others went on).",
    "drafted_tokens": "Tokens drafted for the target to verify (speculative decoding).",
    "accepted_draft_tokens": "Drafted tokens the target accepted (speculative decoding).",
}
# folio_<name>_total counters: (PrefixCacheStats attribute, description); the stats come from folio.cache.reports
HOST_TIER_COUNTERS = {
    "host_tier_pages_to_host": ("num_pages_to_host", "Pages evicted from the KV cache into the host tier."),
    "host_tier_copies_to_host": ("num_copies_to_host", "Pages copied from the KV cache to the host tier "
                                 "(evicted without a host copy; with write-through, computed)."),
    "host_tier_pages_from_host": ("num_pages_from_host", "Pages copied from the host tier back to the KV cache."),
    "prefix_cache_host_hit_pages": ("num_host_hit_pages",
                                    "Prefix-hit pages of first admissions that came from the host tier."),
}
STEP_TOTAL_ATTRIBUTES = {"steps": "num_steps", "busy_seconds": "busy_s", "prompt_tokens_computed": "num_prompt_tokens",
                         "decode_rows": "num_decode_rows", "preemptions": "num_preemptions",
                         "failed_jobs": "num_failed", "drafted_tokens": "num_drafted",
                         "accepted_draft_tokens": "num_accepted_drafts"}


class IngressMetrics:
    def __init__(self, app_name: str):
        tags = {"app": app_name}
        self.requests = metrics.Counter("folio_requests_total", description="Requests by method and final status.",
                                        tag_keys=("app", "method", "status"))
        self.requests.set_default_tags(tags)
        self.ttft = metrics.Histogram("folio_time_to_first_token_seconds",
                                      description="Request received to first token.",
                                      boundaries=LATENCY_BOUNDARIES_S, tag_keys=("app",))
        self.ttft.set_default_tags(tags)
        self.tpot = metrics.Histogram("folio_time_per_output_token_seconds",
                                      description="Mean time between output tokens after the first, per request.",
                                      boundaries=TOKEN_GAP_BOUNDARIES_S, tag_keys=("app",))
        self.tpot.set_default_tags(tags)

    def record(self, method: str, status: str, ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        self.requests.inc(tags={"method": method, "status": status})
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)


class GeneratorMetrics:
    def __init__(self, app_name: str, replica: str):
        tags = {"app": app_name, "replica": replica}
        keys = ("app", "replica")
        self.generated_tokens = metrics.Counter("folio_generated_tokens_total", description="Tokens sampled.",
                                                tag_keys=keys)
        self.prompt_tokens = metrics.Counter("folio_prompt_tokens_total", description="Prompt tokens admitted.",
                                             tag_keys=keys)
        self.cached_prompt_tokens = metrics.Counter(
            "folio_cached_prompt_tokens_total", description="Prompt tokens served from the prefix cache.",
            tag_keys=keys)
        self.hit_rate = metrics.Gauge("folio_prefix_cache_hit_rate",
                                      description="Cached prompt tokens / prompt tokens over the replica's life.",
                                      tag_keys=keys)
        self.pages_in_use = metrics.Gauge("folio_pages_in_use", description="KV-cache pages held by running jobs.",
                                          tag_keys=keys)
        self.pages_cached = metrics.Gauge("folio_pages_cached",
                                          description="KV-cache pages kept for prefix reuse (evictable).",
                                          tag_keys=keys)
        self.pages_total = metrics.Gauge("folio_pages_total", description="KV-cache pages.", tag_keys=keys)
        counter = {name: metrics.Counter(f"folio_engine_{name}_total", description=text, tag_keys=keys)
                   for name, text in STEP_COUNTERS.items()}
        self.step_counters = counter
        self.running = metrics.Gauge("folio_engine_running_jobs", description="Jobs admitted, after the last step.",
                                     tag_keys=keys)
        self.waiting = metrics.Gauge("folio_engine_waiting_jobs", description="Jobs queued, after the last step.",
                                     tag_keys=keys)
        # Over the replica's lifetime, like folio_prefix_cache_hit_rate: the two counters give any recent window.
        self.draft_acceptance_rate = metrics.Gauge(
            "folio_engine_draft_acceptance_rate",
            description="Accepted / drafted tokens over the replica's life (speculative decoding).", tag_keys=keys)
        self.page_bytes = metrics.Gauge("folio_kv_page_bytes", description="Bytes of one KV-cache page.",
                                        tag_keys=keys)
        self.host_pages = metrics.Gauge("folio_host_tier_pages", description="Host-tier page slots (0: no tier).",
                                        tag_keys=keys)
        self.host_bytes = metrics.Gauge("folio_host_tier_bytes", description="Host memory of the host tier.",
                                        tag_keys=keys)
        self.host_counters = {name: metrics.Counter(f"folio_{name}_total", description=text, tag_keys=keys)
                              for name, (_, text) in HOST_TIER_COUNTERS.items()}
        for metric in (self.generated_tokens, self.prompt_tokens, self.cached_prompt_tokens, self.hit_rate,
                       self.pages_in_use, self.pages_cached, self.pages_total, self.running, self.waiting,
                       self.draft_acceptance_rate, self.page_bytes, self.host_pages, self.host_bytes,
                       *counter.values(), *self.host_counters.values()):
            metric.set_default_tags(tags)
        self._tags = tags
        self._format_info: Any = None  # folio_replica_format_info, once record_formats knows the formats
        self._num_prompt = 0
        self._num_cached = 0
        self._published = {name: 0.0 for name in (*STEP_COUNTERS, *HOST_TIER_COUNTERS)}
        self._gauge_values: dict[Any, float] = {}  # gauge -> the value last set (refresh sets it again)

    def _set(self, gauge: Any, value: float) -> None:
        gauge.set(value)
        self._gauge_values[gauge] = value

    def refresh(self) -> None:
        """Set every gauge that has a value to it again, so that Ray's metrics agent never drops it as stale (see
        the module's docstring). Called on every routing-stats poll."""
        for gauge, value in self._gauge_values.items():
            gauge.set(value)

    def record_job(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int) -> None:
        if generated_tokens:
            self.generated_tokens.inc(generated_tokens)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self._num_prompt += prompt_tokens
        if cached_tokens:
            self.cached_prompt_tokens.inc(cached_tokens)
            self._num_cached += cached_tokens
        if self._num_prompt:
            self._set(self.hit_rate, self._num_cached / self._num_prompt)

    def record_steps(self, totals: Any) -> None:
        """Publish the engine's step totals (folio.serve.engine.StepTotals) as counters, by what grew since the
        last call."""
        for name, attribute in STEP_TOTAL_ATTRIBUTES.items():
            value = float(getattr(totals, attribute))
            if value > self._published[name]:
                self.step_counters[name].inc(value - self._published[name])
                self._published[name] = value
        self._set(self.running, totals.num_running)
        self._set(self.waiting, totals.num_waiting)
        # accepted first: the engine thread adds a step's drafted tokens before its accepted ones, so the rate read
        # while a step is being added stays <= 1
        num_accepted = totals.num_accepted_drafts
        num_drafted = totals.num_drafted
        if num_drafted:  # a replica without a drafter exports no rate rather than a made-up 0
            self._set(self.draft_acceptance_rate, num_accepted / num_drafted)

    def record_pages(self, num_in_use: int, num_cached: int, num_pages: int) -> None:
        self._set(self.pages_in_use, num_in_use)
        self._set(self.pages_cached, num_cached)
        self._set(self.pages_total, num_pages)

    def record_formats(self, info: Any) -> None:
        """The replica's memory formats and host tier (folio.serve.schema.ModelInfo): set once at start, kept
        alive by refresh. The format names are labels of a gauge of 1 (Prometheus' info pattern)."""
        if self._format_info is None:
            self._format_info = metrics.Gauge(
                "folio_replica_format_info", description="1, labelled with the replica's weight and KV formats.",
                tag_keys=(*self._tags, "weight_format", "kv_format"))
            self._format_info.set_default_tags({**self._tags, "weight_format": info.weight_format,
                                                "kv_format": info.kv_format})
        self._set(self._format_info, 1)
        self._set(self.page_bytes, info.bytes_per_page)
        self._set(self.host_pages, info.num_host_pages)
        self._set(self.host_bytes, info.host_cache_bytes)

    def record_prefix_cache(self, stats: Any) -> None:
        """Publish the prefix cache's host-tier counters (folio.cache.reports.PrefixCacheStats, running totals) by
        what grew since the last call."""
        for name, (attribute, _) in HOST_TIER_COUNTERS.items():
            value = float(getattr(stats, attribute))
            if value > self._published[name]:
                self.host_counters[name].inc(value - self._published[name])
                self._published[name] = value
