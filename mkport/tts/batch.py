"""Several Qwen3-TTS requests advanced together: one talker step and one predictor pass a frame for all of them.

With the megakernel backend the talker and the code predictor are batch decoders (`Decoder(..., batch=B)`): a
frame of B requests reads each weight once; so with the graphs backend (`mkport.runtime.graph_decoder.GraphDecoder`,
plain torch, a CUDA graph a step). With the reference backend, `mkport.runtime.torch_decoder.DecoderBatch` gives the
same interface over B one-sequence decoders; it is also what a batch is checked against (each request of a batch
makes the frames it makes alone). The frame itself is mkport.tts.frames' recipe, with a row a slot.

`FrameBatch` holds up to B requests, one a slot; a request joins (its prompt prefilled into its slot) and leaves
between frames, so each is at its own frame: its EOS suppression (the first frames may not end) is its own row
of the talker's logit bias, its predictor seeds and text rows follow its own frame count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import MkportError
from ..runtime.decoder_api import BatchDecoder
from ..runtime.sampling import GREEDY, SamplingParams
from .limits import fits
from .model import TtsModel
from .frames import FrameRecipe, predictor_sampling
from .pipeline import TtsSampling
from .prompt import Prompt


@dataclass
class _Request:
    prompt: Prompt
    sampling: TtsSampling
    max_frames: int
    frame: int = 0  # frames made so far


class _Rung:
    """One batch size of a FrameBatch: the decoders that step its first `size` slots and the recipe of as many rows."""

    def __init__(self, model: TtsModel, talker: BatchDecoder, predictor: BatchDecoder):
        self.talker, self.predictor, self.size = talker, predictor, talker.batch
        if predictor.batch != self.size:
            raise MkportError(f"a batch size's talker and predictor hold {self.size} and {predictor.batch} sequences")
        self.recipe = FrameRecipe(model, talker, predictor, self.size)  # a row a slot


class FrameBatch:
    """Up to `talker.batch` requests, one a slot, each advanced one frame by every step(). `smaller`: (talker,
    predictor) pairs of fewer sequences whose talkers step this talker's first slots (backends.first_sequences):
    a step then runs the smallest size that holds every slot in use, so a light load pays for a small batch's frame,
    not the largest's. Requests take the lowest free slot (the server's choice), which keeps that size low.
    `invariant`: the sizes' decoders sum a row alike (serve --batch-invariant), so the recipe's own sums must too.
    `wide`: (talker, predictor) pairs of the same sizes on more SMs (the talkers sharing this talker's sequences),
    which queue_frame(wide=True) steps instead: the server's frame lanes, when one lane has the GPU to itself."""

    def __init__(self, model: TtsModel, talker: BatchDecoder, predictor: BatchDecoder, smaller: tuple = (),
                 invariant: bool = False, wide: tuple = ()):
        self.model, self.talker, self.predictor = model, talker, predictor
        self.batch = talker.batch
        self.rungs = sorted([_Rung(model, t, p) for t, p in smaller] + [_Rung(model, talker, predictor)],
                            key=lambda r: r.size)
        self.wide_rungs = sorted([_Rung(model, t, p) for t, p in wide], key=lambda r: r.size)
        for rung in self.rungs:  # a row's next input summed alike at every size (FrameRecipe.ordered_sum)
            rung.recipe.ordered_sum = invariant
        if len({r.size for r in self.rungs}) != len(self.rungs) or self.rungs[-1].size != self.batch:
            raise MkportError(f"a frame batch's smaller sizes must be distinct and below {self.batch}")
        if wide and [r.size for r in self.wide_rungs] != self.sizes:
            raise MkportError(f"a frame batch's wide decoders must have its sizes, {self.sizes}")
        self.recipe = self.rungs[-1].recipe
        self.requests: dict[int, _Request] = {}
        self.inputs = torch.zeros(self.batch, model.talker_spec.input_dim, device=talker.device)
        self._no_text = torch.zeros(model.talker_spec.input_dim, device=talker.device)  # a slot that does not go on
        self.last_size = 0  # the size the last step ran (0: none yet)

    @property
    def sizes(self) -> list[int]:
        return [r.size for r in self.rungs]

    def free_slots(self) -> list[int]:
        return [b for b in range(self.batch) if b not in self.requests]

    def rung(self, wide: bool = False) -> _Rung:
        """The smallest size that holds every slot in use (of the wide decoders, if asked and there are any)."""
        top = max(self.requests, default=0)
        return next(r for r in (self.wide_rungs if wide and self.wide_rungs else self.rungs) if r.size > top)

    def add(self, slot: int, prompt: Prompt, sampling: TtsSampling, max_frames: int) -> None:
        """Puts a request into a free slot: its prompt prefilled, all but the last row, which the next step takes."""
        rows = self.take(slot, prompt, sampling, max_frames)
        try:
            self.talker.prefill_slot(slot, embeds=rows)
        except Exception:
            self.remove(slot)  # a failed prefill leaves the slot free
            raise

    def take(self, slot: int, prompt: Prompt, sampling: TtsSampling, max_frames: int) -> torch.Tensor:
        """add() but the prefill: the request holds the slot, and the prompt's rows to prefill into it (all but the
        last, on the talker's device) are returned, for a prefill of several batches' prompts together
        (Decoder.prefill_prompts); the slot must be prefilled before the next step."""
        if slot in self.requests or not 0 <= slot < self.batch:
            raise MkportError(f"slot {slot} is not a free slot of this batch (0..{self.batch - 1})")
        rows = prompt.embeds.shape[0]
        if not fits(rows, max_frames, self.talker.max_seq):
            raise MkportError(f"a prompt of {rows} positions and max_frames {max_frames} exceed the talker's KV cache "
                              f"({self.talker.max_seq} positions)")
        embeds = prompt.embeds.to(self.talker.device)
        self.talker.reset_slot(slot)
        self.talker.set_suppressed_slot(slot, self.recipe.suppressed(0))
        self.inputs[slot] = embeds[-1]
        self.requests[slot] = _Request(prompt, sampling, max_frames)
        return embeds[:-1]

    def remove(self, slot: int) -> None:
        self.requests.pop(slot, None)

    @torch.no_grad()
    def step(self, while_running=None) -> dict[int, torch.Tensor | None]:
        """One frame of every request: slot -> its 16 codes (CPU int64), or None when it ended at EOS. A request
        leaves its slot when it ends, or after its max_frames-th frame. `while_running()`, if given, runs once the
        frame's work is queued on the device and before its codes are read (the host's work beside the frame; also
        when no request is left)."""
        queued = self.queue_frame() if self.requests else None
        if while_running:
            while_running()
        return self.finish_frame(queued) if queued else {}

    @torch.no_grad()
    def queue_frame(self, wide: bool = False) -> tuple:
        """step()'s first half: the frame's work queued on the current CUDA stream, nothing read back (`wide`: on the
        wide decoders). Pass what it returns to finish_frame(), on the same stream."""
        slots, rung = self.requests, self.rung(wide)
        n, recipe = rung.size, rung.recipe
        self.last_size = n
        for slot, r in slots.items():
            ids = recipe.suppressed(r.frame) if r.frame else None  # add() set frame 0's
            if ids is not None:
                self.talker.set_suppressed_slot(slot, ids)
        talker_samplings, predictor_samplings, active = self.samplings(n)
        self.talker_step(talker_samplings, active, rung)
        return rung, self.predictor_pass(predictor_samplings, rung)

    @torch.no_grad()
    def finish_frame(self, queued: tuple) -> dict[int, torch.Tensor | None]:
        """step()'s second half: the frame's codes read (waiting for its work) and every request moved on."""
        (rung, e0), slots = queued, self.requests
        n, recipe = rung.size, rung.recipe
        host = recipe.codes.cpu()
        text = [self._no_text] * n  # each slot's next text row (the prompt's, on the model's device)
        out = {}
        for slot in list(slots):
            r = slots[slot]
            if int(host[slot, 0]) == recipe.eos:
                out[slot] = None
                self.remove(slot)
                continue
            out[slot] = host[slot].clone()
            text[slot] = r.prompt.text_for_step(r.frame).to(self.inputs.device)
            r.frame += 1
            if r.frame >= r.max_frames:
                self.remove(slot)
        # every stepped slot's next talker input at once (slots that ended or sit idle get one too, unused: add()
        # sets a newcomer's)
        self.inputs[:n] = recipe.next_inputs(e0, torch.stack(text))
        return out

    def samplings(self, n: int | None = None) -> tuple[list[SamplingParams], list[SamplingParams], list[bool]]:
        """This frame's talker and predictor sampling of the first n slots (default all), and which take part (idle
        ones run greedy and stay as they are)."""
        idle, slots, n = GREEDY, self.requests, n or self.batch
        talker = [slots[b].sampling.talker if b in slots else idle for b in range(n)]
        predictor = [predictor_sampling(slots[b].sampling.predictor, slots[b].frame) if b in slots else idle
                     for b in range(n)]
        return talker, predictor, [b in slots for b in range(n)]

    def talker_step(self, sampling: list[SamplingParams], active: list[bool], rung: _Rung | None = None) -> None:
        """The talker's step of the rung's slots (default: all): codebook 0 into its recipe's codes. (step() runs
        it; apart for timing.)"""
        rung = rung or self.rungs[-1]
        rung.recipe.codes[:, 0] = rung.talker.step_batch(embeds=self.inputs[: rung.size], sampling=sampling,
                                                         active=active)

    def predictor_pass(self, sampling: list[SamplingParams], rung: _Rung | None = None) -> torch.Tensor:
        """The code predictor's pass of the rung's slots (default: all) after the talker's step
        (FrameRecipe.predictor_pass). (step() runs it; apart for timing.)"""
        rung = rung or self.rungs[-1]
        return rung.recipe.predictor_pass(rung.predictor, rung.talker.hidden.view(rung.size, -1), sampling)


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

    def step_group(self, g: int, while_running=None) -> dict[int, torch.Tensor | None]:
        """A frame of group g's requests (FrameBatch.step's result, by slot of the groups; `while_running` as
        there)."""
        return {g * self.size + s: codes for s, codes in self.groups[g].step(while_running).items()}

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
