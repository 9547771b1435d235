"""mkport's Qwen3-TTS pipeline (prompt, reference frame loop, whole requests) against the official Qwen3-TTS code
(PyPI `qwen-tts-hf`, import name `qwen_tts`) on the same tiny random weights, on CPU.

The official talker (`Qwen3TTSForConditionalGeneration`: talker + code predictor) is built from the tiny
config and loads the same model.safetensors (bf16 -> float32). What is compared:
- the talker prefill embeddings, the trailing text and TP(tts_pad), captured where the official
  `generate` hands them to `talker.generate`, in both text modes, language auto / english, with and without
  a speaker: exactly equal;
- the 16 codes of the first FRAMES frames, greedy, from mkport's `reference` backend and from the official
  `generate` (greedy talker and predictor, repetition penalty 1.0 and the default 1.05): identical, and the
  talker's last hidden state of every frame close (relative L2);
- an injected fault (one code predictor embedding table perturbed in mkport's copy) is caught at the frame
  and codebook it first touches;
- the official inference wrapper: `Qwen3TTSModel.from_pretrained` loads the random model folder (weights,
  text tokenizer, speech tokenizer with its feature extractor, generation config) and its
  `generate_custom_voice` gives the audio of mkport's `synthesize`.

The official code is loaded privately by mkport.tts.official (its docstring says how, and which adaptations
to transformers it makes); none of it is copied here. The codec against the official one:
tests/test_codec_decoder.py.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import official_qwen_tts

warnings.filterwarnings("ignore", category=FutureWarning)
if not official_qwen_tts.installed():
    pytest.skip(official_qwen_tts.SKIP_REASON, allow_module_level=True)

from tolerances import rel  # noqa: E402
from mkport.tts.model import TtsModel, write_random_tts_model  # noqa: E402
from mkport.tts.pipeline import TtsSampling, generate_frames, make_decoders  # noqa: E402
from mkport.tts.prompt import ROLE, SUFFIX, build_prompt  # noqa: E402

FRAMES = 32
TEXT = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def official():
    return official_qwen_tts.load()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny random model. Its tokenizer has `assistant` as one token, so the chat template splits as with
    the Qwen tokenizer (role = 3 tokens, suffix = 5): the official code slices input ids at [:3], [3:4], [4:-5]."""
    return write_random_tts_model(tmp_path_factory.mktemp("tts_official") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def mk(folder):
    model = TtsModel.load(folder)
    assert len(model.encode(ROLE)) == 3 and len(model.encode(SUFFIX)) == 5
    return model


@pytest.fixture(scope="module")
def ref(official, folder):
    """The official Qwen3TTSForConditionalGeneration with the same weights, float32, eager attention."""
    return official_qwen_tts.build_model(folder)


class _Captured(Exception):
    pass


def _official_generate(ref, mk, speaker, language, text_mode, frames, penalty=1.0, capture_only=False):
    """Runs the official generate greedily; returns (codes [frames, 16], talker hidden [frames, H], the
    keyword arguments it handed to talker.generate)."""
    ids = torch.tensor([mk.encode(ROLE + TEXT + SUFFIX)])
    seen = {}
    talker_generate = ref.talker.generate

    def spy(**kwargs):
        seen.update(kwargs)
        if capture_only:
            raise _Captured
        return talker_generate(**kwargs)

    ref.talker.generate = spy
    try:
        codes, hidden = ref.generate(input_ids=[ids], languages=[language], speakers=[speaker],
                                     non_streaming_mode=text_mode == "non-streaming",
                                     max_new_tokens=frames + 1,  # the last c0 never reaches the predictor
                                     do_sample=False, subtalker_dosample=False, repetition_penalty=penalty)
    except _Captured:
        return None, None, seen
    finally:
        del ref.talker.generate
    return codes[0], hidden[0], seen


def _mkport_frames(mk, speaker, language, text_mode, frames, penalty=1.0):
    """(codes [frames, 16], talker hidden [frames, H]) from mkport's reference backend, greedy."""
    prompt = build_prompt(mk.config, mk.encode, mk.text, mk.talker_weights.embed[0], TEXT, speaker, language,
                          None, text_mode)
    greedy = TtsSampling.from_generation_config(mk.generation, greedy=True)
    sampling = TtsSampling(dataclasses.replace(greedy.talker, repetition_penalty=penalty), greedy.predictor)
    talker, predictor = make_decoders(mk, "reference", prompt.embeds.shape[0] + frames + 1, device="cpu")
    codes, hidden = [], []
    # nothing queued ahead of a frame handed out, so the talker's hidden is the one that produced its c0
    for frame in generate_frames(mk, prompt, talker, predictor, sampling, frames, caller_decodes=lambda k: True):
        codes.append(frame)
        hidden.append(talker.hidden.clone())
    return torch.stack(codes), torch.stack(hidden)


def _first_mismatch(a: torch.Tensor, b: torch.Tensor):
    """(frame, codebook) of the first differing code, None if equal; frame counts differ -> (n, None)."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff):
        return tuple(int(x) for x in diff[0])
    return None if len(a) == len(b) else (n, None)


# -- prompt ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text_mode", ["non-streaming", "streaming"])
@pytest.mark.parametrize("language,speaker", [("auto", "vivian"), ("english", "aiden"), ("german", None)])
def test_prompt_equals_official(ref, mk, text_mode, language, speaker):
    _, _, seen = _official_generate(ref, mk, speaker, language, text_mode, 1, capture_only=True)
    prompt = build_prompt(mk.config, mk.encode, mk.text, mk.talker_weights.embed[0], TEXT, speaker, language,
                          None, text_mode)
    official = seen["inputs_embeds"][0]
    assert official.shape == prompt.embeds.shape
    assert torch.allclose(prompt.embeds, official, rtol=1e-5, atol=1e-6 * float(official.abs().max()))
    pad = seen["tts_pad_embed"].reshape(-1)
    assert torch.allclose(prompt.pad, pad, rtol=1e-5, atol=1e-6 * float(pad.abs().max()))
    trailing = seen["trailing_text_hidden"][0]
    if text_mode == "streaming":  # TP(text[1:]) then TP(tts_eos); the pad follows
        assert trailing.shape == prompt.trailing.shape
        assert torch.allclose(prompt.trailing, trailing, rtol=1e-5, atol=1e-6 * float(trailing.abs().max()))
    else:  # the official trailing text is TP(tts_pad) alone; mkport's is empty and every step adds the pad
        assert prompt.trailing.shape[0] == 0 and torch.equal(trailing.reshape(-1), pad)


# -- frame loop -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text_mode,penalty", [("non-streaming", 1.0), ("streaming", 1.0), ("non-streaming", 1.05)])
def test_codes_equal_official(ref, mk, text_mode, penalty):
    speaker = "vivian"
    want, want_hidden, _ = _official_generate(ref, mk, speaker, "auto", text_mode, FRAMES, penalty)
    got, got_hidden = _mkport_frames(mk, speaker, "auto", text_mode, FRAMES, penalty)
    assert want.shape == (FRAMES, 16), "the official run stopped early (EOS)"
    assert len(set(want[:, 0].tolist())) > FRAMES // 2, "degenerate codes: the comparison would prove little"
    where = _first_mismatch(got, want)
    assert where is None, f"first differing code at (frame, codebook) {where}"
    assert rel(got_hidden, want_hidden) < 1e-5


def test_injected_fault_is_located(ref, mk):
    """A perturbed predictor table 3 (it embeds codebook 4, read while predicting codebook 5) leaves codebooks
    0..4 of frame 0 alone and changes the codes from codebook 5 on; the comparison says so."""
    weights = mk.predictor_weights
    embed = weights.embed.clone()
    noise = torch.randn(embed[3].shape, generator=torch.Generator().manual_seed(7))
    embed[3] = (embed[3].float() + 2.0 * embed[3].float().std() * noise).to(embed.dtype)
    faulty = dataclasses.replace(mk, predictor_weights=dataclasses.replace(weights, embed=embed))
    want, _, _ = _official_generate(ref, mk, "vivian", "auto", "non-streaming", 4)
    got, _ = _mkport_frames(faulty, "vivian", "auto", "non-streaming", 4)
    assert _first_mismatch(got, want) == (0, 5)


# -- the official inference wrapper ----------------------------------------------------------------------
def test_official_wrapper_loads_the_random_folder_and_speaks_like_mkport(official, mk, folder):
    """`Qwen3TTSModel.from_pretrained` on the random folder, as a user loads a model (what `mkport bench --tts`
    runs on the GPU): every tensor of model.safetensors and speech_tokenizer/model.safetensors lands in the
    model unchanged, its processor tokenizes the chat template as mkport does, and `generate_custom_voice`
    (greedy) returns the audio of mkport's `synthesize` (reference backend, greedy) for the same text."""
    from safetensors.torch import load_file

    from mkport.tts.pipeline import synthesize

    tts = official.Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32)
    for module, path in ((tts.model, "model.safetensors"),
                         (tts.model.speech_tokenizer.model, "speech_tokenizer/model.safetensors")):
        state = module.state_dict()
        for name, tensor in load_file(str(folder / path)).items():
            assert torch.equal(state[name], tensor.float()), f"{path}: {name}"
    chat = ROLE + TEXT + SUFFIX
    assert tts.processor(text=chat)["input_ids"][0] == mk.encode(chat)
    frames = 6
    wavs, sample_rate = tts.generate_custom_voice(TEXT, speaker="vivian", language="auto", do_sample=False,
                                                  subtalker_dosample=False, max_new_tokens=frames + 1)
    ours = torch.cat(list(synthesize(mk, TEXT, speaker="vivian", greedy=True, max_frames=frames, backend="reference")))
    theirs = torch.as_tensor(wavs[0]).float()
    assert sample_rate == 24000 and theirs.shape == ours.shape == (frames * 1920,)
    assert float(theirs.std()) > 1e-3
    assert rel(ours, theirs) < 1e-4
