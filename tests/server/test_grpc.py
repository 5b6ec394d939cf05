"""The gRPC service through the real `tritonclient.grpc` against `tokenmill serve`."""

import json
import queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from tests.serving import HOLD_TOKENS, Served, metric, wait_until


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    # One running slot and one waiting slot, so overload and cancellation are easy to reach;
    # the long-context model with room for requests still running when a test looks.
    flags = ["--max-num-seqs", "1", "--max-cached-task-num", "1",
             "--max-dec-len", str(HOLD_TOKENS)]
    with Served(tiny_models("llama_long")[0], tmp_path_factory.mktemp("grpc"),
                *flags).running() as s:
        yield s


@pytest.fixture
def client(served):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    yield c
    c.close()


def seed_input(payload) -> grpcclient.InferInput:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    inp = grpcclient.InferInput("IN", [1], "BYTES")
    inp.set_data_from_numpy(np.array([raw], dtype=object))
    return inp


def ensemble_inputs(text, max_tokens, **extra):
    t = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[text]], dtype=object))
    m = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    inputs = [t, m]
    for name, (dtype, value) in extra.items():
        x = grpcclient.InferInput(name, [1, 1], dtype)
        np_type = {"BOOL": bool, "FP32": np.float32, "INT32": np.int32, "BYTES": object}[dtype]
        x.set_data_from_numpy(np.array([[value]], dtype=np_type))
        inputs.append(x)
    return inputs


def stream(client, model, inputs, request_id="", cancel_after=None, **kwargs):
    """Runs one request over start_stream/async_stream_infer; returns (results, errors)."""
    results, errors, q = [], [], queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, **kwargs)
        while True:
            result, error = q.get(timeout=60)
            if error is not None:
                errors.append(error)
                return results, errors
            results.append(result)
            if cancel_after is not None and len(results) >= cancel_after:
                return results, errors
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results, errors
    finally:
        client.stop_stream(cancel_requests=True)


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("model") and client.is_model_ready("ensemble")
    assert client.is_model_ready("tiny") and not client.is_model_ready("nope")
    meta = client.get_model_metadata("model")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("IN", "BYTES", [1])]
    assert [t.name for t in meta.outputs] == ["OUT"]
    config = client.get_model_config("model").config
    assert config.model_transaction_policy.decoupled
    assert "text_input" in [t.name for t in client.get_model_metadata("ensemble").inputs]
    for name in ("ensemble", "tensorrt_llm_bls", "tiny"):  # (their perf outputs are INT64)
        ensemble = client.get_model_config(name).config
        meta = client.get_model_metadata(name)
        assert [t.name for t in ensemble.output] == [t.name for t in meta.outputs]
        assert {t.name: t.data_type for t in ensemble.output}["kv_cache_reused_blocks"] == \
            model_config_pb2.TYPE_INT64
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")


def test_seed_stream_matches_native_http(client, served):
    body = {"text": "The quick brown fox", "temperature": 0, "max_dec_len": 12}
    http = httpx.post(served.api + "/v1/chat/completions", json=body, timeout=60).json()
    results, errors = stream(client, "model", [seed_input([{**body, "req_id": "g-1"}])])
    assert not errors
    messages = [json.loads(r.as_numpy("OUT")[0]) for r in results]
    assert all(isinstance(m, list) and len(m) == 1 for m in messages)  # the seed's wire form
    messages = [m[0] for m in messages]
    assert "".join(m["token"] for m in messages) == http["result"]
    assert messages[-1]["is_end"] == 1 and messages[-1]["req_id"] == "g-1"
    assert sum(1 for m in messages if m["token"]) > 1
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False] * (len(finals) - 1) + [True]
    # Unary infer returns the final message; req_id defaults to the request id.
    unary = client.infer("model", [seed_input([body])], request_id="g-2")
    last = json.loads(unary.as_numpy("OUT")[0])[0]
    assert last["tokens_all"] == http["result"] and last["req_id"] == "g-2"


def test_seed_validation_errors_are_messages(client):
    for payload, text in (([{"text": "hi", "topp": 2, "req_id": "v"}], "`topp` must be in"),
                          ([{"text": "hi"}], "should contain `req_id`"),
                          ([], "query num 0 should be 1")):
        results, errors = stream(client, "model", [seed_input(payload)])
        assert not errors and len(results) == 1
        message = json.loads(results[0].as_numpy("OUT")[0])
        assert isinstance(message, dict) and text in message["error_msg"]
        assert message["error_code"] == 400


def test_ensemble_stream_and_infer_match_http_generate(client, served):
    http = httpx.post(served.api + "/v2/models/ensemble/generate",
                      json={"text_input": "The river runs", "max_tokens": 10}, timeout=60).json()
    unary = client.infer("ensemble", ensemble_inputs("The river runs", 10))
    assert unary.as_numpy("text_output").shape == (1, 1)
    assert unary.as_numpy("text_output")[0][0].decode() == http["text_output"]
    results, errors = stream(client, "ensemble",
                             ensemble_inputs("The river runs", 10, stream=("BOOL", True)))
    assert not errors and len(results) > 1
    text = "".join(r.as_numpy("text_output")[0][0].decode() for r in results)
    assert "The river runs" + text == http["text_output"]
    with_logprobs = client.infer("ensemble", ensemble_inputs(
        "The river runs", 4, return_log_probs=("BOOL", True)))
    assert with_logprobs.as_numpy("output_log_probs").shape == (1, 4)


@pytest.mark.parametrize("model,make_inputs,code,text", [
    ("nope", lambda: ensemble_inputs("x", 2), "StatusCode.NOT_FOUND", "unknown model"),
    ("model", lambda: [seed_input(b"{broken")], "StatusCode.INVALID_ARGUMENT", "not valid JSON"),
    ("model", lambda: ensemble_inputs("x", 2), "StatusCode.INVALID_ARGUMENT",
     "exactly one input 'IN'"),
    ("ensemble", lambda: [seed_input([{"text": "x"}])], "StatusCode.INVALID_ARGUMENT",
     "unexpected inference input 'IN'"),
    ("ensemble", lambda: ensemble_inputs("x", 2, temperature=("BOOL", True)),
     "StatusCode.INVALID_ARGUMENT", "must be FP32"),
    ("ensemble", lambda: ensemble_inputs("x", 0), "StatusCode.INVALID_ARGUMENT",
     "max_tokens must be at least 1"),
])
def test_protocol_errors(client, model, make_inputs, code, text):
    with pytest.raises(InferenceServerException) as err:
        client.infer(model, make_inputs())
    assert err.value.status() == code and text in err.value.message()
    results, errors = stream(client, model, make_inputs())
    assert not results and text in str(errors[0])


def test_wrong_shape_is_invalid(client):
    inp = grpcclient.InferInput("IN", [2], "BYTES")
    inp.set_data_from_numpy(np.array([b"[]", b"[]"], dtype=object))
    with pytest.raises(InferenceServerException) as err:
        client.infer("model", [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "shape [1]" in str(err.value)


def test_overload_is_unavailable_and_cancel_frees_kv(client, served):
    long = {"text": "go", "max_dec_len": HOLD_TOKENS, "min_dec_len": HOLD_TOKENS, "temperature": 0}

    def finished_by_length() -> float:
        try:
            return metric(served.metrics, "tokenmill:request_success_total", outcome="length")
        except KeyError:  # no request of this server has finished by length yet
            return 0.0

    length_before = finished_by_length()
    busy = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    q = queue.Queue()
    busy.start_stream(callback=lambda result, error: q.put((result, error)))
    busy.async_stream_infer("model", [seed_input([{**long, "req_id": "busy-1"}])])
    busy.async_stream_infer("model", [seed_input([{**long, "req_id": "busy-2"}])])
    try:
        assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 1
                          and metric(served.metrics, "tokenmill:num_requests_waiting") == 1)
        with pytest.raises(InferenceServerException) as err:
            client.infer("ensemble", ensemble_inputs("x", 2))
        assert err.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        busy.stop_stream(cancel_requests=True)  # the client cancels both requests
        busy.close()
    assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 0
                      and metric(served.metrics, "tokenmill:num_requests_waiting") == 0
                      and metric(served.metrics, "tokenmill:kv_cache_blocks_used") == 0)
    # A busy request may have finished all its tokens before the cancel on a fast machine;
    # every other one must be counted as aborted (the API side counts it when its stream ends).
    completed = set()
    while not q.empty():
        result, _ = q.get()
        if result is not None:
            message = json.loads(result.as_numpy("OUT")[0])
            message = message[0] if isinstance(message, list) else message
            if message.get("is_end") == 1:
                completed.add(message["req_id"])
    assert wait_until(lambda: metric(served.metrics, "tokenmill:request_success_total",
                                     outcome="abort") >= 2 - len(completed)), completed
    # ...and none ran on to its length after the cancel (Python 3.11's wait_for dropped it).
    assert finished_by_length() == length_before + len(completed)


def test_metadata_names_the_tenant_and_the_queue_time_limit(client, served):
    """The call's metadata is read as the HTTP side's headers: a request kept waiting past
    its x-max-queue-time (the one slot held) is RESOURCE_EXHAUSTED; x-tenant-id names the
    tenant its tokens count for (not one --tenant-weights names: "other")."""
    def other_tokens() -> float:
        try:
            return metric(served.metrics, "tokenmill:tenant_generation_tokens_total",
                          tenant="other")
        except KeyError:
            return 0.0

    before = other_tokens()
    client.infer("ensemble", ensemble_inputs("hi", 3, min_length=("INT32", 3)),
                 headers={"x-tenant-id": "team-a"})
    assert wait_until(lambda: other_tokens() == before + 3)
    long = {"text": "go", "max_dec_len": HOLD_TOKENS, "min_dec_len": HOLD_TOKENS,
            "temperature": 0, "req_id": "hold-slot"}
    busy = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    busy.start_stream(callback=lambda result, error: None)
    busy.async_stream_infer("model", [seed_input([long])])
    try:
        assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 1)
        with pytest.raises(InferenceServerException) as err:
            client.infer("ensemble", ensemble_inputs("x", 2), headers={"x-max-queue-time": "0.2"})
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "max_queue_time" in str(err.value)
    finally:
        busy.stop_stream(cancel_requests=True)
        busy.close()
    assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 0
                      and metric(served.metrics, "tokenmill:kv_cache_blocks_used") == 0)


def test_deadline_expiry_aborts_and_cancel_after_final_is_harmless(client, served):
    """Catalogue F4: a client deadline that expires mid-generation aborts the request (KV
    freed); cancelling a stream after its final response changes nothing; later RPCs work."""
    long = {"text": "go", "max_dec_len": HOLD_TOKENS, "min_dec_len": HOLD_TOKENS, "temperature": 0,
            "req_id": "deadline-1"}
    with pytest.raises(InferenceServerException) as err:
        client.infer("model", [seed_input([long])], client_timeout=0.3)
    assert "DEADLINE_EXCEEDED" in err.value.status()
    assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 0
                      and metric(served.metrics, "tokenmill:kv_cache_blocks_used") == 0)
    results, errors = stream(client, "model", [seed_input([{"text": "hi", "max_dec_len": 3,
                                                            "req_id": "deadline-1"}])])
    assert not errors and json.loads(results[-1].as_numpy("OUT")[0])[0]["is_end"] == 1
    assert client.is_server_ready() and client.is_model_ready("model")


def test_ensemble_guided_json_and_trtllm_guides(client):
    """Structured outputs over gRPC: a JSON schema in `guided_json`, TensorRT-LLM's guide
    type + guide; a bad schema is an error naming the input."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    for extra, check in (
            ({"guided_json": ("BYTES", json.dumps(schema))},
             lambda t: set(json.loads(t)) == {"n"}),
            ({"guided_decoding_guide_type": ("BYTES", "regex"),
              "guided_decoding_guide": ("BYTES", "[0-9]{4}")},
             lambda t: len(t) == 4 and t.isdigit())):
        out = client.infer("ensemble", ensemble_inputs(
            "The river runs", 60, exclude_input_in_output=("BOOL", True),
            temperature=("FP32", 1.0), **extra))
        assert check(out.as_numpy("text_output")[0][0].decode())
    with pytest.raises(InferenceServerException, match="guided_json"):
        client.infer("ensemble", ensemble_inputs(
            "The river runs", 4, guided_json=("BYTES", '{"type": "nonsense"}')))


def test_ensemble_beam_width(client, tiny_models):
    """beam_width over gRPC: TensorRT-LLM's shapes ([1, beams] texts and cum_log_probs,
    [1, beams, len] output_log_probs), the beams transformers' generate(num_beams) finds."""
    import torch
    from transformers import AutoTokenizer

    path, hf = tiny_models("llama_long")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode("The river runs")
    want = hf.eval().generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3,
                              do_sample=False, max_new_tokens=5, pad_token_id=1,
                              eos_token_id=1, attention_mask=torch.ones(1, len(ids),
                                                                        dtype=torch.long))
    out = client.infer("ensemble", ensemble_inputs(
        "The river runs", 5, beam_width=("INT32", 3), return_log_probs=("BOOL", True),
        exclude_input_in_output=("BOOL", True)))
    texts = out.as_numpy("text_output")
    assert texts.shape == (1, 3)
    assert [t.decode() for t in texts[0]] == [
        tok.decode(row[len(ids):], skip_special_tokens=True) for row in want.tolist()]
    assert out.as_numpy("cum_log_probs").shape == (1, 3)
    assert out.as_numpy("output_log_probs").shape == (1, 3, 5)
    cum = out.as_numpy("cum_log_probs")[0]
    assert list(cum) == sorted(cum, reverse=True)  # (best first: equal lengths)
