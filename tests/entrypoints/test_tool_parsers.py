"""Tool-call parsers on outputs in each model family's format (as their chat templates and
model cards show them), malformed ones included: whole parses give the expected calls, text
that is not a well-formed call comes back as content, and streaming the same text in pieces
of any size sends the same content and calls."""

import json
import random

import pytest

from tokenmill.entrypoints.parsers.tool_calls import ToolCall
from tokenmill.entrypoints.parsers.tool_registry import PARSER_NAMES, get_parser
from tokenmill.entrypoints.parsers.tool_stream import ToolCallStream, WholeTextToolCallStream

W = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
T = ToolCall("get_time", "{}")
DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
      "<｜tool▁calls▁end｜>")

# the request's tools: schemas type the tagged-text formats' values (qwen3_coder, glm45)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"},
                                              "unit": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {}}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": {
             "type": "object", "properties": {
                 "hour": {"type": "integer"}, "days": {"type": "array"},
                 "loud": {"type": "boolean"}, "volume": {"type": "number"},
                 "note": {"type": "string"}, "label": {"anyOf": [{"type": "string"},
                                                                 {"type": "null"}]},
                 "repeat": {"type": "object"}}}}}]
ALARM = ToolCall("set_alarm", json.dumps({"hour": 7, "days": ["mon", "tue"], "loud": True,
                                          "volume": 0.5, "note": '07:00 "wake"\n  up',
                                          "label": None, "repeat": {"weeks": 2}}))
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>")


def _qwen_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm_call(name: str, **params: str) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                   for k, v in params.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


HARMONY_CALL = ("<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json"
                "<|message|>{}")
ALARM_ARGS = dict(hour="7", days='["mon", "tue"]', loud="true", volume="0.5",
                  note='07:00 "wake"\n  up', label="null", repeat="{'weeks': 2}")

# (parser, model output, expected content, expected calls)
CASES = [
    ("qwen3_coder", _qwen_call("get_weather", city="Paris", unit="celsius"), None, [W]),
    ("qwen3_coder", "Let me check.\n" + _qwen_call("get_weather", city="Paris", unit="celsius")
     + "\n" + _qwen_call("get_time"), "Let me check.", [W, T]),
    ("qwen3_coder", _qwen_call("set_alarm", **ALARM_ARGS), None, [ALARM]),
    ("glm45", _glm_call("get_weather", city="Paris", unit="celsius"), None, [W]),
    ("glm45", "I'll check.\n" + _glm_call("get_weather", city="Paris", unit="celsius")
     + _glm_call("get_time"), "I'll check.", [W, T]),
    ("glm45", _glm_call("set_alarm", **ALARM_ARGS), None, [ALARM]),
    ("kimi_k2", f'{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris", "unit": '
                f'"celsius"}}{KIMI[3]}{KIMI[1]}functions.get_time:1{KIMI[2]}{{}}{KIMI[3]}'
                f'{KIMI[4]}', None,
     [ToolCall(W.name, W.arguments, "functions.get_weather:0"),
      ToolCall(T.name, T.arguments, "functions.get_time:1")]),
    ("kimi_k2", f'Checking.{KIMI[0]}{KIMI[1]}functions.get_time:0{KIMI[2]}{{}}{KIMI[3]}'
                f'{KIMI[4]}', "Checking.", [ToolCall(T.name, T.arguments, "functions.get_time:0")]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                '"celsius"}}, {"name": "get_time", "arguments": {}}]', None, [W, T]),
    ("granite", '<tool_call>[{"name": "get_time", "arguments": {}}]', None, [T]),
    ("granite", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # gpt-oss' harmony, as the gpt_oss reasoning parser leaves it (analysis taken out)
    ("openai", HARMONY_CALL.format("get_weather", '{"city": "Paris", "unit": "celsius"}'),
     None, [W]),
    ("openai", "Let me check." + HARMONY_CALL.format(
        "get_weather", '{"city":"Paris","unit":"celsius"}') + "<|call|>"
     + HARMONY_CALL.format("get_time", "{}"), "Let me check.", [W, T]),
    ("openai", "Paris is sunny.", "Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>', None, [W]),
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {}}\n</tool_call>', "Let me check.", [W, T]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>', None, [T]),
    ("hermes", "The weather in Paris is mild: 14 < 20 degrees.", "The weather in Paris is mild: "
               "14 < 20 degrees.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', None, [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"unit": "celsius"}}; {"name": "get_time", "parameters": {}}', None, [W, T]),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                '"celsius"}}, {"name": "get_time", "arguments": {}}]', None, [W, T]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
     "Checking.", [W]),
    ("deepseek_v3", f'{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{"city": "Paris", '
                    f'"unit": "celsius"}}\n```{DS[3]}{DS[1]}function{DS[2]}get_time\n```json\n'
                    f'{{}}\n```{DS[3]}{DS[4]}', None, [W, T]),
    ("deepseek_v3", f'I will look.{DS[0]}{DS[1]}get_weather{DS[2]}{{"city": "Paris", '
                    f'"unit": "celsius"}}{DS[3]}{DS[4]}', "I will look.", [W]),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time()]', None, [W, T]),
    ("pythonic", "<|python_start|>[get_time()]<|python_end|>", None, [T]),
]

# hermes: content, then two calls
HERMES_TWO = next(c[1] for c in CASES if c[0] == "hermes" and c[2] == "Let me check.")

MALFORMED = [
    ("openai", HARMONY_CALL.format("get_weather", '{"city": "Par')),  # cut off
    ("openai", HARMONY_CALL.format("get_weather", "[1, 2]")),  # not an object
    ("openai", HARMONY_CALL.replace("functions.{}", "browser.search").format("{}")),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),  # cut off
    ("qwen3_coder", "<tool_call>\nno function here\n</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    ("glm45", "<tool_call>\n<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"),
    ("glm45", "<tool_call>get_weather\nstray words\n</tool_call>"),
    ("kimi_k2", f"{KIMI[0]}{KIMI[1]}functions.get_time:0{{}}{KIMI[3]}{KIMI[4]}"),  # no args tag
    ("kimi_k2", f'{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": '),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": '),
    ("granite", '<|tool_call|>{"name": "get_time", "arguments": {}}'),  # not a list
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),  # not object
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("llama3_json", '{"name": "a", "parameters": {}} trailing words'),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {}}'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{oops}"),
    ("deepseek_v3", f"{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{\"city\":"),
    ("deepseek_v3", f"{DS[0]}{DS[1]}no separator here{DS[3]}{DS[4]}"),
    ("pythonic", '[get_weather("Paris")]'),  # positional arguments
    ("pythonic", '[__import__("os").system("true")]'),  # never evaluated
    ("pythonic", "[get_weather(city=open('/etc/passwd').read())]"),
    ("pythonic", "[" * 5000),
]


def _parser(name: str):
    return get_parser(name).for_request(TOOLS)


def _streamed(name: str, text: str, sizes: list[int]) -> tuple[str, list[ToolCall]]:
    stream, content, calls, i = ToolCallStream(_parser(name)), "", [], 0
    for size in sizes:
        piece = text[i:i + size]
        i += size
        c, new = stream.feed(piece, i >= len(text))
        content += c
        calls += new
        if i >= len(text):
            break
    return content, calls


def _chunkings(text: str):
    rng = random.Random(len(text))
    yield [len(text)]
    yield [1] * len(text)
    for _ in range(8):
        yield [rng.randint(1, 9) for _ in range(len(text))]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_outputs(case):
    name, text, content, calls = case
    assert _parser(name).parse(text) == (content, calls)
    for sizes in _chunkings(text):
        assert _streamed(name, text, sizes) == (content or "", calls), sizes


@pytest.mark.parametrize("case", MALFORMED, ids=[f"{c[0]}-{i}" for i, c in enumerate(MALFORMED)])
def test_malformed_outputs_come_back_as_content(case):
    name, text = case
    assert _parser(name).parse(text) == (text, [])
    for sizes in _chunkings(text):
        assert _streamed(name, text, sizes) == (text, [])


def test_calls_stream_as_each_completes():
    """hermes and deepseek_v3 send a call once its block closes, before the output ends."""
    text = HERMES_TWO
    stream = ToolCallStream(get_parser("hermes"))
    first_block = text.index("</tool_call>") + len("</tool_call>")
    content, calls = stream.feed(text[:first_block], False)
    assert (content, calls) == ("Let me check.", [W])
    assert stream.feed(text[first_block:], True) == ("", [T])


def test_content_that_only_looks_like_a_marker_is_sent():
    stream = ToolCallStream(get_parser("hermes"))
    assert stream.feed("a <tool", False) == ("a", [])  # (held: may open a call)
    assert stream.feed("box> b", False) == (" <toolbox> b", [])


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_stream_equals_the_whole_text_reference_piece_by_piece(name):
    """Random texts of markers, their parts, whitespace, JSON and the recorded outputs, cut
    at random: every piece's content and calls equal the reference's, which searches the
    whole text so far again each time."""
    rng = random.Random(2)
    parser = _parser(name)
    markers = [*parser.markers, *parser.leading, *DS, *KIMI, "</tool_call>", "[ARGS]",
               "<|message|>", "<|call|>", "<|constrain|>json", "<|end|>",
               "<function=get_time>", "</function>", "<parameter=city>", "</parameter>",
               "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "functions.get_time:0"]
    parts = [*markers, *(m[:len(m) // 2] for m in markers), *(m[len(m) // 2:] for m in markers),
             " ", "\n", "  \n", "text", '{"name": "get_time", "arguments": {}}', "[", "]",
             "get_time()", ";"]
    texts = [t for c in CASES + MALFORMED if c[0] == name for t in [c[1]]]
    for k in range(1500):
        text = texts[k % len(texts)] if k < 4 * len(texts) else \
            "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
            if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
        fast, slow = ToolCallStream(_parser(name)), WholeTextToolCallStream(_parser(name))
        for i, piece in enumerate(pieces):
            done = i == len(pieces) - 1
            assert fast.feed(piece, done) == slow.feed(piece, done), (text, pieces, i)


def test_unknown_parser_and_every_name_builds():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")
    assert all(get_parser(name).parse("plain text") == ("plain text", [])
               for name in PARSER_NAMES)


# --- the chat message / deltas built from a choice's text (reasoning + tools) -------------

def _accumulate(deltas: list[dict]) -> dict:
    """What the OpenAI SDK's stream accumulation makes of a choice's deltas."""
    out = {"content": None, "reasoning_content": None, "tool_calls": []}
    for d in deltas:
        for key in ("content", "reasoning_content"):
            if d.get(key):
                out[key] = (out[key] or "") + d[key]
        for call in d.get("tool_calls", []):
            if call["index"] == len(out["tool_calls"]):
                assert call["id"] and call["type"] == "function" and call["function"]["name"]
                out["tool_calls"].append({"id": call["id"], "name": call["function"]["name"],
                                          "arguments": ""})
            else:
                assert "id" not in call and "name" not in call["function"]
            out["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return out


def _plan(mode, parallel=True):
    from tokenmill.entrypoints.parsers.tool_request import ToolPlan

    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    return ToolPlan(mode, tools, "get_weather" if mode == "named" else None, parallel)


@pytest.mark.parametrize("mode, text, calls, content", [
    ("auto", "<think>which tool?</think>Sure.\n" + HERMES_TWO[len("Let me check.\n\n"):],
     [W, T], "Sure."),
    ("auto", "<think>no tool</think>Just text.", [], "Just text."),
    ("required", '<think>x</think>[{"name": "get_time", "parameters": {}}]', [T], None),
    ("required", '<think>x</think>[{"name": "get_time", "param', [], '[{"name": "get_time", '
                 '"param'),  # (cut off by max_tokens)
    ("named", '<think>x</think>{"city": "Paris", "unit": "celsius"}',
     [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')], None),
])
def test_chat_output_whole_and_streamed(mode, text, calls, content):
    from tokenmill.entrypoints.http.chat_output import ChatOutput
    from tokenmill.entrypoints.parsers.reasoning import ReasoningParser

    out = ChatOutput(ReasoningParser("deepseek_r1"), _plan(mode), get_parser("hermes"))
    message, has_calls = out.message(text)
    assert message["reasoning_content"] == text[len("<think>"):text.index("</think>")]
    assert message["content"] == content and has_calls == bool(calls)
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls", [])]
    assert got == [(c.name, c.arguments) for c in calls]
    for sizes in _chunkings(text):
        stream, deltas, i = out.stream(), [], 0
        for size in sizes:
            i += size
            delta = stream.feed(text[i - size:i], i >= len(text))
            deltas.append(delta or {})
            if i >= len(text):
                break
        acc = _accumulate(deltas)
        assert acc["reasoning_content"] == message["reasoning_content"]
        assert acc["content"] == content
        streamed = [(c["name"], c["arguments"]) for c in acc["tool_calls"]]
        if mode == "named":  # (arguments streamed as written)
            streamed = [(n, json.dumps(json.loads(a))) for n, a in streamed]
        assert streamed == got and stream.has_calls() == has_calls


def test_one_call_unless_parallel():
    from tokenmill.entrypoints.http.chat_output import ChatOutput

    out = ChatOutput(None, _plan("auto", parallel=False), get_parser("hermes"))
    message, _ = out.message(HERMES_TWO)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    stream = out.stream()
    deltas = [stream.feed(HERMES_TWO[:60], False), stream.feed(HERMES_TWO[60:], True)]
    assert len(_accumulate([d or {} for d in deltas])["tool_calls"]) == 1


def test_markers_that_are_special_tokens_are_noted(tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: `auto` then keeps special tokens in the
    text, or the parser would never see it; hermes' markers are plain text here."""
    from helpers import make_tokenizer

    tok = make_tokenizer(str(tmp_path))
    assert not get_parser("mistral").bind(tok).special_markers
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    assert get_parser("mistral").bind(tok).special_markers
    assert not get_parser("hermes").bind(tok).special_markers
    ids = tok.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == ""  # (why it matters)


def test_the_parser_a_chat_template_names():
    """A template's tool-call format picks the parser only where exactly one is named."""
    from tokenmill.entrypoints.parsers.tool_registry import parser_for_template

    hermes = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n{{ call }}</tool_call>"
    assert parser_for_template(hermes) == "hermes"
    assert parser_for_template({"default": "{{ m }}", "tool_use": hermes}) == "hermes"
    assert parser_for_template("{{ bos }}[TOOL_CALLS]{{ calls | tojson }}") == "mistral"
    assert parser_for_template("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>") == "deepseek_v3"
    assert parser_for_template("Given the following functions, please respond with a JSON "
                               "for a function call with its proper arguments") == "llama3_json"
    for none in (None, "", "{{ messages }}", "[{{ name }}({{ args }})]",
                 "<tool_call>{{ a }}</tool_call>[TOOL_CALLS]"):
        assert parser_for_template(none) is None, none


@pytest.mark.parametrize("name", ["kimi_k2", "qwen3_coder"])
def test_chat_output_reads_the_requests_tools_and_keeps_the_models_ids(name):
    """A request's tool schemas reach the parser (qwen3_coder's typed values); Kimi K2's
    own call ids are the calls' ids, whole and streamed (its template reads them back)."""
    from tokenmill.entrypoints.http.chat_output import ChatOutput
    from tokenmill.entrypoints.parsers.tool_request import ToolPlan

    text, expected = next((c[1], c[3]) for c in CASES if c[0] == name and c[2] is None
                          and len(c[3]) == (2 if name == "kimi_k2" else 1)
                          and (name == "kimi_k2" or c[3] == [ALARM]))
    out = ChatOutput(None, ToolPlan("auto", TOOLS), get_parser(name))
    message, has_calls = out.message(text)
    got = [(c["id"], c["function"]["name"], c["function"]["arguments"])
           for c in message["tool_calls"]]
    assert has_calls and [(n, a) for _, n, a in got] == [(c.name, c.arguments) for c in expected]
    if name == "kimi_k2":
        assert [i for i, _, _ in got] == [c.id for c in expected]
    stream = out.stream()
    deltas = [d for d in (stream.feed(text[:40], False), stream.feed(text[40:], True)) if d]
    streamed = _accumulate(deltas)["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments)
                                                               for c in expected]
    if name == "kimi_k2":
        assert [c["id"] for c in streamed] == [c.id for c in expected]


def test_templates_of_the_tagged_formats_pick_their_parser():
    from tokenmill.entrypoints.parsers.tool_registry import parser_for_template

    qwen = "{% for t in tools %}<tool_call>\n<function={{ t.name }}>\n<parameter=x>{% endfor %}"
    glm = "<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>"
    assert parser_for_template(qwen) == "qwen3_coder"
    assert parser_for_template(glm) == "glm45"
    assert parser_for_template("<tool_call>\n{{ call | tojson }}\n</tool_call>") == "hermes"
    assert parser_for_template("<|tool_calls_section_begin|>") == "kimi_k2"


def test_gpt_oss_harmony_whole_and_streamed():
    """gpt-oss with `--reasoning-parser gpt_oss --tool-call-parser openai`: the analysis
    channel is reasoning_content, a preamble is content, the message to a function a tool
    call; streamed in any chunking, what the OpenAI SDK accumulates is the same message."""
    from tokenmill.entrypoints.http.chat_output import ChatOutput
    from tokenmill.entrypoints.parsers.reasoning import ReasoningParser
    from tokenmill.entrypoints.parsers.tool_request import ToolPlan

    text = ("<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>"
            "assistant<|channel|>commentary<|message|>Checking.<|end|>"
            + HARMONY_CALL.format("get_weather", '{"city": "Paris", "unit": "celsius"}'))
    out = ChatOutput(ReasoningParser("gpt_oss"), ToolPlan("auto", TOOLS), get_parser("openai"))
    message, has_calls = out.message(text)
    assert has_calls and message["reasoning_content"] == "Need the weather in Paris."
    assert message["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == [(W.name, W.arguments)]
    for sizes in _chunkings(text):
        stream, deltas, i = out.stream(), [], 0
        for size in sizes:
            i += size
            delta = stream.feed(text[i - size:i], i >= len(text))
            if delta:
                deltas.append(delta)
            if i >= len(text):
                break
        got = _accumulate(deltas)
        assert got["reasoning_content"] == message["reasoning_content"]
        assert got["content"] == "Checking."
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [(W.name,
                                                                            W.arguments)]
