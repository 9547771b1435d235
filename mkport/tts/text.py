"""Where text may be cut into utterances: at sentence ends. `mkport speak` cuts a long text at the sentence
ends that keep its utterances within UTTERANCE_TOKENS; `mkport serve` cuts text arriving in pieces at each
sentence end (mkport.serve.utterances). No torch here."""

from __future__ import annotations

import re
from typing import Callable

# A sentence ends at . ! ? or … (with closing quotes or brackets) before white space (a "." inside "3.14" is
# not one), at 。！？ (with closing quotes), or at a line break. A match ends where the next sentence may start.
SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*\s|[。！？]+[”’」』）]*|\n")
# Utterances of whole sentences up to this many text tokens (about a minute of speech, within speak's default
# --max-frames); a longer sentence is an utterance of its own.
UTTERANCE_TOKENS = 200


def split_utterances(text: str, count_tokens: Callable[[str], list], limit: int = UTTERANCE_TOKENS) -> list[str]:
    """Text -> utterances: consecutive whole sentences, grouped while their text tokens (count_tokens(str))
    stay within `limit`. Text within the limit is one utterance, unchanged."""
    ends = [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]
    spans = [(start, end) for start, end in zip([0] + ends, ends) if text[start:end].strip()]
    groups, tokens = [], 0
    for start, end in spans:
        n = len(count_tokens(text[start:end].strip()))
        if groups and tokens + n <= limit:
            groups[-1][1], tokens = end, tokens + n
        else:
            groups.append([start, end])
            tokens = n
    if len(groups) <= 1:
        return [text]
    return [text[start:end].strip() for start, end in groups]
