"""Tool calls out of a streamed choice: text deltas -> (content delta, calls now complete).

Content before a tool-call section streams as it comes, except text that may still turn out
to open one (held until it is known) and trailing whitespace (dropped when a section
follows, as the whole response drops it). Calls stream as soon as the parser knows each is
complete (`ToolParser.complete_calls`), the rest when the output ends."""

from __future__ import annotations

from tokenmill.tool_calls.parsers import ToolCall, ToolParser


class ToolCallStream:
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
