"""gpt-oss' harmony format, read from the output text (special tokens kept): messages
`[<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FORMAT]
<|message|>BODY` ending in `<|end|>`, `<|call|>` or `<|return|>` (or the output's end; the
first one's `<|start|>assistant` is the prompt's).

- reasoning (`--reasoning-parser gpt_oss`): the `analysis` channel's bodies; the `final`
  channel's bodies and recipient-less `commentary` (preambles) are content; a message to a
  recipient (a tool call) stays in the content as written, for the tool parser;
- tool calls (`--tool-call-parser openai`): messages to `functions.NAME` with a JSON body.

The text is read as written (openai-harmony's encoder needs its vocabulary file, which is
fetched from the network; the format itself is what it renders). While streaming, a message
is sent as its body grows (analysis as reasoning, final as content), a message to a
recipient when it ends; text that may still be a marker is held back."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"\bto=(\S+)")


@dataclass
class Message:
    channel: str | None
    recipient: str | None
    body: str
    raw: str  # as written, from its start to its end marker (included)
    done: bool  # its end marker came


def _partial(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    for n in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(len(m) > n and text.endswith(m[:n]) for m in MARKERS):
            return n
    return 0


def messages(text: str, final: bool) -> list[Message]:
    """The messages of `text`; not `final`: the last one's body without what may still be
    a marker (and a header not yet whole: no message)."""
    out, i = [], 0
    while i < len(text):
        body_at = text.find(MESSAGE, i)
        if body_at < 0:
            if final and text[i:].strip():  # (text outside any message: content as it is)
                out.append(Message("final", None, text[i:], text[i:], True))
            break
        header = text[i:body_at]
        ends = [(j, m) for m in ENDS if (j := text.find(m, body_at)) >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        body = text[body_at + len(MESSAGE):end]
        done = bool(marker)
        if not done and not final:
            body = body[:len(body) - _partial(body)]
        channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header and \
            header.split(CHANNEL, 1)[1].split() else None
        found = _RECIPIENT.search(header)
        recipient = found.group(1).split(CONSTRAIN)[0] if found else None
        out.append(Message(channel, recipient, body, text[i:end + len(marker)], done))
        i = end + len(marker)
    return out


def split(text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, content): analysis bodies; final and preamble bodies, and messages to a
    recipient as written (not `final`: an unfinished one to a recipient is held)."""
    reasoning, content = [], []
    for m in messages(text, final):
        if m.recipient is not None:
            if m.done or final:
                content.append(m.raw)
        elif m.channel == "analysis":
            reasoning.append(m.body)
        else:
            content.append(m.body)
    return "".join(reasoning), "".join(content)


def tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, JSON arguments)]) of the messages to `functions.NAME`; content: the
    other messages' bodies; a call whose body is no JSON object makes it all content."""
    content, calls = [], []
    for m in messages(text, True):
        if m.recipient is None:
            content.append(m.body)
            continue
        try:
            arguments = json.loads(m.body)
        except ValueError:
            return text, []
        if not m.recipient.startswith("functions.") or not isinstance(arguments, dict):
            return text, []
        calls.append((m.recipient.removeprefix("functions."),
                      json.dumps(arguments, ensure_ascii=False)))
    return ("".join(content) or None), calls
