"""The official Qwen3-TTS code (PyPI `qwen-tts-hf`, import name `qwen_tts`) made importable and runnable here:
every private import and every adaptation to the installed transformers, in one place.

Used by `mkport bench-tts` (the official and faster-qwen3-tts baselines) and by the tests, where the
official code is the oracle. `mkport speak` never imports this module: its codec is mkport's own
(codec_decoder.py). Install the package with `pip install --no-deps qwen-tts-hf==0.1.1.post1`: its declared
dependencies pull gradio, onnxruntime and torchaudio (which pins another torch).

`import qwen_tts` runs the package `__init__`, which imports the 25 Hz tokenizer and its dependencies (sox,
onnxruntime, torchaudio, einops) and the inference wrapper's (librosa, soundfile). A 12 Hz model needs none
of them, so `load()` imports the modules under a private package name, without any package `__init__`:
- `core/models/{configuration,modeling,processing}_qwen3_tts.py` (the model and its processor);
- `core/tokenizer_12hz/*` (the 12 Hz speech tokenizer) and `core/tokenizer_25hz/configuration_*` (only
  registered by the wrapper); the 25 Hz model is a placeholder that refuses to be built;
- `inference/{qwen3_tts_tokenizer,qwen3_tts_model}.py` (the `Qwen3TTSModel` wrapper and its
  `from_pretrained`).
librosa and soundfile are stubbed while these modules are imported, only where they are not installed,
and removed from sys.modules right after; nothing on the 12 Hz CustomVoice path calls them. The
FutureWarnings the official modules raise about transformers' renamed arguments are silenced.

Adaptations to the installed transformers, each applied only where that version needs it:
- transformers 5 dropped the "default" RoPE initialiser; the package's own `_transformers_compat.py`
  registers one (as its `__init__` does first).
- transformers 5.17's Mimi config has `rope_parameters` but no `rope_theta`, which that "default"
  initialiser reads when from_pretrained initialises the encoder's rotary buffers (random speech tokenizers
  hold decoder weights only): `adapt_rope_shim`.
- transformers >= 5.24 renamed the cache argument and output field `past_key_values` to `cache`; the
  official talker and code predictor still use the old name (`generate` then fails): `adapt_cache_name`.
- transformers >= 5.24 moved Mimi's decoder parts behind read-only properties and dropped `rope_theta` from
  its encoder config, so the speech tokenizer's encoder (Mimi, used only to encode reference audio for Base
  models) cannot be constructed: `adapt_speech_encoder` builds an empty module in its place.
- transformers >= 5.25's AutoModel passes `_from_auto` both among the hub arguments and in the model class's
  keyword arguments; the official model's from_pretrained forwards those to the speech tokenizer's
  `AutoModel.from_pretrained`, which then gets `_from_auto` twice (TypeError): `adapt_auto_kwargs` drops the
  forwarded one (AutoModel sets it again itself, so older versions see no change).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import types
import warnings
from pathlib import Path

import torch

ALIAS = "_mkport_qwen_tts"
INSTALL = "pip install --no-deps qwen-tts-hf==0.1.1.post1"
NOT_INSTALLED = f"the official Qwen3-TTS code is not installed ({INSTALL})"
_loaded: types.SimpleNamespace | None = None


def installed() -> bool:
    return importlib.util.find_spec("qwen_tts") is not None


def load() -> types.SimpleNamespace:
    """configuration, modeling (the model), codec_configuration, codec_modeling (12 Hz speech tokenizer),
    Qwen3TTSModel (the inference wrapper) and encoder_adapted, imported once per process. ImportError when
    the package is not installed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    spec = importlib.util.find_spec("qwen_tts")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(NOT_INSTALLED)
    root = Path(list(spec.submodule_search_locations)[0])
    compat_spec = importlib.util.spec_from_file_location(ALIAS + "_compat", root / "_transformers_compat.py")
    compat = importlib.util.module_from_spec(compat_spec)
    compat_spec.loader.exec_module(compat)
    compat.patch_transformers_rope_registry()
    adapt_rope_shim()
    warnings.filterwarnings("ignore", category=FutureWarning, module=re.escape(ALIAS))
    packages = {sub: _package(ALIAS + sub, root.joinpath(*sub.split(".")[1:]))
                for sub in ("", ".core", ".core.models", ".core.tokenizer_12hz", ".core.tokenizer_25hz", ".inference")}
    # imported before the stubs go in: transformers probes for soundfile with find_spec, which a stub fails
    importlib.import_module("transformers.processing_utils")
    importlib.import_module("transformers.models.mimi.modeling_mimi")
    stubs = _missing_module_stubs()
    sys.modules.update(stubs)
    try:
        imp = lambda name: importlib.import_module(ALIAS + name)  # noqa: E731
        codec_cfg = imp(".core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2")
        codec_mod = imp(".core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2")
        v1_cfg = imp(".core.tokenizer_25hz.configuration_qwen3_tts_tokenizer_v1")

        class Qwen3TTSTokenizerV1Model:  # the 25 Hz tokenizer model needs sox, onnxruntime, torchaudio
            config_class = v1_cfg.Qwen3TTSTokenizerV1Config

            def __init__(self, *args, **kwargs):
                raise RuntimeError("the 25 Hz speech tokenizer is not loaded by mkport")

        core = packages[".core"]
        core.Qwen3TTSTokenizerV1Config = v1_cfg.Qwen3TTSTokenizerV1Config
        core.Qwen3TTSTokenizerV1Model = Qwen3TTSTokenizerV1Model
        core.Qwen3TTSTokenizerV2Config = codec_cfg.Qwen3TTSTokenizerV2Config
        core.Qwen3TTSTokenizerV2Model = codec_mod.Qwen3TTSTokenizerV2Model
        speech_tokenizer = imp(".inference.qwen3_tts_tokenizer")
        configuration = imp(".core.models.configuration_qwen3_tts")
        modeling = imp(".core.models.modeling_qwen3_tts")
        processing = imp(".core.models.processing_qwen3_tts")
        models = packages[".core.models"]
        models.Qwen3TTSConfig = configuration.Qwen3TTSConfig
        models.Qwen3TTSForConditionalGeneration = modeling.Qwen3TTSForConditionalGeneration
        models.Qwen3TTSProcessor = processing.Qwen3TTSProcessor
        wrapper = imp(".inference.qwen3_tts_model")
    finally:
        for name in stubs:
            del sys.modules[name]
    adapt_cache_name(modeling)
    adapt_auto_kwargs(speech_tokenizer.Qwen3TTSTokenizer)
    encoder_adapted = adapt_speech_encoder(codec_mod)
    _loaded = types.SimpleNamespace(configuration=configuration, modeling=modeling, codec_configuration=codec_cfg,
                                    codec_modeling=codec_mod, Qwen3TTSModel=wrapper.Qwen3TTSModel,
                                    encoder_adapted=encoder_adapted)
    return _loaded


def _package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules.setdefault(name, mod)
    return sys.modules[name]


def _missing_module_stubs() -> dict[str, types.ModuleType]:
    """Stand-ins for librosa (mel filters: speaker encoder of Base models) and soundfile (reading reference
    audio), for the modules that import them at module level; only for the ones not installed."""

    def unavailable(*args, **kwargs):
        raise RuntimeError("stub: not installed here, and not used on the 12 Hz CustomVoice path")

    stubs = {}
    if importlib.util.find_spec("librosa") is None:
        filters = types.ModuleType("librosa.filters")
        filters.mel = unavailable
        librosa = types.ModuleType("librosa")
        librosa.__path__ = []
        librosa.filters, librosa.load = filters, unavailable
        stubs.update({"librosa": librosa, "librosa.filters": filters})
    if importlib.util.find_spec("soundfile") is None:
        soundfile = types.ModuleType("soundfile")
        soundfile.read = unavailable
        stubs["soundfile"] = soundfile
    return stubs


class _RopeThetaFromParameters:
    """A config whose `rope_theta` comes from `rope_parameters` (see adapt_rope_shim)."""

    def __init__(self, config):
        self._config = config

    @property
    def rope_theta(self):
        return self._config.rope_parameters["rope_theta"]

    def __getattr__(self, name):
        return getattr(self._config, name)


def adapt_rope_shim() -> bool:
    """qwen-tts-hf 0.1.1 registers a "default" RoPE initialiser in transformers' global registry that reads
    `config.rope_theta`. transformers 5.17's Mimi config keeps it only in `rope_parameters`, so loading a
    speech tokenizer whose encoder weights are absent (ours: CustomVoice never encodes audio), where
    transformers initialises the missing rotary buffers through that registry, fails with "'MimiConfig' object
    has no attribute 'rope_theta'". The registered function is wrapped to read rope_parameters where the
    attribute is missing; where it exists nothing changes. Returns whether it wrapped."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shim = ROPE_INIT_FUNCTIONS.get("default")
    if shim is None or getattr(shim, "reads_rope_parameters", False):
        return False

    def default(config, *args, **kwargs):
        try:
            config.rope_theta
        except AttributeError:
            config = _RopeThetaFromParameters(config)
        return shim(config, *args, **kwargs)

    default.reads_rope_parameters = True
    ROPE_INIT_FUNCTIONS["default"] = default
    return True


def adapt_cache_name(modeling) -> None:
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


def adapt_auto_kwargs(tokenizer_class) -> None:
    """The official `Qwen3TTSTokenizer.from_pretrained` forwards its keyword arguments to
    `AutoModel.from_pretrained`; the `_from_auto` marker among them (put there by the outer AutoModel) is
    dropped, since AutoModel adds its own (transformers >= 5.25 then raises on the duplicate)."""
    load = tokenizer_class.from_pretrained.__func__

    @functools.wraps(load)
    def adapted(cls, *args, **kwargs):
        kwargs.pop("_from_auto", None)
        return load(cls, *args, **kwargs)

    tokenizer_class.from_pretrained = classmethod(adapted)


def adapt_speech_encoder(codec_modeling) -> bool:
    """Where Mimi's `upsample` is a read-only property (transformers >= 5.24), the official
    `Qwen3TTSTokenizerV2Encoder.__init__` cannot run; the private copy then gets an empty encoder. Returns
    whether it adapted."""
    from transformers.models.mimi.modeling_mimi import MimiModel

    if not isinstance(inspect.getattr_static(MimiModel, "upsample", None), property):
        return False

    class EncoderNotBuilt(torch.nn.Module):
        @classmethod
        def _from_config(cls, config, **kwargs):
            return cls()

    codec_modeling.Qwen3TTSTokenizerV2Encoder = EncoderNotBuilt
    return True
