"""`--otlp-traces-endpoint URL`: one OpenTelemetry span per API request, exported over
OTLP/HTTP (opentelemetry-sdk; `pip install tokenmill[tracing]`), continuing the caller's
W3C `traceparent`. Attribute names are vLLM's (`gen_ai.*`) where it has one: request id,
sampling settings, token counts, and the latencies from the engine's own timestamps (time in
queue, to first token, in prefill, in decode, end to end)."""

from __future__ import annotations

import time

from tokenmill.engine.request_log import RequestRecord


def _otlp_url(endpoint: str) -> str:
    return endpoint if endpoint.rstrip("/").endswith("/v1/traces") \
        else endpoint.rstrip("/") + "/v1/traces"


class Tracer:
    def __init__(self, endpoint: str, service_name: str = "tokenmill") -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install "
                             "'tokenmill[tracing]'.") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=_otlp_url(endpoint))))
        self.tracer = self.provider.get_tracer("tokenmill")

    def request_span(self, headers: dict[str, str], record: RequestRecord, fields: dict,
                     model: str | None) -> None:
        """The finished request's span (started at its arrival, ended now)."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=headers)
        now = time.time()
        start = now - fields["total_s"]
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                      start_time=int(start * 1e9))
        attributes = {"gen_ai.request.id": fields["request_id"],
                      "http.request.method": fields["method"], "http.route": fields["route"],
                      "http.response.status_code": fields["status"],
                      "gen_ai.usage.prompt_tokens": fields["prompt_tokens"],
                      "gen_ai.usage.completion_tokens": fields["output_tokens"],
                      "gen_ai.latency.e2e": fields["total_s"]}
        if model:
            attributes["gen_ai.response.model"] = model
        if fields["ttft_s"] is not None:
            attributes["gen_ai.latency.time_to_first_token"] = fields["ttft_s"]
        params = record.params
        if params is not None:
            attributes.update({"gen_ai.request.temperature": params.temperature,
                               "gen_ai.request.top_p": params.top_p,
                               "gen_ai.request.max_tokens": params.max_tokens or 0,
                               "gen_ai.request.n": params.n})
        m = record.metrics or {}
        stamps = [m.get(k) for k in ("arrival_time", "first_scheduled_time",
                                     "first_token_time", "last_token_time")]
        for name, (a, b) in (("gen_ai.latency.time_in_queue", stamps[0:2]),
                             ("gen_ai.latency.time_in_model_prefill", stamps[1:3]),
                             ("gen_ai.latency.time_in_model_decode", stamps[2:4])):
            if a and b:
                attributes[name] = max(b - a, 0.0)
        span.set_attributes(attributes)
        span.end(end_time=int(now * 1e9))

    def shutdown(self) -> None:
        """Exports what is still batched."""
        self.provider.shutdown()
