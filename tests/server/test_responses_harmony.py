"""gpt-oss' harmony through the Responses API's items (`--reasoning-parser gpt_oss
--tool-call-parser openai`): a recorded answer's analysis channel becomes a reasoning item,
its commentary text a message, its `to=functions.*` call a function_call item; streamed in
any chunking, the events' items equal the whole answer's."""

import json
import random

import pytest

from tokenmill.entrypoints.api.responses_protocol import output_items
from tokenmill.entrypoints.http.chat_output import ChatOutput
from tokenmill.entrypoints.http.responses_api import _Items
from tokenmill.entrypoints.parsers.reasoning import ReasoningParser
from tokenmill.entrypoints.parsers.tool_registry import get_parser
from tokenmill.entrypoints.parsers.tool_request import ToolPlan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# as gpt-oss writes them (special tokens kept; the stop token, <|call|> or <|return|>, not)
ANSWERS = {
    "call": ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
             "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
             "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             '{"city": "Paris"}',
             [("reasoning", "Need the weather."), ("message", "Checking."),
              ("function_call", ("get_weather", {"city": "Paris"}))]),
    "final": ("<|channel|>analysis<|message|>User asks 2 + 2.<|end|><|start|>assistant"
              "<|channel|>final<|message|>2 + 2 = 4.",
              [("reasoning", "User asks 2 + 2."), ("message", "2 + 2 = 4.")]),
}


def _output() -> ChatOutput:
    return ChatOutput(ReasoningParser("gpt_oss"), ToolPlan("auto", [WEATHER]),
                      get_parser("openai"))


def _summary(items: list[dict]) -> list[tuple]:
    out = []
    for item in items:
        if item["type"] == "reasoning":
            out.append(("reasoning", item["content"][0]["text"]))
        elif item["type"] == "message":
            out.append(("message", item["content"][0]["text"]))
        else:
            out.append(("function_call", (item["name"], json.loads(item["arguments"]))))
    return out


@pytest.mark.parametrize("name", list(ANSWERS))
def test_harmony_answers_become_reasoning_message_and_call_items(name):
    text, want = ANSWERS[name]
    message, _ = _output().message(text)
    assert _summary(output_items(message)) == want
    rng = random.Random(name)
    chunkings = [list(text)]  # a character at a time, and random cuts
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in chunkings:
        deltas, items = _output().stream(), _Items()
        for i, piece in enumerate(pieces):
            items.feed(deltas.feed(piece, i == len(pieces) - 1) or {})
        items.close()
        assert _summary(items.done) == want, pieces
