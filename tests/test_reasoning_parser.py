"""Reasoning parsers: whole splits, and streamed deltas that add up to the whole split for
every way of cutting the text into pieces (tags split across pieces included)."""

import random

import pytest

from tokenmill.entrypoints.http.reasoning import ReasoningParser, ReasoningStream

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
            stream, got = ReasoningStream(parser), ["", ""]
            for k, piece in enumerate(pieces):
                r, c = stream.feed(piece, done=k == len(pieces) - 1)
                got[0] += r
                got[1] += c
            assert tuple(got) == want, (text, pieces)


def test_unknown_parser():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("nope")


def test_served_chat_splits_reasoning_whole_and_streamed(tiny_models, tmp_path):
    """`tokenmill serve --reasoning-parser deepseek_r1`: the random model's output, forced
    through a regex to hold a `</think>`, comes back split, whole and streamed alike."""
    import openai

    from tests.serving import Served

    with Served(tiny_models("llama")[0], tmp_path, "--reasoning-parser",
                "deepseek_r1").running() as served:
        client = openai.OpenAI(base_url=served.api + "/v1", api_key="x", max_retries=0)
        args = dict(model="tiny", messages=[{"role": "user", "content": "Think."}],
                    max_tokens=40, temperature=1.0, seed=3,
                    extra_body={"guided_regex": "[a-z]{2,6}</think>[a-z]{2,6}"})
        whole = client.chat.completions.create(**args).choices[0].message
        reasoning = whole.model_extra["reasoning_content"]
        assert 2 <= len(reasoning) <= 6 and reasoning.isalpha()
        assert 2 <= len(whole.content) <= 6 and whole.content.isalpha()
        got = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            got["content"] += delta.content or ""
            got["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        assert got == {"reasoning_content": reasoning, "content": whole.content}
        plain = client.chat.completions.create(**{**args, "extra_body": {}}).choices[0]
        assert plain.message.content is None  # no </think>: all of it is reasoning
        assert plain.message.model_extra["reasoning_content"]
