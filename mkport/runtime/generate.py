"""Text generation on one decoder: a prompt's token ids in, sampled token ids out until EOS or a token budget
(`mkport run`), on any one-sequence decoder (decoder_api.SequenceDecoder): the megakernel's or the plain-torch
one."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import MkportError
from .decoder_api import SequenceDecoder
from .sampling import SamplingParams


@dataclass
class GenerationStats:
    """Filled while generate() runs: what stopped it and where the time went (seconds)."""

    prompt_tokens: int = 0
    tokens: int = 0  # generated, EOS not counted
    stop: str = ""  # "eos" or "max-tokens"
    first_token_s: float = 0.0  # the prompt's prefill and the first step, up to the first token on the host
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over their time (the first token's time is the prompt's)."""
        steps_s = self.total_s - self.first_token_s
        return (self.tokens - 1) / steps_s if self.tokens > 1 and steps_s > 0 else float("nan")


def generate(decoder: SequenceDecoder, prompt: Sequence[int], sampling: SamplingParams, max_tokens: int,
             eos: Sequence[int] = (), stats: GenerationStats | None = None) -> Iterator[int]:
    """Yields the token ids sampled after `prompt` on an empty decoder, at most `max_tokens` of them, and stops at
    the first one in `eos` (which is not yielded). All but the last prompt token are prefilled in one pass; the
    last goes through a decode step, which samples the first token; each later step feeds the token it sampled
    last on the device. A step's token reaches the host before the next step: the text streams token by token."""
    stats = stats if stats is not None else GenerationStats()
    if not prompt:
        raise MkportError("the prompt has no tokens")
    if decoder.length + len(prompt) + max_tokens - 1 > decoder.max_seq:
        raise MkportError(f"a prompt of {len(prompt)} tokens and {max_tokens} new ones do not fit the decoder's "
                          f"{decoder.max_seq} positions")
    stats.prompt_tokens = len(prompt)
    stop = set(eos)
    start = time.perf_counter()
    if len(prompt) > 1:
        decoder.prefill(tokens=list(prompt[:-1]))
    token = decoder.step(token=prompt[-1], sampling=sampling)
    for i in range(max_tokens):
        tok = int(token)  # waits for the step
        if i == 0:
            stats.first_token_s = time.perf_counter() - start
        stats.total_s = time.perf_counter() - start
        if tok in stop:
            stats.stop = "eos"
            return
        stats.tokens += 1
        yield tok
        if i + 1 < max_tokens:
            token = decoder.step(sampling=sampling)
    stats.stop = "max-tokens"
