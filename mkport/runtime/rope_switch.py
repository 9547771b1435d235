"""Phi-3's one-time recompute of the KV cache at its longrope switch, the rule stated once for every decoder.

transformers' Phi3ForCausalLM.prepare_inputs_for_generation (what its generate calls before each forward) drops the
KV cache once: when the inputs so far reach past original_max_position_embeddings (input length >= original + 1)
while the cache holds no more than original rows. Its next forward runs every input again, so every key is rotated by
the long factors, where the cache had kept the short factors' keys of the rows before the switch. mkport's decoders
(TorchDecoder, the megakernel's Decoder) do the same: they keep a sequence's inputs while a switch may still come
(EarlyInputs) and, at that call, compute the cache rows before it again with the long factors, then run the call's
rows as usual (attention is causal: the same as one forward over every input)."""

from __future__ import annotations

import torch

from ..errors import MkportError
from ..kernel.spec import ModelSpec
from . import torch_model
from .weights import DecoderWeights


def switches(spec: ModelSpec) -> bool:
    """Phi-3 (model_type phi3: Phi-3, 3.5, 4-mini) with longrope: the only generate that recomputes its cache."""
    return spec.family == "phi3" and spec.rope.variant == "longrope"


def recomputes(spec: ModelSpec, start: int, n: int) -> bool:
    """Whether n rows fed after `start` cached ones are the call that recomputes the cache: the inputs reach past the
    original length (start + n >= original + 1), the cache holds at most the original length (a prompt from row 0
    needs nothing: its one pass is already that forward)."""
    return switches(spec) and 0 < start <= spec.rope.original_max_position < start + n


class EarlyInputs:
    """One sequence's inputs fed while a recompute may still come (rows that end within the original length): token
    ids, or input embeddings as given (input_dim floats a row, up to the original length: 50 MB at Phi-3-mini's 4096
    rows of 3072, the price of feeding them again), each part with its embedding table and positions."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        self.parts: list[tuple] = []
        self.rows: int | None = 0  # None: the cache holds rows not fed here (load_rows), whose inputs are unknown

    def keep(self, start: int, tokens: torch.Tensor | None, embeds: torch.Tensor | None, table: int,
             positions: torch.Tensor) -> None:
        """Rows fed at `start`: tokens [n] or embeds [n, input_dim] on the decoder's device, positions [3, n]."""
        n = positions.shape[1]
        if not switches(self.spec) or start + n > self.spec.rope.original_max_position:
            return  # no later call recomputes them
        if self.rows != start:
            self.rows = None
            return
        # copies: a caller may reuse its buffers, and a step's last token is overwritten by the next
        self.parts.append((None if tokens is None else tokens.clone(), None if embeds is None else embeds.clone(),
                           table, positions.clone()))
        self.rows += n

    def again(self, weights: DecoderWeights, start: int,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For the recompute before rows at `positions` fed at `start`: the `start` inputs before them embedded
        [start, hidden], their positions [3, start], and the length whose frequencies the forward over every row
        takes (its largest position + 1). The parts are let go: nothing is recomputed twice."""
        if self.rows != start:
            raise MkportError(f"{self.spec.name}: Phi-3's recompute of the cache at its longrope switch needs the "
                              f"inputs of all {start} cached rows, and rows loaded with load_rows have none")
        x = torch.cat([torch_model.embed_inputs(self.spec, weights, t, e, table) for t, e, table, _ in self.parts])
        pos = torch.cat([p.to(x.device) for *_, p in self.parts], dim=1)
        length = max(int(pos.max()), int(positions.max())) + 1
        self.parts = []
        return x, pos, length
