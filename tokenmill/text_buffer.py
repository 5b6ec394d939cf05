"""`TextBuffer`: text that grows at its end, a piece per step, over tens of thousands of steps
(an R1-style output): appending never copies what is there (`str +=` on an attribute copies
the whole text each time), every 64 appended pieces are merged into one (so a long output is
a few hundred strings, not one per token), reading the whole text joins it once, and a tail
joins only the pieces it spans."""

from __future__ import annotations

_GROUP = 64


class TextBuffer:
    def __init__(self, text: str = "") -> None:
        self._pieces: list[str] = [text] if text else []
        self._loose = 0  # pieces appended since the last merge
        self.length = len(text)

    def append(self, piece: str) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self.length += len(piece)
        self._loose += 1
        if self._loose == _GROUP:
            self._pieces[-_GROUP:] = ["".join(self._pieces[-_GROUP:])]
            self._loose = 0

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces, self._loose = ["".join(self._pieces)], 0
        return self._pieces[0] if self._pieces else ""

    @text.setter
    def text(self, value: str) -> None:
        self._pieces, self._loose, self.length = [value] if value else [], 0, len(value)

    def tail(self, start: int) -> str:
        """The text from character `start` on (0 <= start), in time proportional to it and
        the pieces it spans."""
        need, count = self.length - start, 0
        if need <= 0:
            return ""
        for i in range(len(self._pieces) - 1, -1, -1):
            piece = self._pieces[i]
            count += len(piece)
            if count >= need:
                return piece[count - need:] + "".join(self._pieces[i + 1:])
        return self.text[start:]
