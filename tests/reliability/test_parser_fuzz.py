"""Catalogue B13: property tests on the request -> params converters and parsers, called
directly (no HTTP). Each may refuse its input only with its own documented error type; what
it accepts comes out in range, and the framing and text paths round-trip."""

import asyncio
import contextlib
import json
import math
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from tritonclient.grpc import service_pb2 as pb

from tokenmill.core.request import FinishReason
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.protocol import EngineCoreOutput
from tokenmill.entrypoints.api import native_protocol, triton_protocol
from tokenmill.entrypoints.api.json_body import BodyError, parse_json_object
from tokenmill.entrypoints.api.openai_protocol import (
    CAPS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tokenmill.entrypoints.api.prompts import PromptEncoder
from tokenmill.entrypoints.kserve import tensors
from tokenmill.entrypoints.kserve.ensemble import ensemble_fields
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer

# Each test stays well under 10 s on a 2-CPU machine; no example database (nothing written
# into the checkout), no deadline (a loaded CI machine is slow, not wrong).
settings.register_profile("reliability-parsers", max_examples=200, deadline=None,
                          database=None, suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile("reliability-parsers")

# Arbitrary JSON values (no NaN/Infinity: they are not JSON), with integers past 64 bits.
_SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)


# parse_json_object ----------------------------------------------------------------------------
def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


@PROFILE
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_parse_json_object_arbitrary_bytes(raw):
    try:
        body = parse_json_object(raw)
    except BodyError:
        return
    assert isinstance(body, dict)


# Strings with lone surrogates (json.dumps writes them as \udXXX escapes) and non-BMP
# characters (written as valid surrogate pairs).
_TEXT = st.text(max_size=8) | st.text(st.characters(min_codepoint=0xD700, max_codepoint=0x1F600),
                                      max_size=4)
_JSON_TEXTS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=10)


@PROFILE
@given(value=_JSON_TEXTS, ascii_only=st.booleans())
def test_parse_json_object_round_trips_dicts(value, ascii_only):
    try:
        raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    except UnicodeEncodeError:  # pragma: no cover - surrogatepass encodes every str
        return
    if not isinstance(value, dict):
        with pytest.raises(BodyError):
            parse_json_object(raw)
        return
    if _has_lone_surrogate(value):
        with pytest.raises(BodyError):  # refused, never handed to a tokenizer
            parse_json_object(raw)
        return
    assert parse_json_object(raw) == value


@settings(PROFILE, max_examples=30)
@given(depth=st.integers(1, 5000), opener=st.sampled_from(["[", '{"a":']))
def test_parse_json_object_deep_nesting(depth, opener):
    closer = "]" if opener == "[" else "}"
    raw = ('{"x":' + opener * depth + "1" + closer * depth + "}").encode()
    with contextlib.suppress(BodyError):  # too deep for the parser is a refusal, not a crash
        assert isinstance(parse_json_object(raw), dict)


# OpenAI request models -> SamplingParams ------------------------------------------------------
def _near_valid(name: str):
    """Values of the kind a field takes, around its limits, plus anything JSON."""
    ints = st.integers(-3, 40) | st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1])
    floats = st.floats(-3, 3, allow_nan=False) | st.sampled_from([0.0, 1.0, 5e-324, 1e308])
    words = st.text(max_size=4) | st.text(min_size=250, max_size=260)
    typed = {
        "n": ints, "max_tokens": ints, "max_completion_tokens": ints, "min_tokens": ints,
        "top_k": ints, "seed": ints, "logprobs": ints | st.booleans(), "top_logprobs": ints,
        "best_of": ints, "temperature": floats, "top_p": floats, "min_p": floats,
        "repetition_penalty": floats, "frequency_penalty": floats, "presence_penalty": floats,
        "stop": words | st.lists(words, max_size=18), "bad_words": st.lists(words, max_size=18),
        "stop_token_ids": st.lists(ints, max_size=18),
        "stream": st.booleans(), "stream_options": st.none() | st.fixed_dictionaries(
            {}, optional={"include_usage": JSON, "continuous_usage_stats": st.booleans()}),
        "prompt": st.text(max_size=6) | st.lists(ints, max_size=4)
        | st.lists(st.lists(ints, max_size=3), max_size=3) | st.lists(st.text(), max_size=40),
        "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]) | JSON},
            optional={"content": st.text(max_size=6) | JSON}), max_size=3),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "tokenize", "x"]), JSON, max_size=2),
        "response_format": st.fixed_dictionaries({}, optional={"type": JSON}),
        "tool_choice": JSON, "tools": JSON, "logit_bias": JSON, "suffix": JSON, "echo": JSON,
    }
    return typed.get(name, JSON) | JSON


def _bodies(model_cls, base: dict):
    names = sorted(set(model_cls.model_fields) | {"unknown_field"})
    return st.lists(st.sampled_from(names), max_size=5, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({n: _near_valid(n) for n in chosen})
    ).map(lambda extra: {**base, **extra})


def _assert_in_range(p: SamplingParams) -> None:
    assert 1 <= p.n <= CAPS.max_n
    assert math.isfinite(p.temperature) and p.temperature >= 0
    assert 0 < p.top_p <= 1 and 0 <= p.min_p <= 1
    assert isinstance(p.top_k, int) and 0 <= p.top_k < 2**63
    assert p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty)
    assert -2 <= p.frequency_penalty <= 2 and -2 <= p.presence_penalty <= 2
    assert isinstance(p.max_tokens, int) and 1 <= p.max_tokens < 2**63
    assert isinstance(p.min_tokens, int) and 0 <= p.min_tokens <= p.max_tokens
    assert len(p.stop) <= CAPS.max_stop
    assert all(isinstance(s, str) and 1 <= len(s) <= CAPS.max_stop_chars for s in p.stop)
    assert len(p.stop_token_ids) <= CAPS.max_stop
    assert all(isinstance(t, int) and 0 <= t < 2**63 for t in p.stop_token_ids)
    assert len(p.bad_words) <= CAPS.max_stop
    assert p.logprobs is None or 0 <= p.logprobs <= CAPS.max_logprobs
    assert p.seed is None or -2**63 <= p.seed < 2**64


def _convert(model_cls, body: dict) -> SamplingParams | None:
    """What the handlers do before admission; None when refused the documented way."""
    try:
        req = model_cls.model_validate(body)
        req.check()
        if model_cls is ChatCompletionRequest:
            req.plain_messages()
            requested = req.requested_max_tokens()
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            requested, logprobs = req.max_tokens, req.logprobs
        return req.sampling_params(requested if requested is not None else 16, logprobs)
    except (ValidationError, ValueError):  # InvalidParameter is a ValueError
        return None


@settings(PROFILE, max_examples=250)
@given(body=_bodies(CompletionRequest, {"prompt": "x"}) | st.dictionaries(st.text(), JSON))
def test_completion_request_converts_or_refuses(body):
    params = _convert(CompletionRequest, body)
    event("accepted" if params is not None else "refused")
    if params is not None:
        _assert_in_range(params)


@settings(PROFILE, max_examples=250)
@given(body=_bodies(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})
       | st.dictionaries(st.text(), JSON))
def test_chat_request_converts_or_refuses(body):
    params = _convert(ChatCompletionRequest, body)
    event("accepted" if params is not None else "refused")
    if params is not None:
        _assert_in_range(params)


# Native API -----------------------------------------------------------------------------------
_NATIVE_FIELDS = ["text", "input_ids", "messages", "system", "max_dec_len", "seq_len",
                  "max_tokens", "min_dec_len", "topp", "top_p", "temperature", "penalty_score",
                  "frequency_score", "presence_score", "timeout", "seed", "infer_seed",
                  "stream", "return_usage", "return_all_tokens", "benchmark", "eos_token_ids",
                  "stop_sequences", "req_id", "response_format"]


def _native_value(name: str):
    ints = st.integers(-3, 600) | st.sampled_from([2**63, 2**70, -2**70, 10**400])
    numbers = ints | st.floats(-1, 2) | st.floats(allow_nan=False, allow_infinity=False)
    typed = {"text": st.text(max_size=10), "input_ids": st.lists(ints, max_size=5),
             "messages": st.lists(st.fixed_dictionaries(
                 {"content": JSON}, optional={"role": JSON}), max_size=3),
             "eos_token_ids": JSON | ints | st.lists(ints | st.text("0123456789²٣ ", max_size=25)),
             "stop_sequences": JSON | st.lists(st.text(max_size=300), max_size=18),
             "req_id": JSON | st.text(max_size=300),
             "response_format": st.fixed_dictionaries({"type": st.sampled_from(
                 ["text", "json_object", "json_schema", "x"]) | JSON}, optional={
                 "json_schema": st.fixed_dictionaries({}, optional={"schema": JSON})})}
    return typed.get(name, numbers) | JSON


_NATIVE_BASES = st.sampled_from([{"text": "hello there"}, {"input_ids": [5, 17, 99]},
                                  {"messages": [{"role": "user", "content": "hi"}]}, {}])
_NATIVE_BODIES = st.tuples(_NATIVE_BASES, st.lists(
    st.sampled_from(_NATIVE_FIELDS), max_size=4, unique=True).flatmap(
    lambda chosen: st.fixed_dictionaries({n: _native_value(n) for n in chosen}))).map(
    lambda parts: {**parts[0], **parts[1]})


@settings(PROFILE, max_examples=250)
@given(body=_NATIVE_BODIES | st.dictionaries(st.text(max_size=6), JSON))
def test_native_validate_raises_only_native_error(body):
    try:
        out = native_protocol.validate(body, SimpleNamespace())
    except native_protocol.NativeError as exc:
        assert isinstance(exc.message, str) and exc.message
        event("refused")
        return
    event("accepted")
    assert isinstance(out["req_id"], str)


# (the server's settings the parsers read: FCFS, no LoRA)
_ENGINE = SimpleNamespace(scheduling_policy="fcfs", enable_lora=False)


def _priority_problem(priority: int):
    """ServerState's check, over the settings above."""
    from tokenmill.entrypoints.api.state import ServerState

    return ServerState.priority_problem(SimpleNamespace(config=SimpleNamespace(
        engine=_ENGINE)), priority)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from tokenmill.loading.checkpoint import load_tokenizer

    return load_tokenizer(tiny_models("llama")[0])


@settings(PROFILE, max_examples=150)
@pytest.fixture(scope="module")
def grammars(tokenizer):
    """The API's structured-output check (fuzzed constraints really compile)."""
    from tokenmill.structured_output.backend import GrammarChecker

    return GrammarChecker(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@given(body=_NATIVE_BODIES)
def test_native_build_request_raises_only_native_error(tokenizer, grammars, body):
    """validate + tokenize + limits + SamplingParams, as admission runs them."""
    state = SimpleNamespace(tokenizer=tokenizer, max_model_len=64, max_seq_len=63,
                            config=SimpleNamespace(max_dec_len=16, engine=_ENGINE),
                            prompts=PromptEncoder(tokenizer, 64),
                            check_structured=grammars.check, lora_of_task=lambda task: None,
                            priority_problem=_priority_problem, images=None)
    try:
        req = asyncio.run(native_protocol.build_request(body, state))
    except native_protocol.NativeError:
        event("refused")
        return
    event("accepted")
    assert 1 <= req.params.max_tokens <= 16 and req.timeout > 0
    assert all(0 <= t < len(tokenizer) for t in req.prompt_token_ids)


# KServe tensors -------------------------------------------------------------------------------
# datatype -> (InferTensorContents field or None, numpy type, element strategy)
_ELEMENTS = {
    "BYTES": ("bytes_contents", None, st.binary(max_size=8)),
    "BOOL": ("bool_contents", np.bool_, st.booleans()),
    "INT8": ("int_contents", np.int8, st.integers(-128, 127)),
    "INT32": ("int_contents", np.int32, st.integers(-2**31, 2**31 - 1)),
    "INT64": ("int64_contents", np.int64, st.integers(-2**63, 2**63 - 1)),
    "UINT8": ("uint_contents", np.uint8, st.integers(0, 255)),
    "UINT64": ("uint64_contents", np.uint64, st.integers(0, 2**64 - 1)),
    "FP16": (None, np.float16, st.floats(width=16, allow_nan=False)),
    "FP32": ("fp32_contents", np.float32, st.floats(width=32, allow_nan=False)),
    "FP64": ("fp64_contents", np.float64, st.floats(allow_nan=False)),
}
_ENSEMBLE_INPUTS = {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL",
                    "temperature": "FP32", "top_k": "INT32", "top_p": "FP32",
                    "stop_words": "BYTES", "end_id": "INT32", "random_seed": "UINT64",
                    "min_tokens": "INT32", "beam_width": "INT32", "return_log_probs": "BOOL",
                    "exclude_input_in_output": "BOOL", "repetition_penalty": "FP32"}


@st.composite
def _tensor(draw, name: str, dtype: str, raw: bool, shape=None, elements=None):
    """(InferInputTensor, raw contents or None, the elements it holds), well formed."""
    field, np_type, strategy = _ELEMENTS[dtype]
    if field is None:
        raw = True  # FP16 travels only as raw contents
    shape = shape if shape is not None else draw(st.lists(st.integers(0, 3), min_size=1,
                                                          max_size=2))
    n = math.prod(shape)
    if elements is None:
        elements = draw(st.lists(strategy, min_size=n, max_size=n))
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=dtype, shape=shape)
    if raw:
        data = tensors.serialize_bytes(elements) if dtype == "BYTES" \
            else np.asarray(elements, dtype=np_type).tobytes()
        return tensor, data, elements
    getattr(tensor.contents, field).extend(elements)
    return tensor, None, elements


def _corrupt(draw, tensor, data):
    """One way a client gets a tensor wrong."""
    how = draw(st.sampled_from(["dtype", "shape", "negative", "raw", "prefix", "contents"]))
    if how == "dtype":
        tensor.datatype = draw(st.sampled_from(["STRING", "", "int32", "BF16", "FP8", "BYTES",
                                                "INT32", "FP32", "BOOL", "\x00\u00e9"]))
    elif how == "shape":
        tensor.shape.append(draw(st.integers(0, 4)))
    elif how == "negative":
        tensor.shape[0] = -draw(st.integers(1, 2**63 - 1))
    elif data is not None and how == "raw":
        data += draw(st.binary(min_size=1, max_size=5))
    elif data is not None and how == "prefix" and len(data) >= 4:
        data = struct.pack("<I", draw(st.integers(0, 2**32 - 1))) + data[4:]
    else:
        tensor.contents.int64_contents.append(draw(st.integers(-5, 5)))
    return tensor, data


@st.composite
def _infer_requests(draw, ensemble: bool = False):
    """(request, expected {name: (dtype, shape, elements)} or None when it was corrupted)."""
    raw = draw(st.booleans())
    if ensemble:  # text_input and max_tokens as tritonclient sends them, plus a few more
        text = draw(st.text(min_size=1, max_size=10).map(str.encode) | st.binary(max_size=6))
        specs = [("text_input", "BYTES", [1, 1], [text]),
                 ("max_tokens", "INT32", [1, 1], [draw(st.integers(-2, 70))])]
        for name in draw(st.lists(st.sampled_from(sorted(_ENSEMBLE_INPUTS)), max_size=3,
                                  unique=True)):
            if name not in ("text_input", "max_tokens"):
                specs.append((name, draw(st.sampled_from([_ENSEMBLE_INPUTS[name]] * 3
                                                         + sorted(_ELEMENTS))),
                              draw(st.sampled_from([[1, 1], [1], [2]])), None))
    else:
        specs = [(draw(st.sampled_from(["IN", "text_input", "x", "y"])),
                  draw(st.sampled_from(sorted(_ELEMENTS))), None, None)
                 for _ in range(draw(st.integers(0, 3)))]
    built = [draw(_tensor(name, dtype, raw, shape, elements))
             for name, dtype, shape, elements in specs]
    expected = {t.name: (t.datatype, list(t.shape), elements) for t, _, elements in built}
    if len(expected) < len(built):
        expected = None  # a name given twice
    raw = raw or any(data is not None for _, data, _ in built)
    # typed contents turned raw below are encoded by the type they were drawn as (a corrupted
    # header type could not encode them: b"" as INT32)
    drawn_as = {id(t): t.datatype for t, _, _ in built}
    for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
        i = draw(st.integers(0, len(built) - 1)) if built else None
        if i is None:
            break
        tensor, data, elements = built[i]
        tensor, data = _corrupt(draw, tensor, data)
        built[i] = (tensor, data, elements)
        expected = None
    if built and draw(st.integers(0, 9)) == 0:  # a name twice
        built.append(built[0])
        expected = None
    request = pb.ModelInferRequest(model_name="ensemble" if ensemble else "model")
    for tensor, data, elements in built:
        request.inputs.append(tensor)
        if raw:  # raw contents are all-or-nothing: typed ones become raw
            if data is None:
                dtype = drawn_as[id(tensor)]
                data = tensors.serialize_bytes(elements) if dtype == "BYTES" else np.asarray(
                    elements, dtype=_ELEMENTS.get(dtype, (0, np.int64))[1]).tobytes()
                tensor.ClearField("contents")
            request.raw_input_contents.append(data)
    if raw and built and draw(st.integers(0, 9)) == 0:  # one raw entry too few or too many
        if draw(st.booleans()):
            request.raw_input_contents.pop()
        else:
            request.raw_input_contents.append(b"")
        expected = None
    return request, expected


@settings(PROFILE, max_examples=250)
@given(case=_infer_requests())
def test_read_inputs_raises_only_tensor_error(case):
    request, expected = case
    try:
        values = tensors.read_inputs(request)
    except tensors.TensorError:
        assert expected is None, request  # a well-formed request must be read
        event("refused")
        return
    event("read")
    assert len(values) == len(request.inputs)  # no name given twice
    for dtype, shape, elements in values.values():
        assert len(elements) == math.prod(shape) and all(d >= 0 for d in shape)
        if dtype == "BYTES":
            assert all(isinstance(e, bytes) for e in elements)
    if expected is not None:  # typed or raw contents read back as sent
        assert values == expected


@settings(PROFILE, max_examples=200)
@given(case=_infer_requests(ensemble=True))
def test_ensemble_path_raises_only_its_errors(tokenizer, grammars, case):
    """gRPC `ensemble` inputs: tensors -> fields -> SamplingParams (as service._ensemble)."""
    request, _ = case
    state = SimpleNamespace(tokenizer=tokenizer, max_model_len=64,
                            config=SimpleNamespace(engine=_ENGINE),
                            prompts=PromptEncoder(tokenizer, 64),
                            check_structured=grammars.check, lora_for=lambda model: None,
                            lora_of_task=lambda task: None, adapters={},
                            priority_problem=_priority_problem)
    try:
        fields, shape = ensemble_fields(tensors.read_inputs(request))
        ids, params, options = asyncio.run(triton_protocol.parse_fields(fields, state))
    except (ValueError, triton_protocol.TritonError):  # TensorError is a ValueError
        event("refused")
        return
    event("accepted")
    assert shape in ([1], [1, 1])
    assert ids and 1 <= params.max_tokens <= 64 - len(ids)
    assert isinstance(options["stream"], bool) and isinstance(options["echo"], str)


@PROFILE
@given(items=st.lists(st.binary(max_size=40), max_size=8))
def test_bytes_round_trip(items):
    assert tensors.deserialize_bytes(tensors.serialize_bytes(items)) == items


def _garble(args):
    raw, cut, flip, extra = args
    raw = bytearray(raw[:cut] + extra)
    if flip is not None and raw:
        raw[flip % len(raw)] ^= 0xFF
    return bytes(raw)


@PROFILE
@given(raw=st.binary(max_size=64) | st.tuples(
    st.lists(st.binary(max_size=8), max_size=4).map(tensors.serialize_bytes),
    st.integers(0, 40), st.none() | st.integers(0, 40), st.binary(max_size=6)).map(_garble))
def test_garbled_bytes_framing(raw):
    """Random, truncated or wrongly prefixed buffers: TensorError, or a framing that
    re-serialises to exactly the same bytes."""
    try:
        items = tensors.deserialize_bytes(raw)
    except tensors.TensorError:
        event("refused")
        return
    event("accepted")
    assert tensors.serialize_bytes(items) == raw


# Streaming text path --------------------------------------------------------------------------
def _chunks(draw, ids: list[int]) -> list[list[int]]:
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(PROFILE, max_examples=150)
@given(data=st.data())
def test_incremental_detokenizer_matches_decode(tokenizer, data):
    """Random ids (special tokens, partial UTF-8 byte tokens included) in random chunks, after
    a real prompt: the deltas, flushed with final=True, are exactly decode(generated ids)."""
    vocab = len(tokenizer)
    skip = data.draw(st.booleans(), "skip_special_tokens")
    prompt = tokenizer.encode(data.draw(st.text(max_size=20), "prompt"),
                              add_special_tokens=False)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=24), "generated")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    chunks = _chunks(data.draw, ids)
    deltas = [detok.add_tokens(chunk, final=i == len(chunks) - 1)
              for i, chunk in enumerate(chunks)]
    assert "".join(deltas) == detok.text
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(PROFILE, max_examples=150)
@given(data=st.data())
def test_stop_strings_never_leak_from_stream_deltas(tokenizer, data):
    """Engine-core outputs through the real OutputProcessor (stop strings applied to the
    decoded text) as delta results, beside the same outputs as cumulative ones: what streams
    before the end is always a prefix of the cumulative text, so a stop string never reaches
    the client unless asked for, and the deltas add up to the cumulative result."""
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(2, vocab - 1), min_size=1, max_size=24), "ids")
    text = tokenizer.decode(ids)
    assume(text)
    stops = data.draw(st.lists(st.integers(0, len(text) - 1).flatmap(
        lambda i: st.integers(i + 1, min(len(text), i + 6)).map(lambda j: text[i:j])),
        min_size=1, max_size=3) | st.lists(st.text("abc ", min_size=1, max_size=3),
                                           min_size=1, max_size=2), "stops")
    include = data.draw(st.booleans(), "include_stop_str_in_output")
    params = SamplingParams(max_tokens=len(ids), stop=stops, include_stop_str_in_output=include)
    processor, reference = OutputProcessor(tokenizer), OutputProcessor(tokenizer)
    [child] = processor.add_request("r", None, [5, 6], params, delta=True)
    reference.add_request("r", None, [5, 6], params)
    chunks = [chunk for chunk in _chunks(data.draw, ids) if chunk]
    streamed, streamed_ids = "", []
    for i, chunk in enumerate(chunks):
        # The engine core marks the last token of a max_tokens-long output LENGTH.
        finish = int(FinishReason.LENGTH) if i == len(chunks) - 1 else None
        [result], _ = processor.process_outputs([EngineCoreOutput(child, chunk, finish)])
        [whole], _ = reference.process_outputs([EngineCoreOutput(child, chunk, finish)])
        d, c = result.outputs[0], whole.outputs[0]
        assert (d.finish_reason, d.stop_reason) == (c.finish_reason, c.stop_reason)
        finished = c.finish_reason is not None
        streamed += d.text
        streamed_ids += d.token_ids
        assert streamed_ids == c.token_ids
        if finished:
            break
        assert c.text.startswith(streamed)
        if not include:
            assert not any(s in streamed for s in stops), (streamed, stops)
    assert finished
    event(f"ended by {'a stop string' if isinstance(c.stop_reason, str) else 'length'}")
    assert streamed == c.text
    if not include:
        assert not any(s in streamed for s in stops), (streamed, stops)
    elif c.stop_reason is not None:
        assert streamed.endswith(c.stop_reason)


# JSON schema / regex -> grammar -------------------------------------------------------------------
_REGEX = st.recursive(
    st.sampled_from(["a", "b", "[0-9]", ".", "[a-z]"]),
    lambda inner: st.builds(lambda r, lo, hi: f"({r}){{{lo},{lo + hi}}}", inner,
                            st.integers(0, 3), st.integers(0, 120))
    | st.builds(lambda a, b: a + b, inner, inner)
    | st.builds(lambda a, b: f"({a}|{b})", inner, inner)
    | st.builds(lambda r, op: f"({r}){op}", inner, st.sampled_from(["*", "+", "?"])),
    max_leaves=6)
_SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number",
                                                    "boolean", "null"])})
    | st.fixed_dictionaries({"type": st.just("string"), "pattern": _REGEX})
    | st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(0, 300)})
    | st.fixed_dictionaries({"enum": st.lists(st.text(max_size=4), min_size=1, max_size=3)}),
    lambda inner: st.fixed_dictionaries({"type": st.just("array"), "items": inner,
                                         "maxItems": st.integers(0, 4)})
    | st.fixed_dictionaries({"type": st.just("object"),
                             "properties": st.dictionaries(st.text("abc", min_size=1,
                                                                   max_size=3),
                                                           inner, max_size=3)})
    | st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
    max_leaves=12)


@settings(PROFILE, max_examples=150)
@given(kind=st.sampled_from(["json", "regex"]), schema=_SCHEMA, regex=_REGEX)
def test_constraints_compile_or_are_refused_by_name(tokenizer, grammars, kind, schema,
                                                    regex):
    """Random schemas (nested, patterns with counted repetitions, anyOf) and regexes: each
    compiles (then masks) or is refused with InvalidParameter naming the field; never
    another exception."""
    from tokenmill.sampling_params import InvalidParameter
    from tokenmill.structured_output import StructuredOutputsParams

    params = StructuredOutputsParams(**{kind: schema if kind == "json" else regex})
    try:
        asyncio.run(grammars.check(params, f"guided_{kind}"))
    except InvalidParameter as exc:
        assert exc.param == f"guided_{kind}", exc
        event("refused")


_TEMPLATE_PIECES = st.sampled_from([
    "{% for m in messages %}", "{% endfor %}", "{{ m['content'] }}", "{{ m.role }}",
    "{% if add_generation_prompt %}", "{% endif %}", "<|im_start|>", "\n", "{{ bos_token }}",
    "{{ raise_exception('no') }}", "{{ messages[5] }}", "{{ m.content | tojson }}",
    "{{ ''.__class__ }}", "{% set x = 1 %}", "{{ x * 10 }}", "{{", "}}", "{%", "text"])


@settings(PROFILE, max_examples=150)
@given(pieces=st.lists(_TEMPLATE_PIECES, max_size=12),
       content=st.text(max_size=20) | st.just("<|im_end|><s>"))
def test_chat_templates_render_or_fail_with_a_template_error(tokenizer, pieces, content):
    """Random templates (unclosed tags, raise_exception, sandbox escapes, index errors):
    each renders, or is a ChatTemplateError; never another exception."""
    from tokenmill.tokenizer import ChatTemplateError, apply_chat_template

    messages = [{"role": "user", "content": content}]
    try:
        ids = apply_chat_template(tokenizer, messages, chat_template="".join(pieces) or "x")
    except ChatTemplateError:
        event("refused")
        return
    assert all(isinstance(i, int) for i in ids)
