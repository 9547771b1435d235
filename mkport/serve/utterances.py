"""Cutting text that arrives in pieces (an LLM's tokens, over the WebSocket) into utterances.

The model speaks an utterance with its whole text in the prompt, which shapes its prosody; so a cut in
the middle of a sentence sounds like a pause where there should be none, while waiting for the whole reply
delays the first audio by the LLM's whole generation. An utterance therefore ends at:
- a sentence end: `.`, `!`, `?` or `…` followed by white space (a `.` inside `3.14` is not one; a piece
  that ends in `.` waits for the next piece to tell), `。！？` at once, or a line break;
- a flush from the client: everything buffered;
- `max_chars` buffered without a sentence end: cut at the last space before it (or there);
- the oldest buffered text having waited `max_wait_s` (an LLM that stalls, or writes no punctuation): cut
  at the last space, so a word still arriving is not split.
"""

from __future__ import annotations

import time
from typing import Callable

from ..tts.text import SENTENCE_END
DEFAULT_MAX_CHARS = 300
DEFAULT_MAX_WAIT_S = 1.0


class UtteranceSplitter:
    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_chars, self.max_wait_s, self.clock = max_chars, max_wait_s, clock
        self.buffer = ""
        self.since: float | None = None  # when the oldest buffered text arrived

    def push(self, piece: str) -> list[str]:
        """Adds a piece; returns the utterances it completes."""
        if not piece:
            return []
        if not self.buffer.strip():
            self.since = self.clock()
        self.buffer += piece
        out = []
        while (m := SENTENCE_END.search(self.buffer)) is not None:
            out += self._cut(m.end())
        while len(self.buffer) > self.max_chars:
            space = self.buffer.rfind(" ", 0, self.max_chars + 1)
            out += self._cut(space if space > 0 else self.max_chars)
        return out

    def flush(self) -> list[str]:
        return self._cut(len(self.buffer))

    def wait_s(self) -> float | None:
        """Seconds until the buffered text is due (0: now), None when nothing waits."""
        if self.since is None:
            return None
        return max(0.0, self.since + self.max_wait_s - self.clock())

    def due(self) -> list[str]:
        """The buffered text up to its last space once it has waited max_wait_s (all of it when it has no
        space); nothing before that."""
        if self.wait_s() != 0.0:
            return []
        space = self.buffer.rstrip().rfind(" ")
        return self._cut(space if space > 0 else len(self.buffer))

    def clear(self) -> None:
        self.buffer, self.since = "", None

    def _cut(self, end: int) -> list[str]:
        text, self.buffer = self.buffer[:end].strip(), self.buffer[end:]
        self.since = self.clock() if self.buffer.strip() else None
        return [text] if text else []
