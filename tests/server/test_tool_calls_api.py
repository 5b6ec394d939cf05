"""Tool calling over HTTP with the real `openai` SDK, on the tiny random model behind a
Hermes-style chat template (as Qwen 2.5's): `tool_choice` auto (the server's hermes parser;
a regex constraint makes the random model write a call), required and a named function
(enforced by grammar), whole and streamed through the SDK's stream helper, which must
accumulate the same calls; tools and the tool-call history rendered by the template; bad
requests refused naming the field."""

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# what auto mode gets the random model to write: content, then one hermes call
CALL_REGEX = (r'[a-z]{1,6}\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "[A-Z][a-z]{1,5}", "unit": "celsius"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def client(tool_model):
    from tests.serving import service_over_engine

    with service_over_engine(tool_model[0], tool_call_parser="hermes", max_dec_len=256) as thread:
        yield openai.OpenAI(base_url=thread.base + "/v1", api_key="x", max_retries=0)


def _streamed(client, **args):
    """The SDK's stream helper's accumulated completion."""
    with client.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []]


def test_auto_reads_the_call_the_model_writes(client):
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0,
                extra_body={"guided_regex": CALL_REGEX})
    for seed in range(3):
        whole = client.chat.completions.create(**args, seed=seed).choices[0]
        assert whole.finish_reason == "tool_calls"
        [(name, arguments)] = _calls(whole.message)
        assert name == "get_weather" and arguments["unit"] == "celsius"
        assert whole.message.content and "<tool_call>" not in whole.message.content
        assert whole.message.tool_calls[0].id.startswith("call_")
        streamed = _streamed(client, **args, seed=seed).choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert _calls(streamed.message) == _calls(whole.message)
        assert streamed.message.content == whole.message.content


def test_auto_without_a_call_is_content(client):
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**args).choices[0]
    assert not whole.message.tool_calls and whole.finish_reason == "length"
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                           temperature=0, tool_choice="none", tools=TOOLS)
    assert plain.choices[0].message.content == whole.message.content


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_follow_the_tools_schemas(client, parallel):
    """Random weights may list calls past max_tokens (parallel): that cut-off list comes back
    as content; every list that ends is calls following the tools' schemas. Seeds are tried
    until two lists have ended (and, with parallel calls, one held several): at temperature 1
    a random-weight model ends a parallel list in roughly one draw of four."""
    counts = []
    for seed in range(40):
        if len(counts) >= 2 and (max(counts) > 1 or not parallel):
            break
        args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=parallel, max_tokens=300, temperature=1.0, seed=seed)
        whole = client.chat.completions.create(**args).choices[0]
        if whole.finish_reason == "length":  # (the SDK's stream helper raises on length)
            assert parallel and not whole.message.tool_calls
            assert whole.message.content.startswith('[{"name": "get_')
            chunks = client.chat.completions.create(**args, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices) == whole.message.content
            continue
        streamed = _streamed(client, **args).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        calls = _calls(whole.message)
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        assert _calls(streamed.message) == calls and streamed.finish_reason == "tool_calls"
        counts.append(len(calls))
    assert len(counts) >= 2 and min(counts) >= 1
    assert max(counts) > 1 if parallel else max(counts) == 1


def test_named_function_streams_its_arguments(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                    max_tokens=200, temperature=1.0, seed=seed)
        whole = client.chat.completions.create(**args).choices[0]
        [(name, arguments)] = _calls(whole.message)
        assert name == "get_time" and whole.finish_reason == "stop"
        jsonschema.validate(arguments, SCHEMAS["get_time"])
        pieces = []
        for chunk in client.chat.completions.create(**args, stream=True):
            for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                pieces.append(call)
        assert pieces[0].id and pieces[0].function.name == "get_time"
        assert all(p.index == 0 and p.id is None for p in pieces[1:])
        assert len(pieces) > 1  # (the arguments arrive piece by piece)
        assert json.loads("".join(p.function.arguments for p in pieces)) == arguments
        assert _calls(_streamed(client, **args).choices[0].message) == [(name, arguments)]


def test_tools_and_tool_history_reach_the_template(client, tool_model):
    """The prompt the server renders has exactly the tokens transformers' template gives."""
    resp = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert resp.usage.prompt_tokens == len(_reference_ids(tool_model[1], HISTORY))


HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "14 degrees"}]


def _reference_ids(tok, history) -> list[int]:
    """transformers' rendering, with the call's arguments as an object (as templates take
    them)."""
    reference = [dict(m) for m in history]
    reference[1] = {**reference[1], "content": "", "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    text = tok.apply_chat_template(reference, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert '"arguments": {"city": "Paris"' in text and "get_time" in text
    return tok(text, add_special_tokens=False)["input_ids"]


def test_offline_chat_renders_tools(tool_model):
    from tokenmill import LLM, SamplingParams

    history = HISTORY
    with LLM(tool_model[0], kv_cache_memory_gib=0.02) as llm:
        out = llm.chat(history, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS)
    assert out[0].prompt_token_ids == _reference_ids(tool_model[1], history)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"type": "function",
      "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES,
                                          "max_tokens": 4, **body})
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_the_parser_is_chosen_from_the_template_else_auto_needs_one(tool_model, tmp_path):
    """No --tool-call-parser: the template's <tool_call> format picks hermes, and auto reads
    the call; a template whose tool-call format names no parser leaves auto refused."""
    import shutil

    from tests.serving import service_over_engine

    with service_over_engine(tool_model[0], max_dec_len=256) as thread:  # (no parser flag)
        chosen = openai.OpenAI(base_url=thread.base + "/v1", api_key="x", max_retries=0)
        whole = chosen.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0,
            seed=0, extra_body={"guided_regex": CALL_REGEX}).choices[0]
        assert whole.finish_reason == "tool_calls"
        assert _calls(whole.message)[0][0] == "get_weather"
    path = str(tmp_path / "unnamed")
    shutil.copytree(tool_model[0], path)
    tok = tool_model[1]
    tok.chat_template = TEMPLATE.replace("<tool_call>", "<call>").replace("</tool_call>",
                                                                          "</call>")
    tok.save_pretrained(path)
    tok.chat_template = TEMPLATE
    with service_over_engine(path, max_dec_len=256) as thread:
        plain = openai.OpenAI(base_url=thread.base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
            plain.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          max_tokens=4)
        # none and required need no parser
        out = plain.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=256, seed=1)
        assert out.choices[0].message.tool_calls, out


@pytest.mark.parametrize("choice", ["none", "required"])
def test_tools_the_chat_template_cannot_render_are_refused_not_dropped(server, choice):
    """The shared server's model has a chat template without a tools block: the tools would
    never reach the model, so the request is refused, naming the cause and the flag."""
    plain = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                      tool_choice=choice, max_tokens=4)
    assert info.value.body["param"] == "tools", info.value.body
    assert "does not render tools" in info.value.body["message"]
    assert "--chat-template" in info.value.body["message"]
