"""Tool calls out of a streamed choice: text deltas -> (content delta, calls now complete).

Content before a tool-call section streams as it comes, except text that may still turn out
to open one (held until it is known) and trailing whitespace (dropped when a section
follows, as the whole response drops it). Calls stream as soon as the parser knows each is
complete (`ToolParser.complete_calls`), the rest when the output ends."""

from __future__ import annotations

from tokenmill.entrypoints.parsers.tool_calls import ToolCall, ToolParser


class ToolCallStream:
    """One streamed choice's tool calls, in time proportional to each piece while no section
    has started (long content, say code, streams through): only the text not yet sent as
    content is searched (what is held back, and the section once it starts); the whole text
    is joined once, at the end. `WholeTextToolCallStream` is its reference."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pieces: list[str] = []  # the whole text
        self.unsent = ""  # the text from `sent` on
        self.sent = 0  # characters of text sent as content
        self.start: int | None = None  # where the section starts, once it has
        self.calls_sent = 0

    def _content_upto(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.unsent = self.unsent[:end - self.sent], self.unsent[end - self.sent:]
        self.sent = end
        return out

    def feed(self, delta: str, done: bool) -> tuple[str, list[ToolCall]]:
        self.pieces.append(delta)
        self.unsent += delta
        if done:
            text = "".join(self.pieces)
            content, calls = self.parser.parse(text)
            if calls and len(calls) >= self.calls_sent:
                new, self.calls_sent = calls[self.calls_sent:], len(calls)
                return self._content_upto(len(content or "")), new
            # no calls (or the section went bad after some were sent): the rest is content
            return self._content_upto(len(text)), []
        if self.start is None:
            # Sent content never held a marker's start; once some was sent, the output's
            # start is known not to be a leading marker's.
            leading = self.sent == 0
            found = self.parser.section_start(self.unsent, leading)
            if found is None:
                visible = self.unsent[:self.parser.hold_from(self.unsent, leading)]
                return self._content_upto(self.sent + len(visible.rstrip())), []
            self.start = self.sent + found
        offset = self.start - self.sent
        content = self._content_upto(self.sent + len(self.unsent[:offset].rstrip()))
        calls = self.parser.complete_calls(self.unsent[self.start - self.sent:])
        new = calls[self.calls_sent:]
        self.calls_sent = max(self.calls_sent, len(calls))
        return content, new


class WholeTextToolCallStream:
    """The reference `ToolCallStream`: the whole text so far searched again at each piece."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.calls_sent = 0

    def _content_upto(self, end: int) -> str:
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def feed(self, delta: str, done: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if done:
            content, calls = self.parser.parse(self.text)
            if calls and len(calls) >= self.calls_sent:
                new, self.calls_sent = calls[self.calls_sent:], len(calls)
                return self._content_upto(len(content or "")), new
            # no calls (or the section went bad after some were sent): the rest is content
            return self._content_upto(len(self.text)), []
        start = self.parser.section_start(self.text)
        if start is None:
            visible = self.text[:self.parser.hold_from(self.text)]
            return self._content_upto(len(visible.rstrip())), []
        content = self._content_upto(len(self.text[:start].rstrip()))
        calls = self.parser.complete_calls(self.text[start:])
        new = calls[self.calls_sent:]
        self.calls_sent = max(self.calls_sent, len(calls))
        return content, new
