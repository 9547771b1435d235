"""Frame limits in one home (mkport/tts/limits.py): speak and serve share the defaults (short with random weights,
which never pick EOS), and every frame loop shares the KV-cache fit check."""

from __future__ import annotations

import pytest

import mkport.serve.engine
from mkport.errors import MkportError
from mkport.serve.config import ServeConfig
from mkport.tts.limits import DEFAULT_MAX_FRAMES, RANDOM_WEIGHTS_FRAMES, check_max_frames, default_max_frames, fits


def test_one_default_for_speak_and_serve():
    assert default_max_frames(False) == DEFAULT_MAX_FRAMES == ServeConfig(folder="m", model_id="m").max_frames == 1500
    assert default_max_frames(True) == RANDOM_WEIGHTS_FRAMES == 75


def test_fit_check_at_its_boundary():
    assert fits(10, 90, 100) and not fits(10, 91, 100) and not fits(101, 0, 100)


def test_max_frames_range():
    assert check_max_frames(4096) == 4096
    for bad in (0, 4097):
        with pytest.raises(MkportError, match=rf"--max-frames {bad}: must be 1..4096 \(frames of 80 ms an utterance\)"):
            check_max_frames(bad)


def test_a_request_to_a_random_weights_server_defaults_to_a_short_utterance(monkeypatch):
    """serve --random-weights: a request without max_frames gets speak's short default; --max-frames stays the most
    a request may ask for. With a model folder the default is --max-frames itself."""
    from typer.testing import CliRunner

    from mkport.cli import app

    seen = []

    class Stop(Exception):
        pass

    def engine(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(mkport.serve.engine, "Engine", engine)
    for args, request, most in [([], RANDOM_WEIGHTS_FRAMES, DEFAULT_MAX_FRAMES), (["--max-frames", "40"], 40, 40)]:
        result = CliRunner().invoke(app, ["serve", "--random-weights", "tiny", "--backend", "reference", *args])
        assert isinstance(result.exception, Stop), result.output
        assert (seen[-1].request_frames, seen[-1].max_frames) == (request, most)
    assert ServeConfig(folder="m", model_id="m", max_frames=400).request_frames == 400
