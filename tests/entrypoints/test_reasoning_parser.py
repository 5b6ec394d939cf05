"""Reasoning parsers: whole splits, and streamed deltas that add up to the whole split for
every way of cutting the text into pieces (tags split across pieces included)."""

import random

import pytest

from tokenmill.entrypoints.parsers.reasoning import (
    ReasoningParser,
    WholeTextReasoningStream,
)

CASES = {
    "deepseek_r1": [
        ("<think>plan it</think>\n\nThe answer.", ("plan it", "\n\nThe answer.")),
        ("plan it</think>The answer.", ("plan it", "The answer.")),  # opened by the template
        ("still thinking <", ("still thinking <", "")),
        ("no tags at all", ("no tags at all", "")),
        ("<think></think>direct", ("", "direct")),
    ],
    "qwen3": [
        ("<think>\nhmm\n</think>\n\nHi!", ("\nhmm\n", "\n\nHi!")),
        ("Hi without thinking", ("", "Hi without thinking")),
        ("<think>cut off", ("cut off", "")),
        ("<thin is not a tag", ("", "<thin is not a tag")),
    ],
    # GLM-4.5 (recorded shape: its template closes an empty section when not thinking)
    "glm45": [
        ("<think>The user wants the weather.</think>\nIt is sunny.",
         ("The user wants the weather.", "\nIt is sunny.")),
        ("\n<think></think>\nDirect answer.", ("", "\nDirect answer.")),
        ("No section at all.", ("", "No section at all.")),
        ("<think>cut off mid-thought", ("cut off mid-thought", "")),
    ],
    # gpt-oss' harmony (as its model card and openai-harmony render it; special tokens kept,
    # the stop token (<|return|>, <|call|>) not in the text)
    "gpt_oss": [
        ("<|channel|>analysis<|message|>User asks 2 + 2. Simple.<|end|><|start|>assistant"
         "<|channel|>final<|message|>2 + 2 = 4.", ("User asks 2 + 2. Simple.", "2 + 2 = 4.")),
        ("<|channel|>final<|message|>Hi there!", ("", "Hi there!")),
        ("<|channel|>analysis<|message|>still thinking", ("still thinking", "")),
        ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
         "commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
         ("Need the weather.", "Checking.<|start|>assistant<|channel|>commentary "
          "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")),
    ],
    # Granite 3.2 with thinking on: plain phrases, either spelling
    "granite": [
        ("Here is my thought process:\nAdd them.\nHere is my response:\n2 + 2 = 4.",
         ("\nAdd them.\n", "\n2 + 2 = 4.")),
        ("Here's my thought process:\nhmm\nHere's my response:\nok", ("\nhmm\n", "\nok")),
        ("Here is my thought process: still going", (" still going", "")),
        ("Plain answer, no thinking.", ("", "Plain answer, no thinking.")),
        ("Here is my answer.", ("", "Here is my answer.")),
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_whole_and_streamed_splits(name):
    parser = ReasoningParser(name)
    rng = random.Random(0)
    for text, want in CASES[name]:
        assert parser.split(text) == want
        for _ in range(30):  # random cuts, single characters included
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            stream, got = parser.stream(), ["", ""]
            for k, piece in enumerate(pieces):
                r, c = stream.feed(piece, done=k == len(pieces) - 1)
                got[0] += r
                got[1] += c
            assert tuple(got) == want, (text, pieces)


def test_harmony_streams_add_up_to_the_whole_split():
    """gpt_oss streams by splitting the text so far again: its deltas, in any chunking,
    add up to the whole text's split (nothing sent is ever taken back)."""
    parser = ReasoningParser("gpt_oss")
    rng = random.Random(4)
    parts = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>assistant", "analysis",
             "final", "commentary", " to=functions.f ", "<|constrain|>json", "<|chan", "<|e",
             "text", "{}", " ", "<|call|>"]
    for _ in range(2000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
            if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
        stream, got = parser.stream(), ["", ""]
        for k, piece in enumerate(pieces):
            r, c = stream.feed(piece, done=k == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert tuple(got) == parser.split(text), (text, pieces)


@pytest.mark.parametrize("name", list(CASES))
def test_stream_equals_the_whole_text_reference_piece_by_piece(name):
    """Texts made of tags, parts of tags and whitespace, cut at random: every piece's deltas
    equal the reference's, which splits the whole text so far again each time."""
    parser = ReasoningParser(name)
    rng = random.Random(1)
    parts = ["<think>", "</think>", "<th", "ink>", "</", "</th", "<", ">", " ", "\n", "a",
             "think", "/", "Here is my thought process:", "Here's my response:", "Here",
             "Here is my ", "Here's", "thought process:", "response:", "Here is my response",
             "<|channel|>", "<|message|>", "<|end|>", "<|start|>assistant", "analysis",
             "final", "commentary to=functions.f", "<|chan", "<|mess", "<|e"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
            if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
        fast, slow = parser.stream(), WholeTextReasoningStream(parser)
        for k, piece in enumerate(pieces):
            done = k == len(pieces) - 1
            assert fast.feed(piece, done) == slow.feed(piece, done), (text, pieces, k)


def test_unknown_parser():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, glm45, granite, gpt_oss"):
        ReasoningParser("nope")


def test_served_chat_returns_reasoning_whole_and_streamed(tiny_models, tmp_path):
    """`tokenmill serve --reasoning-parser deepseek_r1`: the random model never closes its
    think section, so its whole output is reasoning_content (content null), whole and
    streamed alike; a constraint waits for the section's end (so it does not apply here)."""
    import openai

    from tests.serving import Served, with_think_tokens

    path = with_think_tokens(tiny_models("llama")[0], tmp_path / "r1")
    with Served(path, tmp_path, "--reasoning-parser", "deepseek_r1").running() as served:
        client = openai.OpenAI(base_url=served.api + "/v1", api_key="x", max_retries=0)
        args = dict(model="tiny", messages=[{"role": "user", "content": "Think."}],
                    max_tokens=20, temperature=0)
        whole = client.chat.completions.create(**args).choices[0].message
        assert whole.content is None and whole.model_extra["reasoning_content"]
        got = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            got["content"] += delta.content or ""
            got["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        assert got == {"reasoning_content": whole.model_extra["reasoning_content"],
                       "content": ""}
        regex = client.chat.completions.create(**args, extra_body={"guided_regex": "[0-9]+"})
        assert regex.choices[0].message.model_extra["reasoning_content"] == \
            whole.model_extra["reasoning_content"]  # (untouched before </think>)


def test_the_constraint_starts_after_the_think_section(tiny_models):
    from tokenmill.entrypoints.parsers.reasoning import constraint_start
    from tokenmill.loading.checkpoint import load_tokenizer

    tok = load_tokenizer(tiny_models("llama")[0])
    end = tok.encode("</think>", add_special_tokens=False)
    opened = tok.encode("user: hi\nassistant:<think>\n", add_special_tokens=False)
    closed = tok.encode("user: hi\nassistant:<think>\n\n</think>\n\n", add_special_tokens=False)
    assert constraint_start(tok, opened) == end
    assert constraint_start(tok, tok.encode("user: hi", add_special_tokens=False)) == end
    assert constraint_start(tok, closed) is None  # (e.g. Qwen3 with enable_thinking=false)
