"""The talker's prefill input, built as the official Qwen3-TTS `generate` builds it (single utterance,
CustomVoice / VoiceDesign, no voice-clone prompt).

Text string: `<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n`; its first tokens up to
and including `assistant\n` are the role, the last ones from `<|im_end|>` on the suffix (3 and 5 tokens
with the Qwen tokenizer), the rest the text. TP(ids) = text_projection(text_embedding(ids)) with
text_projection(x) = fc2(silu(fc1(x))); E0 = talker codec_embedding.

  [TP(instruct: <|im_start|>user\n{instruct}<|im_end|>\n)]            optional
  TP(role)                                                             3 positions
  C = E0(nothink, think_bos, think_eos)            language auto
    | E0(think, think_bos, lang, think_eos)        otherwise
    + [E0(speaker)] + E0(codec_pad, codec_bos)
  C[:-1] + (TP(tts_pad) * (len(C) - 2), TP(tts_bos))
  streaming text mode:     TP(text[0]) + E0(codec_bos);  trailing = TP(text[1:]), TP(tts_eos)
  non-streaming text mode: (TP(text), TP(tts_eos)) + E0(codec_pad) each, then TP(tts_pad) + E0(codec_bos);
                           trailing = (nothing: every step adds TP(tts_pad))

Decode step k adds trailing[k] while there is one, TP(tts_pad) after. A dialect speaker replaces the
language id when the language is chinese or auto.

The instruct, role and codec control rows (up to C[:-1] + ...) depend neither on the text nor on the text
mode: Prompt.prefix_rows counts them and Prompt.prefix_key names what they are made of, so that
their K/V can be computed once and reused (mkport.tts.prefix_cache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import MkportError

TEXT_MODES = ("non-streaming", "streaming")
ROLE = "<|im_start|>assistant\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class TtsConfig:
    """What the prompt and the frame loop need from a Qwen3-TTS config.json."""

    model_type: str  # custom_voice | voice_design | base
    model_size: str  # 0b6 | 1b7
    talker_hidden: int
    text_hidden: int
    text_vocab: int
    num_code_groups: int
    codec_vocab: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    languages: dict = field(default_factory=dict)  # name -> codec id (dialects too)
    speakers: dict = field(default_factory=dict)  # name -> codec id
    dialects: dict = field(default_factory=dict)  # speaker -> dialect name or False

    @property
    def default_speaker(self) -> str | None:
        """The first speaker of a CustomVoice model (None for other variants)."""
        return next(iter(self.speakers), None) if self.model_type == "custom_voice" else None

    @classmethod
    def from_dict(cls, cfg: dict) -> "TtsConfig":
        if cfg.get("model_type") != "qwen3_tts":
            raise MkportError(f"model_type '{cfg.get('model_type')}' is not a Qwen3-TTS model (qwen3_tts)")
        if cfg.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise MkportError(
                f"tokenizer_type '{cfg.get('tokenizer_type')}' is not supported; supported: qwen3_tts_tokenizer_12hz"
            )
        t = cfg["talker_config"]
        try:
            return cls(
                model_type=cfg.get("tts_model_type", "custom_voice"),
                model_size=str(cfg.get("tts_model_size", "")),
                talker_hidden=int(t["hidden_size"]),
                text_hidden=int(t.get("text_hidden_size", 2048)),
                text_vocab=int(t.get("text_vocab_size", 151936)),
                num_code_groups=int(t.get("num_code_groups", 16)),
                codec_vocab=int(t["vocab_size"]),
                tts_pad=int(cfg.get("tts_pad_token_id", 151671)),
                tts_bos=int(cfg.get("tts_bos_token_id", 151672)),
                tts_eos=int(cfg.get("tts_eos_token_id", 151673)),
                codec_pad=int(t["codec_pad_id"]),
                codec_bos=int(t["codec_bos_id"]),
                codec_eos=int(t["codec_eos_token_id"]),
                think=int(t["codec_think_id"]),
                nothink=int(t["codec_nothink_id"]),
                think_bos=int(t["codec_think_bos_id"]),
                think_eos=int(t["codec_think_eos_id"]),
                languages={k.lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()},
                speakers={k.lower(): int(v) for k, v in (t.get("spk_id") or {}).items()},
                dialects={k.lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()},
            )
        except KeyError as e:
            raise MkportError(f"Qwen3-TTS config lacks talker_config field {e}") from None


class TextProjector:
    """TP(ids): rows of talker.model.text_embedding through talker.text_projection, in float32. The
    151936 x 2048 embedding is not loaded whole (but by table_on): safetensors returns it as a view of the
    memory-mapped file, so a request reads only the pages of its rows."""

    EMBED = "talker.model.text_embedding.weight"
    PROJ = "talker.text_projection."

    def __init__(self, tensors_at: dict[str, Path], device="cpu"):
        from safetensors import safe_open

        names = [self.EMBED] + [f"{self.PROJ}linear_fc{i}.{p}" for i in (1, 2) for p in ("weight", "bias")]
        missing = [n for n in names if n not in tensors_at]
        if missing:
            raise MkportError(f"tensor '{missing[0]}' is missing from the checkpoint")
        self.device = torch.device(device)
        w = {}
        for n in names:
            with safe_open(str(tensors_at[n]), framework="pt") as f:
                w[n] = f.get_tensor(n)
        self.table = w.pop(self.EMBED)  # bf16, CPU, mapped from the file
        self.vocab, self.width = self.table.shape
        w = {n: t.float().to(self.device) for n, t in w.items()}
        self.fc1_w, self.fc1_b = w[self.PROJ + "linear_fc1.weight"], w[self.PROJ + "linear_fc1.bias"]
        self.fc2_w, self.fc2_b = w[self.PROJ + "linear_fc2.weight"], w[self.PROJ + "linear_fc2.bias"]
        if self.fc1_w.shape[1] != self.width:
            raise MkportError(f"text_projection fc1 takes {self.fc1_w.shape[1]} inputs, text embedding is {self.width} wide")
        self._fixed: dict[tuple[int, ...], torch.Tensor] = {}

    def _embed(self, ids: list[int]) -> torch.Tensor:
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise MkportError(f"text token id {bad[0]} is outside the text embedding (0..{self.vocab - 1})")
        # one gather where the table is (from the mapped file, or on the GPU: table_on) and the rows copied to the
        # device if it is elsewhere; bf16 -> fp32 there (exact)
        rows = self.table.index_select(0, to_device(torch.tensor(ids, dtype=torch.long), self.table.device))
        return to_device(rows, self.device).float()

    def table_on(self, device) -> "TextProjector":
        """This projector with the whole embedding table on `device` (622 MB for Qwen3-TTS): what a server does once,
        so a request's rows are gathered there. Gathered from the mapped file on the host, a warm-started server's
        prompts took 7-12 ms instead of ~0.4 one time in three (H100, docs/serving.md); a one-shot `speak` keeps
        reading only its rows' pages."""
        moved = copy.copy(self)
        moved.table, moved._fixed = self.table.to(device), {}  # its fixed rows gathered from its own table
        return moved

    def __call__(self, ids: list[int]) -> torch.Tensor:
        x = self._embed(list(ids))
        return F.linear(F.silu(F.linear(x, self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)

    def fixed(self, ids: list[int]) -> torch.Tensor:
        """TP(ids) for ids that every request uses (special tokens, the chat template's role), computed on
        first use and kept: the same call each time, so the same values."""
        key = tuple(ids)
        if key not in self._fixed:
            self._fixed[key] = self(key)
        return self._fixed[key]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to a GPU without waiting there: a copy from pageable memory first waits for all
    the work queued on the stream (another request's frames, in a server), one from pinned memory is queued
    behind it."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class Prompt:
    embeds: torch.Tensor  # [N, talker hidden] prefill input
    trailing: torch.Tensor  # [M, talker hidden] text added to decode steps 0..M-1
    pad: torch.Tensor  # [talker hidden] TP(tts_pad), added to later steps
    text_ids: list[int]
    # embeds[:prefix_rows] depend only on prefix_key (for one model): the token ids of the instruct and role
    # rows and the codec and text ids of the control rows
    prefix_rows: int = 0
    prefix_key: tuple = ()

    def text_for_step(self, k: int) -> torch.Tensor:
        return self.trailing[k] if k < self.trailing.shape[0] else self.pad


def resolve_voice(cfg: TtsConfig, speaker: str | None, language: str | None) -> tuple[str | None, str]:
    """Checks speaker and language against the config; returns them lower-cased (language 'auto' default)."""
    language = (language or "auto").lower()
    if language != "auto" and language not in cfg.languages:
        raise MkportError(f"unknown language '{language}'; supported: auto, {', '.join(sorted(cfg.languages))}")
    if speaker is not None and speaker != "":
        speaker = speaker.lower()
        if cfg.model_type != "custom_voice":
            raise MkportError(f"--speaker needs a CustomVoice model; this one is '{cfg.model_type}'")
        if speaker not in cfg.speakers:
            supported = ", ".join(sorted(cfg.speakers)) or "none"
            raise MkportError(f"unknown speaker '{speaker}'; supported: {supported}")
    else:
        speaker = None
    if cfg.model_type == "base":
        raise MkportError("Base (voice clone) models need a reference voice, which mkport speak does not support; "
                          "supported: custom_voice, voice_design")
    return speaker, language


def build_prompt(
    cfg: TtsConfig,
    encode: Callable[[str], list[int]],
    tp: TextProjector,
    codec_embedding: torch.Tensor,
    text: str,
    speaker: str | None = None,
    language: str | None = "auto",
    instruct: str | None = None,
    text_mode: str = "non-streaming",
) -> Prompt:
    """codec_embedding: the talker's codec_embedding [codec vocab, H] (any float dtype, any device)."""
    if not text or not text.strip():
        raise MkportError("text is empty: give the words to speak")
    if text_mode not in TEXT_MODES:
        raise MkportError(f"text mode '{text_mode}' is not supported; supported: {', '.join(TEXT_MODES)}")
    speaker, language = resolve_voice(cfg, speaker, language)
    if instruct and cfg.model_size == "0b6":
        raise MkportError("--instruct is not supported by the 0.6B models (the official code ignores it there)")
    dev = tp.device
    ids = encode(ROLE + text + SUFFIX)
    role, suffix = encode(ROLE), encode(SUFFIX)
    if ids[: len(role)] != role or ids[len(ids) - len(suffix) :] != suffix or len(ids) <= len(role) + len(suffix):
        raise MkportError("the text tokenizer does not split the chat template as the prompt needs "
                          "(role and suffix tokens not found around the text)")
    text_ids = ids[len(role) : len(ids) - len(suffix)]

    if language == "auto":
        lang_id = None
    else:
        lang_id = cfg.languages[language]
    if speaker is not None and language in ("chinese", "auto") and cfg.dialects.get(speaker):
        dialect = str(cfg.dialects[speaker]).lower()
        if dialect not in cfg.languages:
            raise MkportError(f"speaker '{speaker}' speaks dialect '{dialect}', which has no codec language id")
        lang_id = cfg.languages[dialect]
    tags = [cfg.nothink, cfg.think_bos, cfg.think_eos] if lang_id is None else [cfg.think, cfg.think_bos, lang_id, cfg.think_eos]
    if speaker is not None:
        tags.append(cfg.speakers[speaker])
    # [len(C), H], gathered and copied to the device at once (C[-2] = E0(codec_pad) is used again below)
    codec = to_device(codec_embedding[tags + [cfg.codec_pad, cfg.codec_bos]].float(), dev)

    bos, eos, pad = tp.fixed([cfg.tts_bos, cfg.tts_eos, cfg.tts_pad])
    parts = []
    instruct_ids = encode(f"<|im_start|>user\n{instruct}<|im_end|>\n") if instruct else []
    if instruct_ids:
        parts.append(tp(instruct_ids))
    parts.append(tp.fixed(role))
    text_side = torch.cat([pad.expand(codec.shape[0] - 2, -1), bos[None]])
    parts.append(text_side + codec[:-1])
    prefix_rows = sum(p.shape[0] for p in parts)
    prefix_key = (tuple(instruct_ids), tuple(role), tuple(tags + [cfg.codec_pad]), cfg.tts_pad, cfg.tts_bos)
    if text_mode == "streaming":
        parts.append(tp(text_ids[:1]) + codec[-1:])
        trailing = torch.cat([tp(text_ids[1:]), eos[None]])
    else:
        body = torch.cat([tp(text_ids), eos[None]])
        parts.append(body + codec[-2:-1])
        parts.append(pad[None] + codec[-1:])
        trailing = torch.zeros(0, pad.shape[0], device=dev)
    return Prompt(embeds=torch.cat(parts), trailing=trailing, pad=pad, text_ids=text_ids,
                  prefix_rows=prefix_rows, prefix_key=prefix_key)
