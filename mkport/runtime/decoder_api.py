"""The two interfaces every decoder backend offers, stated once, and the argument checks they share.

`SequenceDecoder`: one sequence, prefilled and stepped (the megakernel's Decoder at batch 1, TorchDecoder).
`BatchDecoder`: `batch` sequences, each prefilled alone into its own slot and all stepped together (Decoder at any
batch, GraphDecoder, DecoderBatch). Callers (generate, the TTS frame loops, the server) take these, never a class;
runtime.backends.make_decoder builds them."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..errors import MkportError
from ..kernel.spec import ModelSpec
from .sampling import SamplingParams, validated
from .kv_cache import write_cache_rows
from .weights import DecoderWeights

DEFAULT_MAX_SEQ = 4096


@runtime_checkable
class SequenceDecoder(Protocol):
    spec: ModelSpec
    device: torch.device
    max_seq: int
    length: int  # tokens in the KV cache
    exact_prefix_rows: int  # how many first rows cached_rows gives as exactly as one prefill computes them
    weights: DecoderWeights  # what its steps read (the TTS frame recipe embeds codes with them)
    hidden: torch.Tensor  # the last step's final-normed hidden state
    token_out: torch.Tensor  # the last step's sampled token, on the device

    def reset(self) -> None: ...

    def set_suppressed(self, token_ids) -> None: ...

    def prefill(self, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor: ...

    def step(self, token=None, embed: torch.Tensor | None = None, position=None, table: int = 0, head: int = 0,
             sampling: SamplingParams = SamplingParams()) -> torch.Tensor: ...

    def cached_rows(self, n: int) -> tuple[torch.Tensor, ...]: ...

    def load_rows(self, rows: tuple[torch.Tensor, ...]) -> None: ...


@runtime_checkable
class BatchDecoder(Protocol):
    spec: ModelSpec
    device: torch.device
    max_seq: int
    batch: int
    weights: DecoderWeights
    hidden: torch.Tensor  # [batch * hidden]: every sequence's last final-normed state
    token_out: torch.Tensor  # [batch]: every sequence's last sampled token

    def reset(self) -> None: ...

    def reset_slot(self, slot: int) -> None: ...

    def set_suppressed(self, token_ids) -> None: ...

    def set_suppressed_slot(self, slot: int, token_ids) -> None: ...

    def prefill_slot(self, slot: int, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor: ...

    def step_batch(self, tokens=None, embeds: torch.Tensor | None = None, positions=None, table: int = 0,
                   head: int = 0, sampling=SamplingParams(), active=None) -> torch.Tensor: ...


def prompt_positions(position, n: int, start: int, device) -> torch.Tensor:
    """[3, n] rope positions from None (start..start+n on all streams), an int, or a (t, h, w) triplet."""
    if position is None:
        pos = torch.arange(start, start + n, device=device)
        return pos.expand(3, n).contiguous()
    if isinstance(position, torch.Tensor):
        return position.to(device=device, dtype=torch.int64).reshape(3, n)
    if isinstance(position, int):
        return torch.full((3, n), position, device=device, dtype=torch.int64)
    return torch.tensor(position, device=device, dtype=torch.int64).reshape(3, n)


def step_position(at, length: int) -> list[int]:
    """A sequence's (t, h, w) position at a decode step: its length, an int for all three, or a triplet as given
    (torch only for a tensor: host time a step)."""
    if at is None:
        return [length] * 3
    if isinstance(at, int):
        return [at] * 3
    return prompt_positions(at, 1, length, "cpu").reshape(3).tolist()


def check_slot(slot: int, batch: int) -> None:
    if not 0 <= slot < batch:
        raise MkportError(f"sequence {slot} does not exist (0..{batch - 1})")


def check_table(spec: ModelSpec, table: int) -> None:
    if not 0 <= table < spec.num_embedding_tables:
        raise MkportError(f"embedding table {table} does not exist (0..{spec.num_embedding_tables - 1})")


def check_tokens(spec: ModelSpec, tokens, table: int) -> None:
    """Token ids (a host tensor or list: no device sync) of table `table`, in the vocabulary."""
    check_table(spec, table)
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    bad = tokens[(tokens < 0) | (tokens >= spec.vocab_size)]
    if bad.numel():
        raise MkportError(f"token id {int(bad[0])}: token ids must be in 0..{spec.vocab_size - 1}")


def prefill_inputs(spec: ModelSpec, tokens, embeds, table: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A prompt's rows on the device, checked: (inputs, the token ids or None for embeddings)."""
    if (tokens is None) == (embeds is None):
        raise MkportError("prefill takes tokens or embeds, not both")
    if tokens is not None:
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        check_tokens(spec, tokens, table)  # before the copy: no device sync for host tokens
        inputs = tokens = tokens.to(device)
    else:
        inputs = embeds.to(device, torch.float32).reshape(-1, spec.input_dim)
    if inputs.shape[0] == 0:
        raise MkportError("prefill needs at least one token")
    return inputs, tokens


def batch_arguments(spec: ModelSpec, n: int, active, sampling, positions, head: int, tokens=None) -> tuple[list, list, list]:
    """step_batch's per-sequence arguments (shared by the batch decoders) as lists of n, checked: `active`
    (default all), `sampling` (one SamplingParams for all, or one a sequence), `positions` (default None each),
    and the output head; `tokens`, when a list is given, must have n entries too."""
    active = [True] * n if active is None else [bool(a) for a in active]
    sampling = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    positions = [None] * n if positions is None else list(positions)
    given = [("active", active), ("sampling", sampling), ("positions", positions)]
    for name, values in given + ([("tokens", list(tokens))] if tokens is not None else []):
        if len(values) != n:
            raise MkportError(f"step_batch: {name} has {len(values)} entries for a batch of {n}")
    for sp in set(sampling):  # each distinct one once: a batch mostly shares a few
        validated(sp, spec.vocab_size)
    check_head(spec, head)
    return active, sampling, positions


def check_head(spec: ModelSpec, head: int) -> None:
    if not 0 <= head < spec.num_output_heads:
        raise MkportError(f"output head {head} does not exist (0..{spec.num_output_heads - 1})")


class CachedRows:
    """Copying the first rows of a one-sequence decoder's KV cache out and back in (a prompt prefix's K/V, saved by
    one request for the next: mkport.tts.prefix_cache). For classes with spec, max_seq, a settable length,
    _check_room and _layer_caches (K and V, layer i's [kv_heads, rows, head_dim] at [i])."""

    def cached_rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """Copies of the K and V of cache rows 0..n-1 (n <= length), [layers, kv_heads, n, head_dim]."""
        if not 0 < n <= self.length:
            raise MkportError(f"cached_rows({n}): the cache holds {self.length} rows")
        k, v = self._layer_caches()
        if any(layer.shape[1] < self.max_seq for layer in k):
            raise MkportError(f"cached_rows: {self.spec.name}'s sliding layers keep a ring of their last rows, not a "
                              "prompt's first ones")
        return torch.stack([layer[:, :n] for layer in k]), torch.stack([layer[:, :n] for layer in v])

    def load_rows(self, rows: tuple[torch.Tensor, ...]) -> None:
        """Puts rows from cached_rows into an empty cache (after reset): the state after prefilling the
        prompt they came from (its hidden states aside)."""
        k, v = rows
        if self.length:
            raise MkportError(f"load_rows needs an empty KV cache (reset first); it holds {self.length} rows")
        s = self.spec
        if k.shape != v.shape or k.shape[:2] + k.shape[3:] != (s.num_layers, s.num_kv_heads, s.head_dim):
            raise MkportError(f"KV rows of shape {tuple(k.shape)} do not fit this decoder's cache of "
                              f"{s.num_layers} layers of {s.num_kv_heads} kv heads of {s.head_dim}")
        n = k.shape[2]
        self._check_room(n)
        for cache, layers in zip(self._layer_caches(), (k, v)):
            for i, layer in enumerate(layers):
                write_cache_rows(cache[i], 0, layer)
        self.length = n
