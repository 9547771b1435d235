"""Batch-invariant plans on the GPU (issue 29): a sequence's bits are the same alone and among others, whatever the
batch size it runs at, and a stream's PCM the same alone and in slot 3 of a busy `mkport serve --batched
--batch-invariant` (written without a GPU: not yet run).

- the kernel: a talker sequence (random 0.6B weights, a sampled one at a context where a plain batch of 2 splits its
  attention 8 ways) decoded alone (batch 2 invariant to 16, its second row idle: how an invariant server runs a lone
  stream), in slot 1 of 2, slot 2 of 3 live rows of a batch of 4, slot 3 of a full batch of 8 (each invariant to 16),
  and slot 3 of a plain batch of 16: its logits, hidden states and tokens bit for bit the same at every step. The
  plain batch-2 plan gives other bits (the control: without invariance the comparison fails);
- the server: request A alone (slot 0, frames of 2) and in slot 3 beside 3 and beside 7 others (frames of 4 and 8,
  smaller as the others end), its PCM bytes equal; A alone on a --fixed-batch server of 16 (batch 16's own plans,
  the plans the invariant ones follow) is compared and printed (its frame's embedding sum is torch's reduction).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = "qwen3-tts-0.6b-talker"
N = 16
STEPS = 24
MAX_SEQ = 512
TARGET_PROMPT = 150  # a plain batch of 2 splits a sequence's attention 8 ways here, batch 16 takes 1


def _prebuild(spec, plans) -> None:
    """The kernels of `plans`, nvcc side by side (the decoders then load them from the cache)."""
    from mkport.kernel.build import build_libraries
    from mkport.kernel.cache import BUILDS, cache_root
    from mkport.kernel.render import render

    sources = [render(spec, plan).write(cache_root() / BUILDS) for plan in plans]
    build_libraries([(src, "fast") for src in sources], plans[0].arch, os.cpu_count() or 4)


def _run(dec, slot: int, live: int, prompts, samplings):
    """The target (prompts[0], samplings[0]) in `slot`, others in the first `live` slots besides it, the rest idle:
    the target's tokens, logits and hidden states at each step."""
    from mkport.runtime.sampling import GREEDY

    n = dec.batch
    rows = [None] * n  # slot -> index into prompts
    rows[slot] = 0
    others = iter(range(1, len(prompts)))
    for s in range(live):
        if rows[s] is None:
            rows[s] = next(others)
    active = [r is not None for r in rows]
    dec.reset()
    for s, r in enumerate(rows):
        if r is not None:
            dec.prefill_slot(s, tokens=prompts[r][:-1])
    sampling = [samplings[r] if r is not None else GREEDY for r in rows]
    tokens, logits, hiddens = [], [], []
    for step in range(STEPS):
        given = [int(prompts[r][-1]) if step == 0 and r is not None else None for r in rows]
        tok = dec.step_batch(tokens=given, sampling=sampling, active=active)
        tokens.append(int(tok[slot]))
        logits.append(dec.logits.view(n, -1)[slot].clone())
        hiddens.append(dec.hidden.view(n, -1)[slot].clone())
    return tokens, logits, hiddens


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and \
        all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_gpu_a_sequence_has_the_same_bits_alone_and_at_every_batch_invariant_to_16():
    from mkport.kernel.launch_plan import plan_launch
    from mkport.kernel.spec import load_spec
    from mkport.runtime.decoder import Decoder, current_device_target
    from mkport.runtime.sampling import SamplingParams
    from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

    spec = load_spec(SPEC)
    weights = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    target = current_device_target()
    plans = {(b, inv): plan_launch(spec, target, batch=b, invariant_to=inv)
             for b, inv in ((2, N), (4, N), (8, N), (N, 0), (2, 0))}
    _prebuild(spec, list(plans.values()))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 2048, (TARGET_PROMPT if i == 0 else 20 + 9 * i,), generator=gen) for i in range(N)]
    samplings = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7 + i) if i % 2 == 0 else SamplingParams()
                 for i in range(N)]
    decoders = {key: Decoder(spec, weights, MAX_SEQ, plan=plan) for key, plan in plans.items()}
    alone = _run(decoders[2, N], 0, 1, prompts, samplings)
    for (b, inv), slot, live in (((2, N), 1, 2), ((4, N), 2, 3), ((8, N), 3, 8), ((N, 0), 3, N), ((N, 0), 0, 1)):
        got = _run(decoders[b, inv], slot, live, prompts, samplings)
        assert got[0] == alone[0], f"batch {b} (invariant to {inv or b}), slot {slot} of {live} live: other tokens"
        for i, (x, y) in enumerate(zip(got[1], alone[1])):
            assert torch.equal(x, y), (f"batch {b}, slot {slot} of {live} live, step {i}: logits differ from alone "
                                       f"by up to {(x - y).abs().max():.3e}")
        assert all(torch.equal(x, y) for x, y in zip(got[2], alone[2])), f"batch {b}, slot {slot}: hidden states"
    plain = _run(decoders[2, 0], 0, 1, prompts, samplings)
    assert not _same(plain, alone), "the plain batch-2 plan gave the invariant bits: this test would not see a break"


def test_gpu_a_streams_pcm_is_the_same_alone_and_in_slot_3_of_a_busy_invariant_server(monkeypatch):
    from mkport.serve.config import ServeConfig
    from mkport.serve.engine import Engine
    from mkport.serve.streams import SpeechJob
    from mkport.tts.batch import FrameBatch
    from mkport.tts.model import random_model_folder
    from test_serve_load import chunks, serve as serve_jobs

    a = SpeechJob("Hello there, how are you?", None, seed=5, max_frames=30)
    others = [SpeechJob(f"Another sentence, number {i}.", None, seed=10 + i, max_frames=12 + 3 * i) for i in range(7)]
    sizes, engines, real_step = [], [], FrameBatch.step

    def step(self, *args):
        slots = set(self.requests)  # a step with no request leaves last_size as it was
        out = real_step(self, *args)
        if slots and engines and engines[-1].ready:
            sizes.append((slots, self.last_size))
        return out

    monkeypatch.setattr(FrameBatch, "step", step)

    def served(jobs, at: int, **kw) -> list[bytes]:
        config = ServeConfig(folder=random_model_folder("0.6b"), model_id="0.6b", max_streams=N, max_frames=40,
                             batched=True, **kw)
        sizes.clear()
        engines.append(Engine(config))
        return chunks(serve_jobs(engines[-1], jobs, start_s=900)[at])  # the first run builds the kernels

    alone = served([a], 0, batch_invariant=True)
    assert len(alone) == a.max_frames and {n for _, n in sizes} == {2}, sizes  # alone: batch 2, a row idle
    for count in (3, 7):
        jobs = [*others[:3], a, *others[3:count]]  # A joins fourth: slot 3
        loaded = served(jobs, 3, batch_invariant=True)
        with_a = [n for slots, n in sizes if 3 in slots]  # the frames A took part in
        print(f"A in slot 3 beside {count} others: its frames' sizes {sorted(set(with_a))}")
        assert max(with_a) == (4 if count == 3 else 8) and min(with_a) >= 4, sizes
        first = next((i for i, (x, y) in enumerate(zip(alone, loaded)) if x != y), None)
        assert loaded == alone, f"A in slot 3 beside {count} others: chunk {first} of {len(alone)} differs from alone"
    # printed, not promised: a --fixed-batch server sums a frame's 15 embeddings in one torch reduction, which on CUDA
    # may order them otherwise than the invariant server's adds (FrameRecipe.ordered_sum); its kernels are batch 16's
    fixed = served([a], 0, sized_batches=False)
    print("A alone at a fixed batch of 16: " + ("the same bytes" if fixed == alone else "other bytes, from chunk "
          f"{next((i for i, (x, y) in enumerate(zip(alone, fixed)) if x != y), None)}"))
