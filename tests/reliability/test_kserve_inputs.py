"""Catalogue B12: malformed KServe v2 / Triton inputs over gRPC (the real `tritonclient.grpc`,
and raw `ModelInferRequest` protobufs through the stub where tritonclient would refuse the
request client-side) and over the Triton HTTP generate routes: each is INVALID_ARGUMENT (400
over HTTP), never INTERNAL/UNKNOWN, the server stays healthy, and a thousand repeats of a bad
request do not grow the server's memory."""

import json
import struct

import grpc
import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from tests.reliability.checks import assert_no_leak

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def served(served_llama):
    return served_llama


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(f"127.0.0.1:{served.ports['grpc']}")
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def client(served):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    yield c
    c.close()


# Raw requests ---------------------------------------------------------------------------------
def tensor(name: str, datatype: str, shape: list[int], **contents):
    t = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(t.contents, field).extend(values)
    return t


def request(model: str, *inputs, raw: list[bytes] | None = None) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model, id="b12")
    r.inputs.extend(inputs)
    r.raw_input_contents.extend(raw or [])
    return r


def seed_in(payload: bytes) -> pb.ModelInferRequest:
    return request("model", tensor("IN", "BYTES", [1]), raw=[struct.pack("<I", len(payload))
                                                             + payload])


TEXT = tensor("text_input", "BYTES", [1, 1], bytes_contents=[b"hello"])
MAX_TOKENS = tensor("max_tokens", "INT32", [1, 1], int_contents=[2])
GOOD_SEED = json.dumps([{"text": "hello", "max_dec_len": 2, "req_id": "ok"}]).encode()

# (case id, request, a fragment of the error message)
BAD = [
    # wrong datatype
    ("text-as-int32", request("ensemble", tensor("text_input", "INT32", [1], int_contents=[5]),
                              MAX_TOKENS), "must be BYTES"),
    ("temperature-as-bool", request("ensemble", TEXT, MAX_TOKENS, tensor(
        "temperature", "BOOL", [1], bool_contents=[True])), "must be FP32"),
    ("max-tokens-as-fp32", request("ensemble", TEXT, tensor(
        "max_tokens", "FP32", [1], fp32_contents=[2.0])), "must be an integer type"),
    ("seed-in-as-fp32", request("model", tensor("IN", "FP32", [1], fp32_contents=[1.0])),
     "must be BYTES"),
    ("unknown-datatype", request("ensemble", tensor("text_input", "STRING", [1],
                                                    bytes_contents=[b"x"]), MAX_TOKENS),
     "unsupported datatype"),
    ("fp16-without-raw", request("ensemble", TEXT, tensor("temperature", "FP16", [1])),
     "needs raw contents"),
    # shape mismatch
    ("shape-2-one-element", request("ensemble", tensor("text_input", "BYTES", [2],
                                                       bytes_contents=[b"x"]), MAX_TOKENS),
     "has 1 elements but shape [2]"),
    ("shape-1-three-elements", request("ensemble", TEXT, tensor(
        "max_tokens", "INT32", [1, 1], int_contents=[1, 2, 3])), "has 3 elements"),
    ("negative-dimension", request("ensemble", TEXT, tensor(
        "max_tokens", "INT32", [-1], int_contents=[2])), "negative dimension"),
    ("batch-of-two", request("ensemble", tensor("text_input", "BYTES", [2, 1],
                                                bytes_contents=[b"a", b"b"]), MAX_TOKENS),
     "exactly one value"),
    ("seed-in-shape-2", request("model", tensor("IN", "BYTES", [2],
                                                bytes_contents=[GOOD_SEED, GOOD_SEED])),
     "shape [1]"),
    # missing required input
    ("no-text-input", request("ensemble", MAX_TOKENS), "text_input"),
    ("no-inputs-seed", request("model"), "exactly one input 'IN'"),
    ("no-inputs-ensemble", request("ensemble"), "text_input"),
    # duplicate input names
    ("duplicate-text-input", request("ensemble", TEXT, TEXT, MAX_TOKENS), "more than once"),
    ("duplicate-seed-in", request("model", tensor("IN", "BYTES", [1], bytes_contents=[GOOD_SEED]),
                                  tensor("IN", "BYTES", [1], bytes_contents=[GOOD_SEED])),
     "more than once"),
    # BYTES framing in raw_input_contents
    ("length-prefix-too-long", request("ensemble", tensor("text_input", "BYTES", [1]),
                                       tensor("max_tokens", "INT32", [1]),
                                       raw=[struct.pack("<I", 1000) + b"abc",
                                            struct.pack("<i", 2)]),
     "longer than its buffer"),
    ("length-prefix-truncated", request("ensemble", tensor("text_input", "BYTES", [1]),
                                        tensor("max_tokens", "INT32", [1]),
                                        raw=[b"\x05\x00", struct.pack("<i", 2)]),
     "inside an element length"),
    ("length-prefix-max", request("model", tensor("IN", "BYTES", [1]),
                                  raw=[b"\xff\xff\xff\xff" + b"[]"]), "longer than its buffer"),
    ("extra-bytes-after-element", request("model", tensor("IN", "BYTES", [1]), raw=[
        struct.pack("<I", len(GOOD_SEED)) + GOOD_SEED + b"\x01"]), "inside an element length"),
    # declared size != data size
    ("int32-raw-6-bytes", request("ensemble", tensor("text_input", "BYTES", [1]),
                                  tensor("max_tokens", "INT32", [1]),
                                  raw=[struct.pack("<I", 2) + b"hi", b"\x02\x00\x00\x00\x00\x00"]),
     "max_tokens"),
    ("int32-raw-two-for-one", request("ensemble", tensor("text_input", "BYTES", [1]),
                                      tensor("max_tokens", "INT32", [1]),
                                      raw=[struct.pack("<I", 2) + b"hi",
                                           struct.pack("<ii", 2, 3)]),
     "has 2 elements but shape [1]"),
    ("raw-entries-count", request("ensemble", tensor("text_input", "BYTES", [1]),
                                  tensor("max_tokens", "INT32", [1]),
                                  raw=[struct.pack("<I", 2) + b"hi"]),
     "raw_input_contents has 1 entries for 2 inputs"),
    ("huge-declared-shape", request("ensemble", tensor("text_input", "BYTES", [2**62, 2**62],
                                                       bytes_contents=[b"x"]), MAX_TOKENS),
     "elements but shape"),
    # payloads that parse as tensors but not as text / JSON
    ("text-not-utf8", request("ensemble", tensor("text_input", "BYTES", [1],
                                                 bytes_contents=[b"\xff\xfe"]), MAX_TOKENS),
     "not valid UTF-8"),
    ("text-utf8-encoded-surrogate", request(
        "ensemble", tensor("text_input", "BYTES", [1], bytes_contents=[b"a\xed\xa0\x80"]),
        MAX_TOKENS), "not valid UTF-8"),
    ("seed-not-json", seed_in(b"{nope"), "not valid JSON"),
    ("seed-utf8-encoded-surrogate", seed_in(b'[{"text": "a\xed\xa0\x80", "req_id": "s"}]'),
     "not valid JSON"),
    ("seed-lone-surrogate-escape", seed_in(b'[{"text": "a\\ud800", "req_id": "s"}]'),
     "surrogate"),
    ("seed-deep-nesting", seed_in(b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
    ("seed-nan", seed_in(b'[{"text": "a", "req_id": "s", "temperature": NaN}]'),
     "not valid JSON"),
    # values out of range
    ("max-tokens-zero", request("ensemble", TEXT, tensor("max_tokens", "INT32", [1],
                                                         int_contents=[0])), "at least 1"),
    ("temperature-nan", request("ensemble", TEXT, MAX_TOKENS, tensor(
        "random_seed", "UINT64", [1], uint64_contents=[2**64 - 1]), tensor(
        "top_k", "INT32", [1], int_contents=[5]), tensor(  # not greedy: temperature is read
        "temperature", "FP32", [1], fp32_contents=[float("nan")])), "temperature"),
    ("end-id-out-of-vocab", request("ensemble", TEXT, MAX_TOKENS, tensor(
        "end_id", "INT32", [1], int_contents=[100_000]), tensor(
        "min_tokens", "INT32", [1], int_contents=[2])), "end_id"),
    ("top-k-int64-max", request("ensemble", TEXT, MAX_TOKENS, tensor(
        "top_k", "UINT64", [1], uint64_contents=[2**64 - 1])), "top_k"),
    # caps and ranges the HTTP routes apply too
    ("bad-words-40000", request("ensemble", TEXT, MAX_TOKENS, tensor(
        "bad_words", "BYTES", [40_000], bytes_contents=[b"w%d" % i for i in range(40_000)])),
     "bad_words may have at most 16 entries"),
    ("greedy-negative-temperature", request("ensemble", TEXT, MAX_TOKENS, tensor(
        "temperature", "FP32", [1], fp32_contents=[-1.0])), "temperature"),
    ("seed-message-role-int", seed_in(json.dumps([{"messages": [{"role": 3, "content": "x"}],
                                                   "req_id": "m"}]).encode()),
     "`messages[0].role` must be a string"),
    ("seed-req-id-object", seed_in(json.dumps([{"text": "x", "req_id": {"a": 1}}]).encode()),
     "`req_id` must be a string"),
]


def unary_status(stub, req) -> tuple[grpc.StatusCode, str]:
    try:
        stub.ModelInfer(req, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def seed_message(response: pb.ModelInferResponse) -> dict:
    """The seed model's OUT: `[message]`, or a bare error dict (error_msg, error_code)."""
    raw = response.raw_output_contents[0]
    message = json.loads(raw[4:4 + struct.unpack_from("<I", raw)[0]])
    return message[0] if isinstance(message, list) else message


@pytest.mark.parametrize("req,fragment", [(r, f) for _, r, f in BAD],
                         ids=[name for name, _, _ in BAD])
def test_bad_request_is_invalid_argument(stub, req, fragment):
    try:
        response = stub.ModelInfer(req, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() == INVALID, (exc.code(), exc.details())
        assert fragment in exc.details(), exc.details()
        assert_no_leak(exc.details())
        return
    # The seed's `model` reports validation failures in-band (its documented protocol).
    message = seed_message(response)
    assert message["error_code"] == 400 and fragment in message["error_msg"], message


@pytest.mark.parametrize("req,fragment", [(r, f) for _, r, f in BAD[::3]],
                         ids=[name for name, _, _ in BAD[::3]])
def test_bad_request_in_a_stream_is_an_error_message(stub, req, fragment):
    """On ModelStreamInfer a bad request is one response with `error_message`; the stream
    stays open and serves the next request."""
    good = seed_in(GOOD_SEED)
    responses = list(stub.ModelStreamInfer(iter([req, good]), timeout=60))
    errors = [r.error_message for r in responses if r.error_message]
    finals = [r for r in responses if not r.error_message
              and r.infer_response.parameters["triton_final_response"].bool_param]
    if errors:
        assert len(errors) == 1 and fragment in errors[0], errors
    else:  # in-band seed error message
        assert any(seed_message(r.infer_response).get("error_code") == 400 for r in finals)
    assert any(seed_message(r.infer_response).get("req_id") == "ok"
               and seed_message(r.infer_response).get("is_end") == 1 for r in finals)


def test_tritonclient_refusals(client):
    """What tritonclient itself can send: wrong datatype, missing input, duplicate name,
    wrong shape for the seed model."""
    def text_input(dtype="BYTES", value=b"hello", name="text_input"):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        np_type = object if dtype == "BYTES" else {"INT32": np.int32, "FP32": np.float32}[dtype]
        t.set_data_from_numpy(np.array([[value]], dtype=np_type))
        return t

    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[2]], dtype=np.int32))
    for inputs, fragment in (([text_input("INT32", 5), max_tokens], "must be BYTES"),
                             ([max_tokens], "text_input"),
                             ([text_input(), text_input(), max_tokens], "more than once"),
                             ([text_input(), max_tokens, text_input("FP32", 1.0, "stream")],
                              "must be BOOL")):
        with pytest.raises(InferenceServerException) as err:
            client.infer("ensemble", inputs)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value
        assert fragment in err.value.message()
    result = client.infer("ensemble", [text_input(), max_tokens])
    assert result.as_numpy("text_output").size == 1


def test_triton_http_generate_refusals(served):
    """The same inputs as JSON on the Triton HTTP generate route: 400 with {"error": str}."""
    url = served.api + "/v2/models/ensemble/generate"
    for body in ({"max_tokens": 2}, {"text_input": 5, "max_tokens": 2},
                 {"text_input": "hi", "max_tokens": "2"}, {"text_input": "hi", "stream": "yes"},
                 {"text_input": "hi", "max_tokens": 2, "temperature": True, "top_k": 5},
                 {"text_input": "hi", "max_tokens": 10**400},
                 {"text_input": "hi", "max_tokens": 2, "temperature": 10**400, "top_k": 5},
                 {"text_input": "hi", "max_tokens": 2, "random_seed": 2**70},
                 {"text_input": "hi", "max_tokens": 2, "end_id": 10**6, "min_tokens": 2},
                 {"text_input": "hi", "max_tokens": 2, "parameters": [1]},
                 {"text_input": "hi", "max_tokens": 2, "text_input ": "x"}):
        resp = httpx.post(url, json=body, timeout=30)
        assert resp.status_code == 400, (body, resp.status_code, resp.text)
        assert isinstance(resp.json()["error"], str)
        assert_no_leak(resp.text)
    resp = httpx.post(url, content=b'{"text_input": "a\xed\xa0\x80", "max_tokens": 2}',
                      timeout=30)
    assert resp.status_code == 400, resp.text
    # No KServe v2 HTTP tensor `infer` route: an unknown route, not a server error.
    resp = httpx.post(served.api + "/v2/models/ensemble/infer", json={"inputs": []}, timeout=30)
    assert resp.status_code in (404, 405), resp.text


def tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def test_repeated_bad_requests_leak_nothing_and_server_stays_healthy(served, stub, client):
    bad = dict((name, r) for name, r, _ in BAD)
    cycle = [bad["length-prefix-too-long"], bad["duplicate-text-input"],
             bad["int32-raw-two-for-one"], bad["seed-not-json"]]
    rss = {}
    for i in range(1, 1001):
        code, _ = unary_status(stub, cycle[i % len(cycle)])
        assert code == INVALID, (i, code)
        if i in (200, 1000):
            rss[i] = tree_rss(served.process.pid)
    grown = (rss[1000] - rss[200]) / 2**20
    assert grown < 20, f"process tree RSS grew {grown:.1f} MiB over 800 bad requests"
    assert served.process.poll() is None
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("ensemble") and client.is_model_ready("model")
    assert httpx.get(served.health + "/v2/health/ready", timeout=10).status_code == 200
    code, _ = unary_status(stub, seed_in(GOOD_SEED))
    assert code == grpc.StatusCode.OK


def test_a_message_over_the_size_limit_is_refused_by_grpc_itself(served, stub, client):
    """10 MB of text_input: gRPC refuses the message (RESOURCE_EXHAUSTED) before any of our
    code reads it; the server is as ready as before."""
    huge = request("ensemble", tensor("text_input", "BYTES", [1],
                                      bytes_contents=[b"a" * (10 << 20)]), MAX_TOKENS)
    code, _ = unary_status(stub, huge)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
    assert client.is_server_ready()
    assert unary_status(stub, seed_in(GOOD_SEED))[0] == grpc.StatusCode.OK
