"""Traces: with --otlp-traces-endpoint, one span per request reaches an OTLP/HTTP receiver
this test starts on 127.0.0.1, continuing the caller's `traceparent` (same trace, the
caller's span as parent), with vLLM's attribute names and values that match the response."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.serving import service_thread, wait_until

trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")


class Receiver:
    """An OTLP/HTTP traces endpoint: POST /v1/traces with an ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_pb2.ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def test_one_span_per_request_continuing_traceparent(engine_address):
    receiver = Receiver()
    path, address = engine_address
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        with service_thread(path, address, max_dec_len=64,
                            otlp_traces_endpoint=receiver.url) as thread:
            out = httpx.post(thread.base + "/v1/completions", json={
                "model": "tiny", "prompt": "Paris is", "max_tokens": 5, "temperature": 0.5,
                "top_p": 0.9}, headers={"traceparent": f"00-{trace_id}-{parent_id}-01",
                                        "x-request-id": "req-7"}).json()
            httpx.post(thread.base + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                              "max_tokens": 2})
        # (the app's shutdown flushed the batch)
        assert wait_until(lambda: len(receiver.spans) >= 2, 30)
    finally:
        receiver.close()
    traced, other = sorted(receiver.spans, key=lambda s: s.trace_id.hex() != trace_id)
    assert traced.trace_id.hex() == trace_id and traced.parent_span_id.hex() == parent_id
    assert other.trace_id.hex() != trace_id and not other.parent_span_id
    a = _attributes(traced)
    assert a["gen_ai.request.id"] == "req-7" and a["http.route"] == "/v1/completions"
    assert a["gen_ai.usage.prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == out["usage"]["completion_tokens"]
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.response.model"] == "tiny"
    for name in ("gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
                 "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode"):
        assert 0 <= a[name] <= a["gen_ai.latency.e2e"], name
    assert traced.end_time_unix_nano > traced.start_time_unix_nano
