"""mkport's Qwen3-TTS pipeline (prompt, reference frame loop, codec) against the official Qwen3-TTS code
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
- the codec: mkport's decode and streamed decode against the official `Qwen3TTSTokenizerV2Model.decode`.

How the official code is loaded (none of it is copied here):
- `import qwen_tts` would run the package `__init__`, which needs librosa, soundfile, sox, onnxruntime and
  torchaudio. Only `core/models/{configuration,modeling}_qwen3_tts.py` are imported, under a private package
  name, as mkport.tts.codec does for the 12 Hz decoder.
- modeling_qwen3_tts.py imports two things at module level that the talker never uses: `librosa.filters.mel`
  (the speaker encoder's mel spectrogram, Base models only) and `Qwen3TTSTokenizer` from the inference
  package (used by `from_pretrained` only). Both are stubbed while the module is imported: the tokenizer
  under the private package name only, librosa only if it is not installed, and removed from sys.modules
  right after the import.
- transformers >= 5.24 renamed the cache argument and output field `past_key_values` to `cache`; qwen-tts-hf
  0.1.1.post1 still uses the old name in its two generation entry points and their output dataclasses
  (`generate` then crashes). `_adapt_cache_name` adapts the private copies of those classes only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)
if importlib.util.find_spec("qwen_tts") is None:
    pytest.skip("the official Qwen3-TTS code is not installed (pip install --no-deps qwen-tts-hf==0.1.1.post1)",
                allow_module_level=True)

from mkport.tts import codec as mkcodec  # noqa: E402
from mkport.tts.model import TtsModel, write_char_tokenizer, write_random_tts_model  # noqa: E402
from mkport.tts.pipeline import TtsSampling, generate_frames, make_decoders  # noqa: E402
from mkport.tts.prompt import ROLE, SUFFIX, build_prompt  # noqa: E402

FRAMES = 32
TEXT = "Hello there, how are you today?"
ALIAS = "_mkport_test_qwen_tts"


# -- the official code, loaded privately -----------------------------------------------------------------
def _package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    return mod


def _adapt_cache_name(modeling) -> None:
    """transformers >= 5.24 passes the KV cache as `cache=` and reads `outputs["cache"]`; the official talker
    and code predictor take `past_key_values=` and return it in dataclasses with a `past_key_values` field
    (which transformers' ModelOutput renames on construction, so building them raises TypeError)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.utils.generic import ModelOutput

    if "cache" not in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}:
        return  # transformers < 5.24: nothing to adapt
    for name in ("Qwen3TTSTalkerOutputWithPast", "Qwen3TTSTalkerCodePredictorOutputWithPast"):
        old = getattr(modeling, name)
        fields = [("cache" if f.name == "past_key_values" else f.name, f.type, dataclasses.field(default=None))
                  for f in dataclasses.fields(old)]
        setattr(modeling, name, dataclasses.make_dataclass(name, fields, bases=(ModelOutput,),
                                                           namespace={"__module__": modeling.__name__}))
    for name in ("Qwen3TTSTalkerForConditionalGeneration", "Qwen3TTSTalkerCodePredictorModelForConditionalGeneration"):
        cls = getattr(modeling, name)
        forward = cls.forward

        @functools.wraps(forward)
        def adapted(self, *args, _forward=forward, cache=None, **kwargs):
            if cache is not None:
                kwargs["past_key_values"] = cache
            return _forward(self, *args, **kwargs)

        cls.forward = adapted


@pytest.fixture(scope="module")
def official():
    """(configuration, modeling) of the official Qwen3-TTS model and (configuration, modeling) of its 12 Hz
    speech tokenizer, all loaded privately."""
    codec_modules = mkcodec.official_modules()  # also registers the transformers-5 "default" rope
    root = Path(list(importlib.util.find_spec("qwen_tts").submodule_search_locations)[0])
    for sub in ("", ".core", ".core.models", ".inference"):
        sys.modules.setdefault(ALIAS + sub, _package(ALIAS + sub, root.joinpath(*sub.split(".")[1:])))

    class _NoSpeechTokenizer:  # Qwen3TTSTokenizer: only from_pretrained uses it
        pass

    tok = types.ModuleType(ALIAS + ".inference.qwen3_tts_tokenizer")
    tok.Qwen3TTSTokenizer = _NoSpeechTokenizer
    sys.modules[tok.__name__] = tok
    stubs = {}
    if importlib.util.find_spec("librosa") is None:

        def mel(*args, **kwargs):
            raise RuntimeError("librosa stub: the speaker encoder's mel spectrogram is not available in this test")

        filters = types.ModuleType("librosa.filters")
        filters.mel = mel
        librosa = types.ModuleType("librosa")
        librosa.__path__ = []
        librosa.filters = filters
        stubs = {"librosa": librosa, "librosa.filters": filters}
    sys.modules.update(stubs)
    try:
        configuration = importlib.import_module(ALIAS + ".core.models.configuration_qwen3_tts")
        modeling = importlib.import_module(ALIAS + ".core.models.modeling_qwen3_tts")
    finally:
        for name in stubs:
            del sys.modules[name]
    _adapt_cache_name(modeling)
    return configuration, modeling, codec_modules


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny random model, with `assistant` as one token so that the chat template splits as with the Qwen
    tokenizer (role = 3 tokens, suffix = 5): the official code slices input ids at [:3], [3:4], [4:-5]."""
    folder = write_random_tts_model(tmp_path_factory.mktemp("tts_official") / "tiny", "tiny", seed=0)
    cfg = json.loads((folder / "config.json").read_text())
    names = {"<|im_start|>": "im_start_token_id", "<|im_end|>": "im_end_token_id", "<|tts_pad|>": "tts_pad_token_id",
             "<|tts_text_bos|>": "tts_bos_token_id", "<|tts_text_eod|>": "tts_eos_token_id"}
    write_char_tokenizer(folder, {**{k: cfg[v] for k, v in names.items()}, "assistant": 261})
    return folder


@pytest.fixture(scope="module")
def mk(folder):
    model = TtsModel.load(folder)
    assert len(model.encode(ROLE)) == 3 and len(model.encode(SUFFIX)) == 5
    return model


@pytest.fixture(scope="module")
def ref(official, folder):
    """The official Qwen3TTSForConditionalGeneration with the same weights, float32, eager attention."""
    from safetensors.torch import load_file

    configuration, modeling, _ = official
    config = configuration.Qwen3TTSConfig(**json.loads((folder / "config.json").read_text()))
    config._attn_implementation = "eager"
    model = modeling.Qwen3TTSForConditionalGeneration(config).eval()
    state = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    return model


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
    for frame in generate_frames(mk, prompt, talker, predictor, sampling, frames):
        codes.append(frame)
        hidden.append(talker.hidden.clone())  # the talker state that produced this frame's c0
    return torch.stack(codes), torch.stack(hidden)


def _first_mismatch(a: torch.Tensor, b: torch.Tensor):
    """(frame, codebook) of the first differing code, None if equal; frame counts differ -> (n, None)."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff):
        return tuple(int(x) for x in diff[0])
    return None if len(a) == len(b) else (n, None)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


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
    assert _rel(got_hidden, want_hidden) < 1e-5


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


# -- codec ----------------------------------------------------------------------------------------------
def test_codec_equals_official_decode(official, mk, folder):
    """mkport's SpeechDecoder (whole and streamed) against the official Qwen3TTSTokenizerV2Model.decode
    (clamp, [B, T, 16] -> [B, 16, T], chunked_decode with its 25-frame left context, trim), run on a separately
    built official decoder. The full tokenizer model is not built: its Mimi encoder does not construct under
    transformers 5.24, and decode only touches `decoder`, `decode_upsample_rate` and `config.return_dict`."""
    from safetensors.torch import load_file

    cfg_mod, codec_mod = official[2]
    raw = json.loads((folder / "speech_tokenizer" / "config.json").read_text())
    decoder = codec_mod.Qwen3TTSTokenizerV2Decoder._from_config(
        cfg_mod.Qwen3TTSTokenizerV2DecoderConfig(**raw["decoder_config"])).eval()
    tensors = load_file(str(folder / "speech_tokenizer" / "model.safetensors"))
    state = {k[len("decoder."):]: v for k, v in tensors.items()}
    decoder.load_state_dict(state, strict=True)
    stand_in = types.SimpleNamespace(decoder=decoder, decode_upsample_rate=raw["decode_upsample_rate"],
                                     config=types.SimpleNamespace(return_dict=False))
    codes = torch.randint(0, 2048, (40, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        (want,) = codec_mod.Qwen3TTSTokenizerV2Model.decode(stand_in, codes[None])
    want = want[0].float()
    whole = mk.codec.decode(codes)
    streamed = torch.cat(list(mkcodec.stream_decode(mk.codec, codes)))
    assert whole.shape == want.shape == streamed.shape == (40 * 1920,)
    assert float(want.std()) > 1e-3
    assert _rel(whole, want) < 1e-5
    assert _rel(streamed, want) < 1e-2
