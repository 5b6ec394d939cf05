"""Anthropic's Messages API through the real `anthropic` SDK, unchanged (its base URL pointed
at the server): each answer equal to the OpenAI chat route's for the same conversation
(greedy), streamed events that the SDK accumulates into the same message, tool_use and
tool_result blocks through a Hermes-style template, count_tokens, `x-api-key`, and errors in
Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.serving import service_over_engine

TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string",
                                                         "pattern": "^[A-Z]{3}$"}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [{"name": "get_time", "description": "The time in a zone.",
          "input_schema": TIME_SCHEMA}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.", "parameters": TIME_SCHEMA}}]
TURNS = [{"role": "user", "content": "Hello there"},
         {"role": "assistant", "content": "Hi! How can I help?"},
         {"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}]
KEY = "sk-ant-test"


@pytest.fixture(scope="module")
def thread(tool_model):
    with service_over_engine(tool_model[0], tool_call_parser="hermes", max_dec_len=256,
                             api_key=KEY) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(thread):
    return anthropic.Anthropic(base_url=thread.base, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(thread):
    return openai.OpenAI(base_url=thread.base + "/v1", api_key=KEY, max_retries=0)


def _openai_messages(system, turns):
    out = [{"role": "system", "content": system}]
    for t in turns:
        content = t["content"]
        out.append({"role": t["role"], "content": content if isinstance(content, str)
                    else "".join(b["text"] for b in content)})
    return out


def test_text_equals_the_chat_route(client, chat):
    got = client.messages.create(model="tiny", system="Be brief.", messages=TURNS,
                                 max_tokens=12, extra_body={"temperature": 0})
    want = chat.chat.completions.create(model="tiny", messages=_openai_messages(
        "Be brief.", TURNS), max_tokens=12, temperature=0)
    assert got.type == "message" and got.role == "assistant" and got.model == "tiny"
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == 12
    assert client.messages.count_tokens(model="tiny", system="Be brief.",
                                        messages=TURNS).input_tokens == got.usage.input_tokens


def test_stop_sequences(client):
    greedy = {"temperature": 0}
    free = client.messages.create(model="tiny", messages=TURNS, max_tokens=24,
                                  extra_body=greedy)
    text = free.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    got = client.messages.create(model="tiny", messages=TURNS, max_tokens=24,
                                 extra_body=greedy, stop_sequences=[stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    assert got.content[0].text == text[:text.index(stop)]


def test_streamed_events_accumulate_to_the_whole_message(client):
    args = dict(model="tiny", system="Be brief.", messages=TURNS, max_tokens=16,
                extra_body={"temperature": 0})
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "message_delta" in kinds and kinds.count("text") >= 2  # (really incremental)
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 16


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_time"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_tool_use(client, chat, choice):
    """A forced tool (by name, or any): a tool_use block whose input follows the tool's
    schema, as the chat route's call for the same request; streamed alike."""
    args = dict(model="tiny", messages=[{"role": "user", "content": "Time in Paris?"}],
                tools=TOOLS, tool_choice=choice, max_tokens=120,
                extra_body={"temperature": 0})
    got = client.messages.create(**args)
    uses = [b for b in got.content if b.type == "tool_use"]
    assert got.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_time" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, TIME_SCHEMA)
    openai_choice = {"type": "function", "function": {"name": "get_time"}} \
        if choice["type"] == "tool" else "required"
    want = chat.chat.completions.create(
        model="tiny", messages=args["messages"], tools=OPENAI_TOOLS, tool_choice=openai_choice,
        parallel_tool_calls=choice["type"] == "tool", max_tokens=120,
        temperature=0).choices[0].message.tool_calls[0]
    assert uses[0].input == json.loads(want.function.arguments)
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses]


def test_tool_result_history_renders_as_the_chat_route(client, chat):
    """A turn with tool_use, then its tool_result: the model sees what the chat route's
    tool_calls / tool messages give it (greedy answers equal)."""
    history = [{"role": "user", "content": "Time in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_time",
                    "input": {"zone": "CET"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "10:00"}]}]
    got = client.messages.create(model="tiny", messages=history, tools=TOOLS, max_tokens=10,
                                 extra_body={"temperature": 0})
    want = chat.chat.completions.create(model="tiny", tools=OPENAI_TOOLS, max_tokens=10,
                                        temperature=0, messages=[
        {"role": "user", "content": "Time in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_time", "arguments": json.dumps({"zone": "CET"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "10:00"}])
    assert got.usage.input_tokens == want.usage.prompt_tokens
    text = "".join(b.text for b in got.content if b.type == "text")
    assert text == (want.choices[0].message.content or "")


def test_errors_in_anthropics_shape(thread, client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", messages=TURNS, max_tokens=4)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=thread.base, api_key="wrong", max_retries=0
                            ).messages.create(model="tiny", messages=TURNS, max_tokens=4)
    base = {"model": "tiny", "max_tokens": 4, "messages": TURNS}
    cases = [({**base, "mcp_servers": []}, "mcp_servers"),
             ({k: v for k, v in base.items() if k != "max_tokens"}, "max_tokens"),
             ({**base, "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
              "an image block needs a source"),
             ({**base, "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "x"}}]}]},
              "this model takes no images"),
             ({**base, "messages": [{"role": "user", "content": [
                 {"type": "document", "source": {}}]}]}, "document blocks are not supported"),
             ({**base, "messages": [{"role": "system", "content": "x"}]}, "role"),
             ({**base, "tool_choice": {"type": "sometimes"}, "tools": TOOLS}, "tool_choice")]
    for body, fragment in cases:
        resp = httpx.post(thread.base + "/v1/messages", json=body,
                          headers={"x-api-key": KEY}, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert fragment in error["error"]["message"], error
    broken = httpx.post(thread.base + "/v1/messages", content=b"{not json",
                        headers={"x-api-key": KEY, "content-type": "application/json"},
                        timeout=30)
    assert broken.status_code == 400 and broken.json()["type"] == "error"


def test_output_config_json_schema(client):
    """output_config.format (Anthropic's structured outputs) through the server's
    structured outputs: the text follows the schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    got = client.messages.create(model="tiny", messages=TURNS, max_tokens=60,
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": schema}})
    assert got.stop_reason == "end_turn"
    jsonschema.validate(json.loads(got.content[0].text), schema)
