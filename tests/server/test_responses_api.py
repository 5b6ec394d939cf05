"""OpenAI's Responses API through the `openai` SDK: answers equal to the chat route's for the
same conversation (greedy), `previous_response_id` continuing a stored conversation (as the
chat route given the whole history), streamed events the SDK accumulates into the same
response, function calls and their outputs through a Hermes-style template, `text.format`
JSON schemas, retrieval and deletion, and bad requests refused in OpenAI's shape."""

import json

import jsonschema
import openai
import pytest

from tests.serving import service_over_engine

TIME = {"type": "function", "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"], "additionalProperties": False}}
CHAT_TIME = {"type": "function", "function": {k: TIME[k] for k in ("name", "description",
                                                                  "parameters")}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(tool_model):
    with service_over_engine(tool_model[0], tool_call_parser="hermes", max_dec_len=256) as thread:
        yield openai.OpenAI(base_url=thread.base + "/v1", api_key="x", max_retries=0)


def test_text_and_a_continued_conversation(client):
    first = client.responses.create(model="tiny", instructions="Be brief.", input="Hello",
                                    max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(model="tiny", max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        **GREEDY)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output_text == chat.choices[0].message.content
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == 8
    second = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input=[{"role": "user", "content": "And again?"}],
                                     max_output_tokens=8, **GREEDY)
    history = client.chat.completions.create(model="tiny", max_tokens=8, messages=[
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And again?"}], **GREEDY)
    assert second.output_text == history.choices[0].message.content
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_streamed_events_accumulate_to_the_whole_response(client):
    """A response that completes (a JSON schema ends it) through the SDK's stream helper;
    one cut by max_output_tokens as raw events, ending in response.incomplete."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}},
              "required": ["word"], "additionalProperties": False}
    args = dict(model="tiny", input="Tell me a story", max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "w", "schema": schema}},
                **GREEDY)
    whole = client.responses.create(**args)
    assert whole.status == "completed"
    with client.responses.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_text.delta") >= 2
    assert final.output_text == whole.output_text and final.status == "completed"
    cut = dict(model="tiny", input="Tell me a story", max_output_tokens=12, **GREEDY)
    events = list(client.responses.create(**cut, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == client.responses.create(**cut).output_text


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_time"}, "required"])
def test_function_calls_and_their_outputs(client, choice):
    args = dict(model="tiny", input="Time in Paris?", tools=[TIME], tool_choice=choice,
                parallel_tool_calls=False, max_output_tokens=120, **GREEDY)
    got = client.responses.create(**args)
    calls = [item for item in got.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), TIME["parameters"])
    chat_choice = {"type": "function", "function": {"name": "get_time"}} \
        if isinstance(choice, dict) else choice
    want = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time in Paris?"}],
        tools=[CHAT_TIME], tool_choice=chat_choice, parallel_tool_calls=False,
        max_tokens=120, **GREEDY).choices[0].message.tool_calls[0]
    assert calls[0].arguments == want.function.arguments
    with client.responses.stream(**args) as stream:
        streamed = [i for i in stream.get_final_response().output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    follow = client.responses.create(
        model="tiny", previous_response_id=got.id, tools=[TIME], max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "10:00"}], **GREEDY)
    history = client.chat.completions.create(model="tiny", tools=[CHAT_TIME], max_tokens=6,
                                             messages=[
        {"role": "user", "content": "Time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": calls[0].call_id, "type": "function",
             "function": {"name": "get_time", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "10:00"}], **GREEDY)
    assert follow.usage.input_tokens == history.usage.prompt_tokens
    assert follow.output_text == (history.choices[0].message.content or "")


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    got = client.responses.create(model="tiny", input="A number?", max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "n",
                                                   "schema": schema, "strict": True}})
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), schema)


@pytest.mark.parametrize("args,fragment", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "this model takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "'input_file' is not supported"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "not found"),
    ({"input": "x", "extra_body": {"frobnicate": 1}}, "Unknown parameter"),
])
def test_refusals(client, args, fragment):
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(model="tiny", max_output_tokens=4, **args)
    assert err.value.status_code in (400, 404) and fragment in err.value.message
