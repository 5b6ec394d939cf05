"""Reasoning parsers (`--reasoning-parser`): a chat completion's text split into
`reasoning_content` (the `<think>` section) and `content`, whole or as stream deltas.

- `deepseek_r1`: DeepSeek-R1's template opens the think section in the prompt, so the output
  may start inside it: everything before `</think>` is reasoning (a leading `<think>`
  dropped); with no `</think>` yet (still thinking, or cut off) it is all reasoning.
- `qwen3`: reasoning only when the output opens with `<think>` (Qwen3 thinks unless
  `enable_thinking` is false); otherwise all content.
While streaming, text that may be the start of a tag is held back until it is known not to be
one, so no delta ever has to be taken back."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, name: str, tokenizer=None) -> None:
        """`tokenizer`: the served model's, checked to have the markers (a server's parser);
        None for splitting text alone."""
        if name not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, "
                             f"got {name!r}.")
        self.name = name
        if tokenizer is not None:
            check_markers(name, tokenizer)

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text`; not `final`: without what may still become a
        tag."""
        head = text.lstrip()
        if not final and START.startswith(head) and head != START:
            return "", ""  # (maybe the opening tag, not yet whole)
        opened = head.startswith(START)
        if self.name == "qwen3" and not opened:
            return "", text
        body = head[len(START):] if opened else text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):]
        if not final:
            body = body[:len(body) - _partial_suffix(body, END)]
        return body, ""


def check_markers(name: str, tokenizer) -> None:
    """A reasoning parser needs `<think>` and `</think>` to be tokens of the model's own: a
    structured-output constraint starts after the `</think>` token, and a model that has no
    such token never writes it, so its constraints would never start (free text where a
    schema was asked for). Refused at start-up, naming what is missing, as vLLM does."""
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (START, END) if tag not in vocab
               or tokenizer.encode(tag, add_special_tokens=False) != [vocab[tag]]]
    if missing:
        raise ValueError(f"--reasoning-parser {name} needs a model whose vocabulary has "
                         f"{START} and {END} as tokens; this model's has no "
                         f"{' or '.join(missing)} token (leave the flag out for it).")


def _find_last(tokens: list[int], part: list[int]) -> int:
    """Start of the last occurrence of `part` in `tokens`, or -1."""
    for i in range(len(tokens) - len(part), -1, -1):
        if tokens[i:i + len(part)] == part:
            return i
    return -1


def constraint_start(tokenizer, prompt_ids: list[int]) -> list[int] | None:
    """The tokens after which a structured-output constraint starts: the end tag's, unless
    the prompt already closed the think section (e.g. Qwen3's enable_thinking=false)."""
    end = tokenizer.encode(END, add_special_tokens=False)
    start = tokenizer.encode(START, add_special_tokens=False)
    closed = _find_last(prompt_ids, end)
    return None if closed >= 0 and closed > _find_last(prompt_ids, start) else end


class ReasoningStream:
    """One streamed choice: each new piece of text -> (reasoning delta, content delta), the
    same as `WholeTextReasoningStream` gives, in time proportional to the piece: only the
    text that may still be (part of) a tag is kept. An R1-style think section runs to tens of
    thousands of tokens; splitting all of it again at every step cost O(length) each."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.opening = ""  # the start, while it may still be the opening tag
        self.thinking: bool | None = None  # None: not yet known
        self.pending = ""  # reasoning held back: it may be the start of the end tag

    def feed(self, delta: str, done: bool) -> tuple[str, str]:
        if self.thinking is None:
            self.opening += delta
            head = self.opening.lstrip()
            if not done and START.startswith(head) and head != START:
                return "", ""  # (maybe the opening tag, not yet whole)
            opened = head.startswith(START)
            self.thinking = opened or self.parser.name != "qwen3"
            delta = head[len(START):] if opened else self.opening
            self.opening = ""
        if not self.thinking:
            return "", delta
        text = self.pending + delta
        end = text.find(END)
        if end >= 0:
            self.thinking, self.pending = False, ""
            return text[:end], text[end + len(END):]
        keep = 0 if done else _partial_suffix(text, END)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep], ""


class WholeTextReasoningStream:
    """The reference `ReasoningStream`: the whole text so far split again at each piece."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = (0, 0)

    def feed(self, delta: str, done: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final=done)
        out = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = (max(self.sent[0], len(reasoning)), max(self.sent[1], len(content)))
        return out
