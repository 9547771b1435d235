"""What a decoder samples with, for every backend: SamplingParams (checked once per value), seeds, and the logit
bias of suppressed token ids, made once per set."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..errors import MkportError
from ..kernel.render import SAMPLE_MAX_K

SEED_MAX = 2**63 - 1  # the kernel takes its seed as a signed 64-bit integer


def check_seed(seed: int, option: str = "seed") -> None:
    if not 0 <= seed <= SEED_MAX:
        raise MkportError(f"{option} {seed}: a seed is an integer from 0 to 2**63-1")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 samples the whole distribution; top_p < 1 needs top_k >= 1."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def validate(self, vocab: int) -> None:
        check_seed(self.seed)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise MkportError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if not 0 <= self.top_k <= SAMPLE_MAX_K:
            raise MkportError(f"top_k={self.top_k}: supported 0 (off) to {SAMPLE_MAX_K}")
        if not 0 < self.top_p <= 1:
            raise MkportError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_p < 1 and self.top_k == 0 and self.temperature > 0:
            raise MkportError(f"top_p={self.top_p} needs top_k between 1 and {SAMPLE_MAX_K}")
        if not self.repetition_penalty > 0:
            raise MkportError(f"repetition_penalty={self.repetition_penalty}: must be > 0")


GREEDY = SamplingParams()


@functools.lru_cache(maxsize=1024)
def validated(sampling: SamplingParams, vocab: int) -> None:
    """SamplingParams.validate, once per value: a batch checks every sequence's at each of its steps."""
    sampling.validate(vocab)


def suppression_bias(token_ids, vocab_size: int, device) -> torch.Tensor | None:
    """An additive logit bias of -inf on the given ids (None when there are none)."""
    ids = list(token_ids)
    if not ids:
        return None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise MkportError(f"suppressed token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    bias = torch.zeros(vocab_size, device=device)
    bias[ids] = float("-inf")
    return bias


class SuppressionBiases:
    """A decoder's suppression biases, one a set of ids, made once (a host-to-device copy, which can wait for the
    device) and kept: a frame loop sets the same few sets again and again."""

    def __init__(self, vocab_size: int, device):
        self.vocab_size, self.device = vocab_size, device
        self._biases: dict[tuple, torch.Tensor | None] = {}

    def of(self, token_ids) -> torch.Tensor | None:
        key = tuple(sorted(set(token_ids)))
        if key not in self._biases:
            self._biases[key] = suppression_bias(key, self.vocab_size, self.device)
        return self._biases[key]
