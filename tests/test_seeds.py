"""Seeds: the random-weights seed (--weights-seed) is separate from the sampling / test-input seed (--seed),
so a new --seed never writes a new model folder; a seed out of range is one error line before any work."""

from __future__ import annotations

import sys

import pytest

import mkport.cli as cli
import mkport.runtime.decoder
import mkport.tts.model
import mkport.runtime.weights
from mkport.errors import MkportError
from mkport.runtime.sampling import SamplingParams


class Stop(MkportError):
    """Raised by a stand-in for the random-weights writer, once it has recorded its arguments."""


def _main(argv, monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["mkport", *argv])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr().err.strip()


@pytest.fixture
def weights_seeds(monkeypatch, tmp_path):
    """The seeds the random weights would be made with, for diff / bench (no GPU needed: the check is
    passed over) and for speak / bench-tts; nothing is written."""
    seen = []

    def record(spec_or_which, seed=0):
        seen.append(seed)
        raise Stop("stopped before writing random weights")

    monkeypatch.setenv("MKPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.runtime.weights, "random_weights_folder", record)
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", record)
    return seen


COMMANDS = {
    "diff": ["diff", "qwen3-tts-0.6b-code-predictor", "--random-weights"],
    "bench": ["bench", "qwen3-tts-0.6b-code-predictor", "--random-weights"],
    "bench_tts": ["bench-tts", "--random-weights", "0.6b"],
    "speak": ["speak", "hi", "--random-weights", "tiny", "--backend", "reference"],
}


SAMPLED = [c for c in COMMANDS if c != "bench"]  # bench draws nothing at random: it has no --seed


@pytest.mark.parametrize("command", list(COMMANDS))
def test_seed_does_not_pick_the_weights(command, weights_seeds, monkeypatch, capsys):
    seed = ["--seed", "7"] if command in SAMPLED else []
    for args in (seed, [*seed, "--weights-seed", "3"], []):
        code, err = _main([*COMMANDS[command], *args], monkeypatch, capsys)
        assert code == 2 and "stopped before writing random weights" in err, err
    assert weights_seeds == [0, 3, 0]


@pytest.mark.parametrize("command, option", [(c, "--seed") for c in SAMPLED] + [(c, "--weights-seed") for c in COMMANDS])
@pytest.mark.parametrize("value", [str(2**64), "-1", str(2**63)])
def test_a_seed_out_of_range_is_refused_before_any_work(command, option, value, weights_seeds, tmp_path,
                                                        monkeypatch, capsys):
    code, err = _main([*COMMANDS[command], option, value], monkeypatch, capsys)
    assert code == 2 and err == f"error: {option} {value}: a seed is an integer from 0 to 2**63-1", err
    assert weights_seeds == [] and not (tmp_path / "cache").exists()


def test_the_largest_seed_is_taken(weights_seeds, monkeypatch, capsys):
    code, err = _main([*COMMANDS["speak"], "--seed", str(2**63 - 1), "--weights-seed", str(2**63 - 1)],
                      monkeypatch, capsys)
    assert code == 2 and "stopped before" in err and weights_seeds == [2**63 - 1]


@pytest.mark.parametrize("command", ["diff", "bench"])
def test_weights_seed_needs_random_weights(command, weights_seeds, tmp_path, monkeypatch, capsys):
    args = [command, "qwen3-tts-0.6b-code-predictor", "--weights", str(tmp_path), "--weights-seed", "1"]
    code, err = _main(args, monkeypatch, capsys)
    assert code == 2 and err == "error: --weights-seed is for --random-weights"


def test_sampling_params_refuse_a_seed_the_kernel_cannot_take():
    SamplingParams(seed=2**63 - 1).validate(vocab=10)
    for seed in (2**63, -1):
        with pytest.raises(MkportError, match="a seed is an integer from 0 to 2\\*\\*63-1"):
            SamplingParams(seed=seed).validate(vocab=10)
