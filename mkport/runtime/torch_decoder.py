"""TorchDecoder: the one-sequence interface (decoder_api.SequenceDecoder: prefill, step, reset, suppression, the KV
cache's rows) in plain torch on the CPU or a GPU, float32 from the bf16 weights through mkport.runtime.torch_model, with the
kernel's sampling semantics (logit bias, repetition penalty, temperature, top-k, top-p, one draw) from a seeded
torch.Generator (not the kernel's Philox stream: sampled runs agree with the megakernel in distribution, greedy runs
token for token up to float ties). The `reference` backend of speak, serve and run; DecoderBatch gives B of them
the batch interface (decoder_api.BatchDecoder; the `reference` backend of batches)."""

from __future__ import annotations

import torch

from ..errors import MkportError
from ..kernel.spec import ModelSpec
from . import rope_switch, torch_model
from .decoder_api import DEFAULT_MAX_SEQ, CachedRows, prefill_inputs, prompt_positions
from .sampling import SamplingParams, SuppressionBiases
from .weights import DecoderWeights


def _float_weights(w: DecoderWeights, device) -> DecoderWeights:
    return w.map(lambda t: t.to(device=device, dtype=torch.float32).contiguous())


def process_logits(logits: torch.Tensor, bias, seen, s: SamplingParams) -> torch.Tensor:
    """The kernel's logit processing: + bias (-inf for suppressed ids), repetition penalty on seen ids
    (divide positive, multiply negative), / temperature."""
    l = logits.float().clone()
    if bias is not None:
        l = l + bias
    if seen is not None and s.repetition_penalty != 1.0:
        pen = torch.where(l > 0, l / s.repetition_penalty, l * s.repetition_penalty)
        l = torch.where(seen, pen, l)
    if s.temperature > 0:
        l = l / s.temperature
    return l


def sample_token(l: torch.Tensor, s: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """From processed logits: argmax (lowest id on ties) when greedy; else top-k (0 = all), then top-p
    keeping token j while the mass of j and everything below it exceeds 1 - top_p, then one draw."""
    if s.temperature <= 0:
        return torch.argmax(l).reshape(1)  # first maximum = lowest id
    if s.top_k == 0:
        probs = torch.softmax(l, -1)
        return torch.multinomial(probs, 1, generator=gen)
    k = min(s.top_k, l.numel())
    vals, ids = torch.topk(l, k)
    o = torch.argsort(ids)  # highest logit first, lowest id first among equals (as the kernel sorts)
    vals, ids = vals[o], ids[o]
    o = torch.argsort(vals, descending=True, stable=True)
    vals, ids = vals[o], ids[o]
    p = torch.softmax(vals.double(), -1)
    suffix = torch.flip(torch.cumsum(torch.flip(p, [0]), 0), [0])  # mass of j and all below
    keep = int((suffix > 1.0 - s.top_p).sum())
    keep = max(1, keep)
    kept = p[:keep]
    u = torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64).to(kept.device) * kept.sum()
    pick = int(torch.searchsorted(torch.cumsum(kept, 0), u).clamp(max=keep - 1))
    return ids[pick].reshape(1)


class TorchDecoder(CachedRows):
    """One sequence (decoder_api.SequenceDecoder) in plain torch, on the CPU or a GPU."""

    def __init__(self, spec: ModelSpec, weights: DecoderWeights, max_seq: int | None = None, device="cpu"):
        self.spec, self.device = spec, torch.device(device)
        self.max_seq = max_seq or min(spec.max_position, DEFAULT_MAX_SEQ)
        self.weights = _float_weights(weights, self.device)
        shape = (spec.num_layers, spec.num_kv_heads, self.max_seq, spec.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device)
        self.v_cache = torch.zeros(shape, device=self.device)
        # a hybrid model's linear-attention state (fp32), the sequence's like the KV cache; zeroed at position 0
        self.linear_state = torch_model.LinearState.zeros(spec, self.device) if spec.linear_layers else None
        self.hidden = torch.zeros(spec.hidden_size, device=self.device)
        self.logits = torch.zeros(spec.vocab_size, device=self.device)
        self.token_out = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(spec.vocab_size, dtype=torch.bool, device=self.device)
        self.logit_bias = None
        self._biases = SuppressionBiases(spec.vocab_size, self.device)
        self.length = 0
        self.early_inputs = rope_switch.EarlyInputs(spec)
        self._gen, self._gen_seed = None, None
        self.exact_prefix_rows = self.max_seq  # its cache is fp32: every cached row is exact

    def _layer_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache, self.v_cache

    def reset(self) -> None:
        """Empties the cache and the repetition history, and restarts the random stream (as the kernel's
        Philox step counter restarts), so a request on a reused decoder samples as on a fresh one."""
        self.length = 0
        self.seen.zero_()
        self.early_inputs.reset()
        self._gen, self._gen_seed = None, None

    def set_suppressed(self, token_ids) -> None:
        self.logit_bias = self._biases.of(token_ids)

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_seq:
            raise MkportError(f"position {self.length + n - 1} is past the KV cache length {self.max_seq}")

    def _switch(self, tokens, embeds, table: int, pos: torch.Tensor) -> None:
        """Before rows at `pos` are fed: Phi-3's recompute at its longrope switch (rope_switch), the cache rows before
        them again with the long factors, where due; the rows kept while a later call may need them."""
        if rope_switch.recomputes(self.spec, self.length, pos.shape[1]):
            x, before, length = self.early_inputs.again(self.weights, self.length, pos)
            torch_model.forward(self.spec, self.weights, x, before, self.k_cache, self.v_cache, rope_length=length)
        self.early_inputs.keep(self.length, tokens, embeds, table, pos)

    @torch.no_grad()
    def prefill(self, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor:
        inputs, tokens = prefill_inputs(self.spec, tokens, embeds, table, self.device)
        embeds = None if tokens is not None else inputs
        n = inputs.shape[0]
        self._check_room(n)
        x = torch_model.embed_inputs(self.spec, self.weights, tokens, embeds, table)
        pos = prompt_positions(positions, n, self.length, self.device)
        self._switch(tokens, embeds, table, pos)
        hidden = torch_model.forward(self.spec, self.weights, x, pos, self.k_cache, self.v_cache, start=self.length,
                                     state=self.linear_state)
        if tokens is not None:
            self.seen[tokens] = True
        self.length += n
        return hidden

    @torch.no_grad()
    def step(self, token=None, embed=None, position=None, table: int = 0, head: int = 0,
             sampling: SamplingParams = SamplingParams()) -> torch.Tensor:
        sampling.validate(self.spec.vocab_size)
        self._check_room(1)
        embed = None if embed is None else embed.reshape(1, -1).to(self.device)
        tok = None
        if embed is None:
            tok = self.token_out.long() if token is None else torch.tensor([int(token)], device=self.device)
        x = torch_model.embed_inputs(self.spec, self.weights, tok, embed, table)
        pos = prompt_positions(position, 1, self.length, self.device)
        self._switch(tok, embed, table, pos)
        h = torch_model.forward(self.spec, self.weights, x, pos, self.k_cache, self.v_cache, start=self.length,
                                state=self.linear_state)[0]
        self.hidden.copy_(h)
        l = process_logits(torch_model.logits(self.spec, self.weights, h, head), self.logit_bias, self.seen, sampling)
        self.logits.copy_(l)
        if self._gen is None or self._gen_seed != sampling.seed:
            self._gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
            self._gen_seed = sampling.seed
        tok = sample_token(l, sampling, self._gen)
        self.token_out.copy_(tok.to(torch.int32))
        self.seen[tok] = True
        self.length += 1
        return self.token_out


class DecoderBatch:
    """The batch interface (decoder_api.BatchDecoder) over `batch` one-sequence decoders, stepped one after
    another."""

    def __init__(self, decoders: list):
        if not decoders:
            raise MkportError("a batch needs at least one decoder")
        self.decoders = decoders
        self.batch = len(decoders)
        first = decoders[0]
        self.spec, self.device, self.max_seq, self.weights = first.spec, first.device, first.max_seq, first.weights
        self.hidden = torch.zeros(self.batch * self.spec.hidden_size, device=self.device)
        self.token_out = torch.zeros(self.batch, dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        for d in self.decoders:
            d.reset()

    def reset_slot(self, slot: int) -> None:
        self.decoders[slot].reset()

    def set_suppressed(self, token_ids) -> None:
        for d in self.decoders:
            d.set_suppressed(token_ids)

    def set_suppressed_slot(self, slot: int, token_ids) -> None:
        self.decoders[slot].set_suppressed(token_ids)

    def prefill_slot(self, slot: int, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor:
        return self.decoders[slot].prefill(tokens=tokens, embeds=embeds, positions=positions, table=table)

    def step_batch(self, tokens=None, embeds=None, positions=None, table: int = 0, head: int = 0,
                   sampling=SamplingParams(), active=None) -> torch.Tensor:
        n, h = self.batch, self.spec.hidden_size
        sampling = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        for b, d in enumerate(self.decoders):
            if active is not None and not active[b]:
                continue
            position = None if positions is None else positions[b]
            if embeds is not None:
                d.step(embed=embeds[b], position=position, table=table, head=head, sampling=sampling[b])
            else:
                token = None if tokens is None else tokens[b]
                d.step(token=token, position=position, table=table, head=head, sampling=sampling[b])
            self.hidden[b * h : (b + 1) * h] = d.hidden
            self.token_out[b] = d.token_out[0]
        return self.token_out
