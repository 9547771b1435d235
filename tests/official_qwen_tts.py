"""The official Qwen3-TTS code as the tests' oracle: the models built from a model folder's files, loading the
same safetensors as mkport. mkport.tts.official imports the package (its docstring says how and which
adaptations to transformers it makes); nothing of it is copied here."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch

from mkport.tts.official import NOT_INSTALLED, installed, load  # noqa: F401 (the tests' names)

SKIP_REASON = NOT_INSTALLED


def build_model(folder: Path, device="cpu"):
    """The official Qwen3TTSForConditionalGeneration (talker + code predictor) built from the folder's
    config.json, holding its model.safetensors (bf16 -> float32), eager attention, on `device`."""
    from safetensors.torch import load_file

    official = load()
    config = official.configuration.Qwen3TTSConfig(**json.loads((Path(folder) / "config.json").read_text()))
    config._attn_implementation = "eager"
    model = official.modeling.Qwen3TTSForConditionalGeneration(config).eval()
    state = {k: v.float() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    return model.to(device)


def build_codec_decoder(speech_tokenizer: Path, device="cpu"):
    """The official 12 Hz decoder (`Qwen3TTSTokenizerV2Decoder`, float32, sdpa attention as it ships)
    built from speech_tokenizer/config.json, holding every `decoder.*` tensor of its model.safetensors."""
    from safetensors.torch import load_file

    official = load()
    raw = json.loads((Path(speech_tokenizer) / "config.json").read_text())
    config = official.codec_configuration.Qwen3TTSTokenizerV2DecoderConfig(**raw["decoder_config"])
    decoder = official.codec_modeling.Qwen3TTSTokenizerV2Decoder._from_config(config).eval()
    tensors = load_file(str(Path(speech_tokenizer) / "model.safetensors"))
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in tensors.items()}, strict=True)
    return decoder.to(device).float()


@torch.no_grad()
def codec_decode(decoder, speech_tokenizer: Path, codes: torch.Tensor) -> torch.Tensor:
    """codes [T, 16] -> [T * 1920] float32 through the official `Qwen3TTSTokenizerV2Model.decode` (clamp,
    [B, T, 16] -> [B, 16, T], `chunked_decode` with its 25-frame left context between 300-frame chunks,
    trim), run on `decoder`. The full tokenizer model is not built: its Mimi encoder does not construct under
    transformers 5.24, and decode only touches `decoder`, `decode_upsample_rate` and `config.return_dict`."""
    official = load()
    raw = json.loads((Path(speech_tokenizer) / "config.json").read_text())
    stand_in = types.SimpleNamespace(decoder=decoder, decode_upsample_rate=raw["decode_upsample_rate"],
                                     config=types.SimpleNamespace(return_dict=False))
    device = next(decoder.parameters()).device
    (wavs,) = official.codec_modeling.Qwen3TTSTokenizerV2Model.decode(stand_in, codes[None].to(device))
    return wavs[0].float()
