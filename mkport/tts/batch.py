"""Several Qwen3-TTS requests advanced together: one talker step and one predictor pass a frame for all of them.

With the megakernel backend the talker and the code predictor are batch decoders (`Decoder(..., batch=B)`): a
frame of B requests reads each weight once; so with the graphs backend (`mkport.runtime.graph_decoder.GraphDecoder`,
plain torch, a CUDA graph a step). With the reference backend, `mkport.runtime.torch_decoder.DecoderBatch` gives the
same interface over B one-sequence decoders; it is also what a batch is checked against (each request of a batch makes the frames it
makes alone).

`FrameBatch` holds up to B requests, one a slot; a request joins (its prompt prefilled into its slot) and leaves
between frames, so each is at its own frame: its EOS suppression (the first frames may not end) is its own row
of the talker's logit bias, its predictor seeds and text rows follow its own frame count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import MkportError
from ..runtime.decoder import GREEDY, SamplingParams
from .limits import fits
from .model import TtsModel
from .pipeline import MIN_FRAMES, TtsSampling, _frame_seed
from .prompt import Prompt


@dataclass
class _Request:
    prompt: Prompt
    sampling: TtsSampling
    max_frames: int
    frame: int = 0  # frames made so far


class FrameBatch:
    """Up to `talker.batch` requests, one a slot, each advanced one frame by every step()."""

    def __init__(self, model: TtsModel, talker, predictor):
        self.model, self.talker, self.predictor = model, talker, predictor
        self.batch = talker.batch
        cfg = model.config
        self.suppress = [i for i in range(cfg.codec_vocab - 1024, cfg.codec_vocab) if i != cfg.codec_eos]
        self.requests: dict[int, _Request] = {}
        self.inputs = torch.zeros(self.batch, model.talker_spec.input_dim, device=talker.device)
        self.codes = torch.zeros(self.batch, cfg.num_code_groups, dtype=torch.long, device=talker.device)
        self._rows = torch.arange(cfg.num_code_groups - 1, device=talker.device)
        self._no_text = torch.zeros(model.talker_spec.input_dim, device=talker.device)  # a slot that does not go on

    def free_slots(self) -> list[int]:
        return [b for b in range(self.batch) if b not in self.requests]

    def add(self, slot: int, prompt: Prompt, sampling: TtsSampling, max_frames: int) -> None:
        """Puts a request into a free slot: its prompt prefilled, all but the last row, which the next step takes."""
        if slot in self.requests or not 0 <= slot < self.batch:
            raise MkportError(f"slot {slot} is not a free slot of this batch (0..{self.batch - 1})")
        rows = prompt.embeds.shape[0]
        if not fits(rows, max_frames, self.talker.max_seq):
            raise MkportError(f"a prompt of {rows} positions and max_frames {max_frames} exceed the talker's KV cache "
                              f"({self.talker.max_seq} positions)")
        embeds = prompt.embeds.to(self.talker.device)
        self.talker.reset_slot(slot)
        self.talker.set_suppressed_slot(slot, self.suppress + [self.model.config.codec_eos])
        self.talker.prefill_slot(slot, embeds=embeds[:-1])
        self.inputs[slot] = embeds[-1]
        self.requests[slot] = _Request(prompt, sampling, max_frames)

    def remove(self, slot: int) -> None:
        self.requests.pop(slot, None)

    @torch.no_grad()
    def step(self) -> dict[int, torch.Tensor | None]:
        """One frame of every request: slot -> its 16 codes (CPU int64), or None when it ended at EOS. A request
        leaves its slot when it ends, or after its max_frames-th frame."""
        if not self.requests:
            return {}
        cfg, n, slots, codes = self.model.config, self.batch, self.requests, self.codes
        for slot, r in slots.items():
            if r.frame == MIN_FRAMES:
                self.talker.set_suppressed_slot(slot, self.suppress)
        talker_sampling, predictor_sampling, active = self.samplings()
        self.talker_step(talker_sampling, active)
        e0 = self.predictor_pass(predictor_sampling)
        host = codes.cpu()
        text = [self._no_text] * n  # each slot's next text row (the prompt's, on the model's device)
        out = {}
        for slot in list(slots):
            r = slots[slot]
            if int(host[slot, 0]) == cfg.codec_eos:
                out[slot] = None
                self.remove(slot)
                continue
            out[slot] = host[slot].clone()
            text[slot] = r.prompt.text_for_step(r.frame).to(self.inputs.device)
            r.frame += 1
            if r.frame >= r.max_frames:
                self.remove(slot)
        # every slot's next talker input at once: its 16 code embeddings and its text row (slots that ended or
        # sit idle get one too, unused: add() sets a newcomer's)
        codebooks = self.predictor.weights.embed[self._rows, codes[:, 1:]].float().sum(1)
        self.inputs = e0 + codebooks + torch.stack(text)
        return out

    def samplings(self) -> tuple[list[SamplingParams], list[SamplingParams], list[bool]]:
        """This frame's talker and predictor sampling of every slot, and which slots take part (idle ones run
        greedy and stay as they are)."""
        idle, slots, n = GREEDY, self.requests, self.batch
        talker = [slots[b].sampling.talker if b in slots else idle for b in range(n)]
        predictor = [dataclasses.replace(slots[b].sampling.predictor,
                                         seed=_frame_seed(slots[b].sampling.predictor.seed, slots[b].frame))
                     if b in slots else idle for b in range(n)]
        return talker, predictor, [b in slots for b in range(n)]

    def talker_step(self, sampling: list[SamplingParams], active: list[bool]) -> None:
        """The talker's step of every slot: codebook 0 into codes[:, 0]. (step() runs it; apart for timing.)"""
        self.codes[:, 0] = self.talker.step_batch(embeds=self.inputs, sampling=sampling, active=active).long()

    def predictor_pass(self, sampling: list[SamplingParams]) -> torch.Tensor:
        """The code predictor's pass of every slot after the talker's step: codebooks 1..15 into codes[:, 1:].
        Returns E0(codebook 0), which the next talker input sums. (step() runs it; apart for timing.)"""
        n, h, codes = self.batch, self.model.talker_spec.hidden_size, self.codes
        self.predictor.reset()
        self.predictor.step_batch(embeds=self.talker.hidden.view(n, h), head=0)  # position 0, output unused
        e0 = self.talker.weights.embed[0][codes[:, 0]].float()
        codes[:, 1] = self.predictor.step_batch(embeds=e0, head=0, sampling=sampling).long()
        for j in range(1, self.model.config.num_code_groups - 1):
            codes[:, j + 1] = self.predictor.step_batch(table=j - 1, head=j, sampling=sampling).long()
        return e0


class FrameGroups:
    """Batches (FrameBatch) of one size seen as one batch of all their slots, slot s being slot s % size of group
    s // size: more streams than the largest batch a kernel holds (the 1.7B's 16, by shared memory) are served by
    groups that take turns, each reading the weights once for its streams. A frame steps only the groups that hold
    requests, and free slots are offered group by group, so a light load keeps to the first group."""

    def __init__(self, groups: list[FrameBatch]):
        if not groups or len({g.batch for g in groups}) != 1:
            raise MkportError("frame groups need one or more batches of one size")
        self.groups, self.size = groups, groups[0].batch
        self.batch = self.size * len(groups)

    @property
    def talker(self):  # the first group's (each group has its own decoders, all alike)
        return self.groups[0].talker

    @property
    def predictor(self):
        return self.groups[0].predictor

    @property
    def requests(self) -> dict[int, _Request]:
        return {g * self.size + s: r for g, group in enumerate(self.groups) for s, r in group.requests.items()}

    def free_slots(self) -> list[int]:
        return [g * self.size + s for g, group in enumerate(self.groups) for s in group.free_slots()]

    def _group(self, slot: int) -> tuple[FrameBatch, int]:
        if not 0 <= slot < self.batch:
            raise MkportError(f"slot {slot} is not a slot of these groups (0..{self.batch - 1})")
        return self.groups[slot // self.size], slot % self.size

    def add(self, slot: int, prompt: Prompt, sampling: TtsSampling, max_frames: int) -> None:
        group, local = self._group(slot)
        group.add(local, prompt, sampling, max_frames)

    def remove(self, slot: int) -> None:
        group, local = self._group(slot)
        group.remove(local)

    def step(self) -> dict[int, torch.Tensor | None]:
        """A frame of every request, group after group (FrameBatch.step's result, by slot of the groups)."""
        out = {}
        for g, group in enumerate(self.groups):
            if group.requests:
                out.update({g * self.size + s: codes for s, codes in group.step().items()})
        return out


def generate_frames_batch(model: TtsModel, prompts: list[Prompt], talker, predictor, samplings: list[TtsSampling],
                          max_frames: list[int]) -> Iterator[list[torch.Tensor | None]]:
    """The requests started together, request b in slot b: yields, frame after frame, one entry a request: its 16
    codes, or None once it has ended (EOS, or max_frames[b] frames). Each request makes the frames generate_frames
    makes for it alone, with the same sampling (each sequence of a batch has its own seeds and random stream)."""
    count = len(prompts)
    if not 0 < count <= talker.batch or len(samplings) != count or len(max_frames) != count:
        raise MkportError(f"a batch of {talker.batch} takes 1 to {talker.batch} requests, each with its sampling and "
                          "max_frames")
    frames = FrameBatch(model, talker, predictor)
    talker.reset()
    for b in range(count):
        try:
            frames.add(b, prompts[b], samplings[b], max_frames[b])
        except MkportError as e:
            raise MkportError(f"request {b}: {e}") from None
    while frames.requests:
        step = frames.step()
        yield [step.get(b) for b in range(count)]
