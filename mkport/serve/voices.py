"""OpenAI's names for the served model: its model aliases and its voices, each voice one of the model's speakers
(docs/serving.md, "OpenAI clients"). `mkport serve --voice-map FILE` replaces the voice table."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MkportError

MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")

# OpenAI's voices -> the Qwen3-TTS CustomVoice speakers: female voices to female speakers, male to male, the deep
# onyx to the low uncle_fu; ryan and aiden are the English speakers. docs/serving.md shows this table.
OPENAI_VOICES = {
    "alloy": "serena", "ash": "aiden", "ballad": "ryan", "coral": "vivian", "echo": "ryan", "fable": "dylan",
    "nova": "vivian", "onyx": "uncle_fu", "sage": "serena", "shimmer": "sohee", "verse": "eric",
    "marin": "ono_anna", "cedar": "aiden",
}


def voice_table(voice_map: dict[str, str] | None, speakers: list[str]) -> dict[str, str]:
    """The names a request may give for a speaker: the map's (OpenAI's by default) whose speaker the model has (the
    random models have four of the nine), then the speakers' own names."""
    named = {name: speaker for name, speaker in (voice_map or OPENAI_VOICES).items() if speaker in speakers}
    return {**named, **{s: s for s in speakers}}


def read_voice_map(path: Path, folder: Path) -> dict[str, str]:
    """A --voice-map file: a JSON object of names to the speakers of the model in `folder`, checked (one-line
    errors) before the server starts."""
    from ..tts.prompt import TtsConfig

    speakers = list(TtsConfig.from_dict(json.loads((folder / "config.json").read_text())).speakers)
    try:
        mapping = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise MkportError(f"--voice-map {path}: cannot read a JSON object: {e}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise MkportError(f"--voice-map {path}: expected a JSON object of voice names to speakers, "
                          'e.g. {"alloy": "serena"}')
    mapping = {k.lower(): v.lower() for k, v in mapping.items()}
    unknown = sorted({v for v in mapping.values() if v not in speakers})
    if unknown:
        raise MkportError(f"--voice-map {path}: unknown speaker {', '.join(unknown)}; the model's speakers: "
                          f"{', '.join(sorted(speakers)) or 'none (not a CustomVoice model)'}")
    shadowed = sorted(k for k, v in mapping.items() if k in speakers and v != k)
    if shadowed:
        raise MkportError(f"--voice-map {path}: {', '.join(shadowed)} is a speaker of the model; map other names")
    return mapping
