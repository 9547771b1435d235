"""Several Qwen3-TTS requests advanced together: one talker step and one predictor pass a frame for all of them.

With the megakernel backend the talker and the code predictor are batch decoders (`Decoder(..., batch=B)`): a
frame of B requests reads each weight once. With the reference backend, `DecoderBatch` gives the same interface
over B one-sequence decoders; it is also what a batch is checked against (each request of a batch makes the
frames it makes alone).

The requests start together and run in lockstep, frame k of each at the same step, so the frame-dependent EOS
suppression is shared; a request that ends (EOS or its own max_frames) sits the talker's later steps out.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from ..errors import MkportError
from ..runtime import SamplingParams
from .model import TtsModel
from .pipeline import MIN_FRAMES, TorchDecoder, TtsSampling, _frame_seed, check_backend
from .prompt import Prompt


class DecoderBatch:
    """The batch interface of mkport.runtime.Decoder (prefill_slot, step_batch, hidden of every sequence) over
    `batch` one-sequence decoders, stepped one after another."""

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

    def set_suppressed(self, token_ids) -> None:
        for d in self.decoders:
            d.set_suppressed(token_ids)

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


def make_batch_decoders(model: TtsModel, backend: str, max_seq: int, batch: int, device=None):
    """(talker, predictor) batch decoders of `batch` sequences for a backend."""
    check_backend(backend)
    pred_seq = model.config.num_code_groups + 1
    if backend == "megakernel":
        from ..runtime import Decoder

        return (Decoder(model.talker_spec, model.talker_weights, max_seq, batch=batch),
                Decoder(model.predictor_spec, model.predictor_weights, pred_seq, batch=batch))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return (DecoderBatch([TorchDecoder(model.talker_spec, model.talker_weights, max_seq, device) for _ in range(batch)]),
            DecoderBatch([TorchDecoder(model.predictor_spec, model.predictor_weights, pred_seq, device)
                          for _ in range(batch)]))


@torch.no_grad()
def generate_frames_batch(model: TtsModel, prompts: list[Prompt], talker, predictor, samplings: list[TtsSampling],
                          max_frames: list[int]) -> Iterator[list[torch.Tensor | None]]:
    """Yields, frame after frame, one entry a request: its 16 codes (CPU int64), or None once it has ended (EOS,
    or max_frames[b] frames). Request b runs in slot b of the batch decoders; there may be fewer requests than
    slots (the rest sit out). Each request makes the frames generate_frames makes for it alone, with the same
    sampling (each sequence of a batch has its own seeds and random stream)."""
    cfg = model.config
    groups, n, h = cfg.num_code_groups, talker.batch, model.talker_spec.hidden_size
    count = len(prompts)
    if not 0 < count <= n or len(samplings) != count or len(max_frames) != count:
        raise MkportError(f"a batch of {n} takes 1 to {n} requests, each with its sampling and max_frames")
    dev = talker.device
    for b, prompt in enumerate(prompts):
        if prompt.embeds.shape[0] + max_frames[b] > talker.max_seq:
            raise MkportError(f"request {b}: its prompt ({prompt.embeds.shape[0]} positions) and max_frames "
                              f"({max_frames[b]}) exceed the talker's KV cache ({talker.max_seq} positions)")
    suppress = [i for i in range(cfg.codec_vocab - 1024, cfg.codec_vocab) if i != cfg.codec_eos]
    codec_table = talker.weights.embed[0]
    tables = predictor.weights.embed
    rows = torch.arange(groups - 1, device=dev)
    talker.reset()
    first = torch.zeros(n, model.talker_spec.input_dim, device=dev)
    for b, prompt in enumerate(prompts):
        embeds = prompt.embeds.to(dev)
        talker.prefill_slot(b, embeds=embeds[:-1])
        first[b] = embeds[-1]
    idle = SamplingParams()  # the sampling of slots without a request
    talker_sampling = [s.talker for s in samplings] + [idle] * (n - count)
    running = [True] * count + [False] * (n - count)
    codes = torch.zeros(n, groups, dtype=torch.long, device=dev)
    talker_input = first
    for k in range(max(max_frames)):
        if k in (0, MIN_FRAMES):
            talker.set_suppressed(suppress + [cfg.codec_eos] if k < MIN_FRAMES else suppress)
        codes[:, 0] = talker.step_batch(embeds=talker_input, sampling=talker_sampling, active=running).long()
        predictor_sampling = [dataclasses.replace(s.predictor, seed=_frame_seed(s.predictor.seed, k))
                              for s in samplings] + [idle] * (n - count)
        predictor.reset()
        predictor.step_batch(embeds=talker.hidden.view(n, h), head=0)  # position 0, output unused
        e0 = codec_table[codes[:, 0]].float()
        codes[:, 1] = predictor.step_batch(embeds=e0, head=0, sampling=predictor_sampling).long()
        for j in range(1, groups - 1):
            codes[:, j + 1] = predictor.step_batch(table=j - 1, head=j, sampling=predictor_sampling).long()
        host = codes.cpu()
        out = []
        for b in range(count):
            if running[b] and int(host[b, 0]) == cfg.codec_eos:
                running[b] = False
            out.append(host[b].clone() if running[b] else None)
            if running[b] and k + 1 >= max_frames[b]:
                running[b] = False  # this frame is its last
        yield out
        if not any(running):
            return
        text = torch.stack([prompts[b].text_for_step(k) if b < count else prompts[0].text_for_step(k)
                            for b in range(n)]).to(dev)
        talker_input = e0 + tables[rows, codes[:, 1:]].float().sum(1) + text
