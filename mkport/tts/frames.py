"""The Qwen3-TTS frame recipe, written once for a number of rows (sequences) at a time: the one-sequence loop
(tts.pipeline.generate_frames) runs it with one row, a batch (tts.batch.FrameBatch) with a row a slot.

Per frame k: the talker's token is codebook 0 (c0), with the codec's special ids suppressed (EOS too for the
first MIN_FRAMES frames); the predictor is reset and fed the talker's last final-normed hidden (position 0,
output discarded), then E0(c0) (head 0 -> c1), then for j = 1..14 its own last token through table j-1
(head j -> c_{j+1}), with a seed of frame k's own (frame_seed). The talker's next input is
E0(c0) + sum_i table[i-1](c_i) + the text term for step k (prompt.text_for_step).
"""

from __future__ import annotations

import dataclasses

import torch

from ..runtime.decoder_api import SequenceDecoder
from ..runtime.sampling import GREEDY, SamplingParams

MIN_FRAMES = 2  # EOS is suppressed for the first frames (official min_new_tokens=2)


def frame_seed(seed: int, frame: int) -> int:
    """A distinct seed per frame for the predictor (its step counter restarts at each reset)."""
    return (seed * 1_000_003 + frame * 7919 + 1) & 0x7FFFFFFFFFFFFFFF


def predictor_sampling(sampling: SamplingParams, frame: int) -> SamplingParams:
    """A request's predictor sampling at one of its frames: its own, with the frame's seed."""
    return dataclasses.replace(sampling, seed=frame_seed(sampling.seed, frame))


class FrameRecipe:
    """A frame's work for `rows` sequences on a talker and code predictor (their weights: the embeddings the
    recipe sums). `codes` [rows, 16] holds each row's frame: codebook 0 from the caller's talker step, the others
    from predictor_pass."""

    def __init__(self, model, talker, predictor, rows: int):
        cfg, dev = model.config, talker.device
        self.eos = cfg.codec_eos
        # the codec's special ids (the top 1024 of its vocabulary) but EOS: never a codebook-0 token
        self.special = [i for i in range(cfg.codec_vocab - 1024, cfg.codec_vocab) if i != cfg.codec_eos]
        self.codec_table = talker.weights.embed[0]  # [3072, H] talker codec embedding (E0)
        self.tables = predictor.weights.embed  # [15, 2048, H], pre-projection width
        self._groups = torch.arange(cfg.num_code_groups - 1, device=dev)
        self.codes = torch.zeros(rows, cfg.num_code_groups, dtype=torch.long, device=dev)
        # next_inputs sums the 15 embeddings one after another (elementwise adds: a row's sum whatever the rows)
        # instead of in one reduction, whose kernel torch picks by the tensor's shape (on CUDA it may split the
        # 15 terms by the number of rows); set by a batch-invariant FrameBatch (serve --batch-invariant). On the CPU
        # both give the same bits (torch sums that dimension in order there; tests/test_batch_invariant.py)
        self.ordered_sum = False

    def suppressed(self, frame: int) -> list[int] | None:
        """The ids the talker may not sample from a row's frame `frame` on, where they change (frame 0 and
        MIN_FRAMES); None at the other frames, which keep those before them."""
        if frame == 0:
            return self.special + [self.eos]
        return self.special if frame == MIN_FRAMES else None

    def predictor_pass(self, predictor, hidden: torch.Tensor, sampling) -> torch.Tensor:
        """Codebooks 1..15 of every row into codes[:, 1:], after its codebook 0 in codes[:, 0]. `predictor` steps
        every row at once (step_batch; OneRow for a one-sequence decoder), `hidden` [rows, H] is the talker's
        final-normed state of that step, `sampling` one SamplingParams for all rows or one a row. Returns
        E0(codebook 0) [rows, H], which the talker's next input sums."""
        codes = self.codes
        predictor.reset()
        predictor.step_batch(embeds=hidden, head=0)  # position 0, output unused
        e0 = self.codec_table[codes[:, 0]].float()
        codes[:, 1] = predictor.step_batch(embeds=e0, head=0, sampling=sampling)
        for j in range(1, codes.shape[1] - 1):
            codes[:, j + 1] = predictor.step_batch(table=j - 1, head=j, sampling=sampling)
        return e0

    def next_inputs(self, e0: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Every row's talker input after its frame [rows, H]: E0(c0) from predictor_pass, the embeddings of its
        15 other codes and its text row (`text` [rows, H]). With ordered_sum, the 15 in order, one add each."""
        embeds = self.tables[self._groups, self.codes[:, 1:]].float()
        if not self.ordered_sum:
            return e0 + embeds.sum(1) + text
        total = embeds[:, 0].clone()
        for j in range(1, embeds.shape[1]):
            total += embeds[:, j]
        return e0 + total + text


class OneRow:
    """A one-sequence decoder (reset, step) stepped as a batch of one row (step_batch), with no copies: how the
    one-sequence loop runs the recipe's predictor pass."""

    def __init__(self, decoder: SequenceDecoder):
        self.decoder = decoder

    def reset(self) -> None:
        self.decoder.reset()

    def step_batch(self, embeds: torch.Tensor | None = None, table: int = 0, head: int = 0,
                   sampling: SamplingParams = GREEDY) -> torch.Tensor:
        embed = None if embeds is None else embeds[0]
        return self.decoder.step(embed=embed, table=table, head=head, sampling=sampling)
