"""Reasoning parsers (`--reasoning-parser`): a chat completion's text split into
`reasoning_content` (the thinking section) and `content`, whole or as stream deltas.

- `deepseek_r1`: DeepSeek-R1's template opens the think section in the prompt, so the output
  may start inside it: everything before `</think>` is reasoning (a leading `<think>`
  dropped); with no `</think>` yet (still thinking, or cut off) it is all reasoning.
- `qwen3`, `glm45` (GLM-4.5 / 4.6): reasoning only when the output opens with `<think>`
  (they think unless `enable_thinking` is false); otherwise all content.
- `granite` (Granite 3.2+ with `thinking`): the same, its section opened by "Here is my
  thought process:" (or "Here's ...") and closed by "Here is my response:" (or "Here's
  ..."): plain text, not tokens.
- `gpt_oss`: harmony's `analysis` channel (parsers/harmony.py), streamed by splitting the
  text so far again at each piece.
While streaming, text that may be the start of a tag is held back until it is known not to be
one, so no delta ever has to be taken back."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.entrypoints.parsers import harmony


@dataclass(frozen=True)
class ReasoningFormat:
    starts: tuple[str, ...]  # what opens the section (any of them)
    ends: tuple[str, ...]  # what closes it
    opened_by_prompt: bool  # the output may start inside the section (no opening tag)
    tokens: bool  # the tags are tokens of the model's vocabulary


_THINK = (("<think>",), ("</think>",))
FORMATS = {
    "deepseek_r1": ReasoningFormat(*_THINK, opened_by_prompt=True, tokens=True),
    "qwen3": ReasoningFormat(*_THINK, opened_by_prompt=False, tokens=True),
    "glm45": ReasoningFormat(*_THINK, opened_by_prompt=False, tokens=True),
    "granite": ReasoningFormat(("Here is my thought process:", "Here's my thought process:"),
                               ("Here is my response:", "Here's my response:"),
                               opened_by_prompt=False, tokens=False),
    # (harmony: the tags are several tokens; split by parsers/harmony.py, the markers
    # checked one by one; a constraint starts with the final channel's body)
    "gpt_oss": ReasoningFormat(("<|channel|>analysis<|message|>",),
                               ("<|channel|>final<|message|>",),
                               opened_by_prompt=False, tokens=True),
}
PARSERS = tuple(FORMATS)
START, END = "<think>", "</think>"


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(len(tag) > n and text.endswith(tag[:n]) for tag in tags):
            return n
    return 0


def _find(text: str, tags: tuple[str, ...]) -> tuple[int, int]:
    """(where the first of `tags` in `text` starts, its length); (-1, 0) if none is."""
    found = [(i, len(tag)) for tag in tags if (i := text.find(tag)) >= 0]
    return min(found) if found else (-1, 0)


def _opening(head: str, starts: tuple[str, ...]) -> int | None:
    """The opening tag's length if `head` starts with one; None while `head` may still
    become one (a proper prefix); 0 when it cannot."""
    for tag in starts:
        if head.startswith(tag):
            return len(tag)
    return None if any(tag.startswith(head) for tag in starts) else 0


class ReasoningParser:
    def __init__(self, name: str, tokenizer=None) -> None:
        """`tokenizer`: the served model's, checked to have the markers (a server's parser);
        None for splitting text alone."""
        if name not in FORMATS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, "
                             f"got {name!r}.")
        self.name, self.format = name, FORMATS[name]
        self.harmony = name == "gpt_oss"  # (its markers are special tokens: kept in text)
        if tokenizer is not None:
            check_markers(name, tokenizer)

    def stream(self) -> ReasoningStream | WholeTextReasoningStream:
        """One streamed choice's splitter."""
        return WholeTextReasoningStream(self) if self.harmony else ReasoningStream(self)

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text`; not `final`: without what may still become a
        tag."""
        if self.harmony:
            return harmony.split(text, final)
        fmt = self.format
        head = text.lstrip()
        opened = _opening(head, fmt.starts)
        if opened is None:
            if not final:
                return "", ""  # (maybe the opening tag, not yet whole)
            opened = 0
        if not opened and not fmt.opened_by_prompt:
            return "", text
        body = head[opened:] if opened else text
        end, length = _find(body, fmt.ends)
        if end >= 0:
            return body[:end], body[end + length:]
        if not final:
            body = body[:len(body) - _partial_suffix(body, fmt.ends)]
        return body, ""


def check_markers(name: str, tokenizer) -> None:
    """A reasoning parser whose tags are tokens needs them in the model's vocabulary: a
    structured-output constraint starts after the end tag's token, and a model that has no
    such token never writes it, so its constraints would never start (free text where a
    schema was asked for). Refused at start-up, naming what is missing, as vLLM does."""
    fmt = FORMATS[name]
    if not fmt.tokens:
        return
    vocab = tokenizer.get_vocab()
    tags = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>") if name == "gpt_oss" \
        else (*fmt.starts, *fmt.ends)
    missing = [tag for tag in tags if tag not in vocab
               or tokenizer.encode(tag, add_special_tokens=False) != [vocab[tag]]]
    if missing:
        raise ValueError(f"--reasoning-parser {name} needs a model whose vocabulary has "
                         f"{' and '.join(tags)} as tokens; this model's has no "
                         f"{' or '.join(missing)} token (leave the flag out for it).")


def _find_last(tokens: list[int], part: list[int]) -> int:
    """Start of the last occurrence of `part` in `tokens`, or -1."""
    for i in range(len(tokens) - len(part), -1, -1):
        if tokens[i:i + len(part)] == part:
            return i
    return -1


def constraint_start(tokenizer, prompt_ids: list[int],
                     fmt: ReasoningFormat = FORMATS["deepseek_r1"]) -> list[int] | None:
    """The tokens after which a structured-output constraint starts: the end tag's (the
    first of a format's spellings), unless the prompt already closed the section (e.g.
    Qwen3's enable_thinking=false)."""
    end = tokenizer.encode(fmt.ends[0], add_special_tokens=False)
    if fmt is FORMATS["gpt_oss"]:  # (earlier turns' final channels are in the prompt)
        return end
    start = tokenizer.encode(fmt.starts[0], add_special_tokens=False)
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
        fmt = self.parser.format
        if self.thinking is None:
            self.opening += delta
            head = self.opening.lstrip()
            opened = _opening(head, fmt.starts)
            if opened is None and not done:
                return "", ""  # (maybe the opening tag, not yet whole)
            opened = opened or 0
            self.thinking = bool(opened) or fmt.opened_by_prompt
            delta = head[opened:] if opened else self.opening
            self.opening = ""
        if not self.thinking:
            return "", delta
        text = self.pending + delta
        end, length = _find(text, fmt.ends)
        if end >= 0:
            self.thinking, self.pending = False, ""
            return text[:end], text[end + length:]
        keep = 0 if done else _partial_suffix(text, fmt.ends)
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
