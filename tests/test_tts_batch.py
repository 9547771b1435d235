"""Several Qwen3-TTS requests in lockstep (mkport.tts.batch) on CPU, reference backend: each request of a batch
makes exactly the frames it makes alone, whatever its neighbours, prompt length, seed, max_frames or EOS."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import eager_to_stop, join_and_leave
from mkport.errors import MkportError

warnings.filterwarnings("ignore", category=FutureWarning)

from mkport.tts.batch import generate_frames_batch  # noqa: E402
from mkport.tts.model import TtsModel, write_random_tts_model  # noqa: E402
from mkport.runtime.torch_decoder import DecoderBatch, TorchDecoder  # noqa: E402
from mkport.tts.pipeline import TtsSampling, generate_frames, make_decoders  # noqa: E402
from mkport.tts.prompt import build_prompt  # noqa: E402

TEXTS = ["Hi there", "A somewhat longer sentence to say.", "Three", "Why not?"]
MAX_SEQ = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return TtsModel.load(write_random_tts_model(tmp_path_factory.mktemp("tts_batch") / "tiny", "tiny", seed=0))


def _prompt(tiny, text, text_mode="non-streaming"):
    return build_prompt(tiny.config, tiny.encode, tiny.text, tiny.talker_weights.embed[0], text, "vivian",
                        text_mode=text_mode)


def _assert_each_as_alone(tiny, got: dict, prompts, samplings, max_frames) -> None:
    """Request b's frames in `got` are all max_frames[b] of the frames it makes alone."""
    for b in got:
        alone = _alone(tiny, prompts[b], samplings[b], max_frames[b])
        assert len(got[b]) == len(alone) == max_frames[b], (b, len(got[b]))
        assert all(torch.equal(x, y) for x, y in zip(got[b], alone)), f"request {b} differs from it alone"


def _alone(tiny, prompt, sampling, max_frames, talker_class=TorchDecoder):
    talker = talker_class(tiny.talker_spec, tiny.talker_weights, MAX_SEQ)
    predictor = TorchDecoder(tiny.predictor_spec, tiny.predictor_weights, 17)
    return list(generate_frames(tiny, prompt, talker, predictor, sampling, max_frames, prefix_cache=None))


def _per_request(frames_batch, count):
    out = [[] for _ in range(count)]
    for frame in frames_batch:
        assert len(frame) == count
        for b, codes in enumerate(frame):
            if codes is not None:
                assert len(out[b]) == 0 or out[b][-1] is not None, "a request came back after it ended"
                out[b].append(codes)
    return out


def test_each_request_of_a_batch_makes_its_frames_alone(tiny):
    # streaming text mode: each request's talker input carries its own text, frame after frame
    prompts = [_prompt(tiny, t, "streaming") for t in TEXTS[:3]]
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s, greedy=g)
                 for s, g in ((3, False), (8, False), (5, True))]
    max_frames = [6, 4, 7]
    talker, predictor = make_decoders(tiny, "reference", MAX_SEQ, batch=4, device="cpu")  # one slot idle
    got = _per_request(generate_frames_batch(tiny, prompts, talker, predictor, samplings, max_frames), 3)
    for b in range(3):
        want = _alone(tiny, prompts[b], samplings[b], max_frames[b])
        assert len(got[b]) == len(want) == max_frames[b]
        assert all(torch.equal(x, y) for x, y in zip(got[b], want)), f"request {b} differs from it alone"
    assert {tuple(f[0].tolist()) for f in got} != {tuple(got[0][0].tolist())}  # the requests differ


@pytest.mark.parametrize("text_mode, greedy, eager", [("streaming", False, False), ("non-streaming", True, False),
                                                      ("streaming", False, True)])
def test_a_batch_of_one_is_the_one_sequence_loop(tiny, text_mode, greedy, eager):
    """The one-sequence loop (generate_frames) and a batch (FrameBatch) run one frame recipe (tts.frames) on their
    own schedules; a batch of one makes the one-sequence loop's frames bit for bit, past the frames whose EOS is
    suppressed: the same text rows, predictor seeds and suppression at each frame, and the same end (eager: the
    talker picks EOS as soon as it may)."""
    talker_class = eager_to_stop(tiny.config.codec_eos) if eager else TorchDecoder
    prompt = _prompt(tiny, TEXTS[1], text_mode)
    sampling = TtsSampling.from_generation_config(tiny.generation, seed=11, greedy=greedy)
    talker = DecoderBatch([talker_class(tiny.talker_spec, tiny.talker_weights, MAX_SEQ)])
    predictor = make_decoders(tiny, "reference", MAX_SEQ, batch=1, device="cpu")[1]
    got = [f[0] for f in generate_frames_batch(tiny, [prompt], talker, predictor, [sampling], [9]) if f[0] is not None]
    alone = _alone(tiny, prompt, sampling, 9, talker_class)
    assert len(got) == len(alone) == (2 if eager else 9)
    assert all(torch.equal(x, y) for x, y in zip(got, alone)), "a batch of one differs from the one-sequence loop"


def test_a_request_that_ends_at_eos_leaves_the_others_running(tiny):
    """Request 1's talker picks EOS as soon as it may (frame 2); the others go on, unchanged."""
    EagerToStop = eager_to_stop(tiny.config.codec_eos)
    prompts = [_prompt(tiny, t) for t in TEXTS[:3]]
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s) for s in (1, 2, 3)]
    talkers = [TorchDecoder(tiny.talker_spec, tiny.talker_weights, MAX_SEQ) for _ in range(3)]
    talkers[1] = EagerToStop(tiny.talker_spec, tiny.talker_weights, MAX_SEQ)
    predictor = DecoderBatch([TorchDecoder(tiny.predictor_spec, tiny.predictor_weights, 17) for _ in range(3)])
    got = _per_request(generate_frames_batch(tiny, prompts, DecoderBatch(talkers), predictor, samplings, [5, 5, 5]), 3)
    assert [len(f) for f in got] == [5, 2, 5]
    alone = [_alone(tiny, prompts[b], samplings[b], 5, EagerToStop if b == 1 else TorchDecoder) for b in range(3)]
    assert [len(f) for f in alone] == [5, 2, 5]
    for b in range(3):
        assert all(torch.equal(x, y) for x, y in zip(got[b], alone[b])), f"request {b} differs from it alone"


def test_batch_arguments_are_checked(tiny):
    talker, predictor = make_decoders(tiny, "reference", MAX_SEQ, batch=2, device="cpu")
    prompts = [_prompt(tiny, t) for t in TEXTS[:3]]
    sampling = TtsSampling.from_generation_config(tiny.generation, seed=0)
    with pytest.raises(MkportError, match="a batch of 2 takes 1 to 2 requests"):
        next(generate_frames_batch(tiny, prompts, talker, predictor, [sampling] * 3, [4] * 3))
    with pytest.raises(MkportError, match="request 0: a prompt of .* positions and max_frames"):
        next(generate_frames_batch(tiny, prompts[:1], talker, predictor, [sampling], [MAX_SEQ]))
    with pytest.raises(MkportError, match="backend 'warp' is not supported"):
        make_decoders(tiny, "warp", MAX_SEQ, batch=2)


def test_requests_join_and_leave_between_frames(tiny):
    """FrameBatch as a server uses it: request 0 starts alone, request 1 joins at its fourth frame, request 2
    takes request 0's slot once it is done. Each is at its own frame (its own EOS suppression, predictor seeds
    and text rows) and makes the frames it makes alone."""
    from mkport.tts.batch import FrameBatch

    prompts = [_prompt(tiny, t, "streaming") for t in TEXTS[:3]]
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s) for s in (4, 5, 6)]
    max_frames = [5, 7, 4]
    talker, predictor = make_decoders(tiny, "reference", MAX_SEQ, batch=2, device="cpu")
    frames = FrameBatch(tiny, talker, predictor)
    got = join_and_leave(frames, prompts, samplings, max_frames)
    _assert_each_as_alone(tiny, got, prompts, samplings, max_frames)
    with pytest.raises(MkportError, match="slot 5 is not a free slot"):
        frames.add(5, prompts[0], samplings[0], 3)


def test_frame_groups_serve_more_requests_than_one_batch_holds(tiny):
    """Two batches of two slots as one batch of four (FrameGroups): slots are offered group by group, a frame steps
    only the groups with requests, and each request makes the frames it makes alone."""
    from mkport.tts.batch import FrameBatch, FrameGroups

    groups = FrameGroups([FrameBatch(tiny, *make_decoders(tiny, "reference", MAX_SEQ, batch=2, device="cpu"))
                          for _ in range(2)])
    assert groups.batch == 4 and groups.free_slots() == [0, 1, 2, 3]
    prompts = [_prompt(tiny, t) for t in TEXTS[:3]]
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s) for s in (7, 8, 9)]
    max_frames = [4, 6, 5]
    groups.add(0, prompts[0], samplings[0], max_frames[0])
    stepped = []
    second = groups.groups[1]
    second.step = lambda step=second.step: stepped.append(1) or step()
    got = {b: [] for b in range(3)}
    for turn in range(20):
        if turn == 2:  # two more requests: the first group's free slot, then the second group's
            assert groups.free_slots()[:2] == [1, 2]
            groups.add(1, prompts[1], samplings[1], max_frames[1])
            groups.add(2, prompts[2], samplings[2], max_frames[2])
        for slot, codes in groups.step().items():
            if codes is not None:
                got[slot].append(codes)
        if not groups.requests:
            break
    assert len(stepped) == max_frames[2]  # the second group ran only while its request did
    _assert_each_as_alone(tiny, got, prompts, samplings, max_frames)
    with pytest.raises(MkportError, match="slot 4 is not a slot of these groups"):
        groups.add(4, prompts[0], samplings[0], 3)


def test_a_frame_batch_steps_the_smallest_size_that_holds_its_slots(tiny):
    """A batch of four with sizes 1 and 2 below it (backends.first_sequences: the same slots' state): each step runs
    the smallest size past the highest slot in use, as requests join and leave, and each request still makes the
    frames it makes alone."""
    from mkport.runtime.backends import first_sequences
    from mkport.tts.batch import FrameBatch

    talker, predictor = make_decoders(tiny, "reference", MAX_SEQ, batch=4, device="cpu")
    smaller = [(first_sequences(talker, b), make_decoders(tiny, "reference", MAX_SEQ, batch=b, device="cpu")[1])
               for b in (1, 2)]
    frames = FrameBatch(tiny, talker, predictor, smaller)
    assert frames.sizes == [1, 2, 4] and smaller[1][0].decoders == talker.decoders[:2]
    prompts = [_prompt(tiny, t) for t in TEXTS[:3]]
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s) for s in (3, 4, 5)]
    max_frames = [6, 3, 2]
    got, sizes = {b: [] for b in range(3)}, []
    frames.add(0, prompts[0], samplings[0], max_frames[0])
    for turn in range(12):
        if turn == 1:
            frames.add(1, prompts[1], samplings[1], max_frames[1])
        if turn == 2:
            frames.add(2, prompts[2], samplings[2], max_frames[2])
        step = frames.step()
        sizes.append(frames.last_size)
        for slot, codes in step.items():
            got[slot].append(codes)
        if not frames.requests:
            break
    # slot 0 alone: 1; with slot 1: 2; with slot 2: 4 until slots 1 and 2 have left (turn 3), then 1 again
    assert sizes == [1, 2, 4, 4, 1, 1], sizes
    _assert_each_as_alone(tiny, got, prompts, samplings, max_frames)
    with pytest.raises(MkportError, match="smaller sizes must be distinct and below 4"):
        FrameBatch(tiny, talker, predictor, [smaller[0], smaller[0]])
