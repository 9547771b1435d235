"""How many 80 ms frames an utterance may have, and whether a prompt and its frames fit a talker's KV cache: one
home for speak, serve and the frame loops. No torch at import (the CLI reads the defaults for its help)."""

from __future__ import annotations

from ..errors import check_range

DEFAULT_MAX_FRAMES = 1500  # 120 s at 12.5 frames a second; a trained model ends much earlier (EOS)
RANDOM_WEIGHTS_FRAMES = 75  # 6 s: random weights never pick EOS, so the frame limit alone ends an utterance


def default_max_frames(random_weights: bool) -> int:
    """An utterance's frames when none are asked for (speak's --max-frames, a served request's max_frames)."""
    return RANDOM_WEIGHTS_FRAMES if random_weights else DEFAULT_MAX_FRAMES


def check_max_frames(max_frames: int, option: str = "--max-frames") -> int:
    """1 to the runtime's default KV cache length, which bounds the frames an utterance may ask for."""
    from ..runtime.decoder_api import DEFAULT_MAX_SEQ  # imports torch: only when a value is checked

    return check_range(max_frames, option, 1, DEFAULT_MAX_SEQ, " (frames of 80 ms an utterance)")


def fits(prompt_rows: int, max_frames: int, cache_rows: int) -> bool:
    """A prompt and up to max_frames frames fit a talker KV cache of cache_rows positions: a row for each prompt
    position and each frame (the frame loop's last talker step leaves one of them unused)."""
    return prompt_rows + max_frames <= cache_rows
