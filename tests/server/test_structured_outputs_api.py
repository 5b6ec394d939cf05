"""Structured outputs over HTTP with the real `openai` SDK: response_format (a pydantic model
through the SDK's `parse`, json_schema streamed, json_object), vLLM's guided_* fields and its
structured_outputs object; bad constraints are 400s naming the field."""

import asyncio
import json
import re
import threading
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tokenmill.sampling_params import InvalidParameter
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.backend import GrammarChecker


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=130)
    tags: list[Annotated[str, Field(max_length=5)]] = Field(max_length=2)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Describe a person."}]


def test_sdk_parse_with_a_pydantic_model(client):
    for seed in range(3):
        resp = client.chat.completions.parse(model="tiny", messages=MESSAGES,
                                             response_format=Person, max_tokens=300,
                                             temperature=1.0, seed=seed)
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person)
        assert Person.model_validate_json(message.content) == message.parsed


def test_json_schema_streamed_and_json_object(client):
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                  "strict": True}}
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300,
                                            temperature=1.0, seed=4, stream=True,
                                            response_format=fmt)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Person.model_validate_json(text)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300,
                                          temperature=1.0, seed=5,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,check", [
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     lambda t: all(isinstance(x, int) for x in json.loads(t))),
    ({"guided_regex": r"[a-c]{2}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{2}", t)),
    ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
    ({"guided_grammar": 'root ::= "x" [0-9] "y"'}, lambda t: re.fullmatch(r"x[0-9]y", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
])
def test_vllm_fields_on_completions_and_chat(client, extra, check):
    resp = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60,
                                     temperature=1.0, seed=1, n=2, extra_body=extra)
    for choice in resp.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                          temperature=0, extra_body=extra)
    assert check(chat.choices[0].message.content)


@pytest.mark.parametrize("extra,field", [
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "after_token_ids": [10**20]}},
     "structured_outputs"),  # (the server's own field)
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_400_naming_the_field(server, extra, field):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    resp = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert "/" not in error["message"].replace("json_schema", "")  # (no source paths)
    ok = httpx.post(server + "/v1/chat/completions",
                    json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_a_grammar_slow_to_compile_is_refused_in_bounded_time(tiny_models):
    """The check gives up after its timeout (a compile that never ends here), naming the
    field; once that compile ends, checks work again."""
    from tokenmill.loading.checkpoint import load_tokenizer

    checker = GrammarChecker(load_tokenizer(tiny_models("llama")[0]), 512, [1],
                             timeout_s=0.2)
    release, real = threading.Event(), checker._compile
    checker._compile = lambda params: release.wait(30) and real(params)
    params = StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidParameter, match="did not compile within 0.2 s") as info:
        asyncio.run(checker.check(params, "guided_regex"))
    assert info.value.param == "guided_regex"
    release.set()
    asyncio.run(checker.check(params, "guided_regex"))  # compiles now


def test_triton_generate_guides_and_native_response_format(server):
    generate = server + "/v2/models/ensemble/generate"
    base = {"text_input": "Say:", "max_tokens": 400, "temperature": 1.0,
            "exclude_input_in_output": True, "seed": 3}
    schema = Person.model_json_schema()
    for extra, check in (
            ({"guided_json": schema}, Person.model_validate_json),
            ({"guided_json": json.dumps(schema)}, Person.model_validate_json),
            ({"guided_decoding_guide_type": "json_schema",
              "guided_decoding_guide": json.dumps(schema)}, Person.model_validate_json),
            # (any object: its free strings may outrun max_tokens from random weights; the
            # object grammar itself is checked to the end offline)
            ({"guided_decoding_guide_type": "json"}, lambda t: t.startswith("{")),
            ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[xyz]{3}"},
             lambda t: re.fullmatch("[xyz]{3}", t)),
            ({"guided_decoding_guide_type": "ebnf_grammar",
              "guided_decoding_guide": 'root ::= "a" | "bb"'}, lambda t: t in ("a", "bb"))):
        resp = httpx.post(generate, json={**base, **extra}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert check(resp.json()["text_output"]), (extra, resp.json()["text_output"])
    for extra, fragment in (({"guided_json": {"type": "nonsense"}}, "guided_json"),
                            ({"guided_decoding_guide_type": "structural_tag",
                              "guided_decoding_guide": "{}"}, "guided_decoding_guide_type"),
                            ({"guided_decoding_guide_type": "regex"}, "guided_decoding_guide")):
        resp = httpx.post(generate, json={**base, **extra}, timeout=60)
        assert resp.status_code == 400 and fragment in resp.json()["error"], resp.text
    native = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "text": "Describe a person.", "max_dec_len": 200, "temperature": 1.0, "seed": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                   "schema": schema}}})
    assert native.status_code == 200, native.text
    Person.model_validate_json(native.json()["result"])
    bad = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "text": "x", "response_format": {"type": "yaml"}})
    assert bad.status_code == 400 and "response_format" in bad.text


def test_short_constraints_never_wait_behind_long_ones_and_given_up_ones_never_run(
        tiny_models):
    """Two long schemas compiling (held here until released) leave a `choice` and a short
    regex compiling at once on their own lane; a long one whose check timed out before its
    compile started is cancelled and never compiles."""
    from tokenmill.loading.checkpoint import load_tokenizer

    checker = GrammarChecker(load_tokenizer(tiny_models("llama")[0]), 512, [1],
                             timeout_s=0.5)
    release, real, compiled = threading.Event(), checker._compile, []

    def held(params):
        if len(params.key()[1]) > 1024:
            release.wait(30)
        compiled.append(params.key()[1][:20])
        return real(params)

    checker._compile = held
    long = [StructuredOutputsParams(json={"type": "object", "description": str(i) * 1100})
            for i in range(2)]

    async def scenario():
        heavy = [asyncio.create_task(checker.check(p, "guided_json")) for p in long]
        await asyncio.sleep(0.05)
        await checker.check(StructuredOutputsParams(choice=["yes", "no"]), "guided_choice")
        await checker.check(StructuredOutputsParams(regex="[0-9]{3}"), "guided_regex")
        light_done = len(compiled)
        results = await asyncio.gather(*heavy, return_exceptions=True)
        return light_done, results

    light_done, results = asyncio.run(scenario())
    assert light_done == 2  # both short ones, while the long lane was held
    assert all(isinstance(r, InvalidParameter) and "within 0.5 s" in str(r) for r in results)
    release.set()
    checker._lanes.shutdown()
    checker._lanes._heavy.shutdown(wait=True)
    assert len(compiled) == 3  # the second long one was cancelled before it started


@pytest.mark.parametrize("field,value,fragment", [
    ("guided_regex", "((a{0,100}){0,100}){0,100}", "multiply to 1000000"),
    ("guided_json", {"type": "object", "properties": {"a": {
        "type": "string", "pattern": "(x{0,200}){0,200}"}}}, "multiply to 40000"),
    ("guided_json", "[" * 150 + "]" * 150, "more than 128 levels deep"),
])
def test_constraints_past_the_bounds_are_refused_at_once(server, field, value, fragment):
    """Six of the hostile pass's 120-byte regexes froze the engine for minutes: now each is
    a 400 naming the field before anything compiles, and a bystander is served."""
    import concurrent.futures

    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 32, field: value}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: httpx.post(
            server + "/v1/chat/completions", json=body, timeout=60), range(6)))
    for resp in answers:
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == field and fragment in error["message"], error
    ok = httpx.post(server + "/v1/chat/completions",
                    json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
