"""Checks of command-line values that several commands share: lists (comma-separated, repeated, or both), seeds,
--kernel, and the model arguments, each kind resolved by one function: a language model's MODEL with --weights DIR
or --random-weights [--weights-seed] (llm_model), a Qwen3-TTS DIR or --random-weights SIZE (tts_model). Each
failure is an MkportError naming the option and what it accepts. (Ranges: mkport.errors.check_range, which lower
floors use too; a seed's range: mkport.runtime.sampling.check_seed.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import MkportError
from ..kernel.launch_plan import KERNELS, refuse_removed_kernel
from ..kernel.spec import ModelSource, open_model, read_config


def split_list(values: Iterable[str] | None, option: str) -> list[str]:
    """`--x a,b --x c` -> [a, b, c], in order, repeats dropped; an empty item is an error."""
    items = []
    for value in values or ():
        for item in value.split(","):
            item = item.strip()
            if not item:
                raise MkportError(f"{option} '{value}': an empty item; give NAME,NAME or repeat {option}")
            items.append(item)
    return list(dict.fromkeys(items))


def choose(values: Iterable[str] | None, option: str, supported: Sequence[str]) -> list[str]:
    """The items of split_list, each one of `supported`; none given: all of them."""
    chosen = split_list(values, option) or list(supported)
    unknown = [c for c in chosen if c not in supported]
    if unknown:
        raise MkportError(f"{option}: unknown {', '.join(unknown)}; supported: {', '.join(supported)}")
    return chosen


def int_list(values: Iterable[str] | None, option: str, low: int = 1) -> list[int]:
    """The items of split_list as integers of at least `low`."""
    items = split_list(values, option)
    bad = [i for i in items if not (i.isdigit() and int(i) >= low)]
    if bad:
        raise MkportError(f"{option} '{','.join(items)}': {bad[0]} is not an integer >= {low}")
    return [int(i) for i in items]


def check_json_path(path: Path | None) -> None:
    """Before any work: --json FILE is written into a folder that exists, so that a long run's report is not lost."""
    if path is None:
        return
    if path.is_dir():
        raise MkportError(f"--json {path} is a folder: give a file name")
    if not path.parent.is_dir():
        raise MkportError(f"--json {path}: the folder {path.parent} does not exist")


def check_kernels(values: list[str]) -> list[str]:
    """--kernel's designs (all when none given); a removed design gets a line saying why it is gone."""
    for kernel in split_list(values, "--kernel"):
        refuse_removed_kernel(kernel, "--kernel")
    return choose(values, "--kernel", KERNELS)


@dataclass(frozen=True)
class LlmModel:
    """MODEL and the weights the options chose, checked; nothing is loaded or written until checkpoint()."""

    source: ModelSource
    weights: Path | None  # --weights DIR (run: MODEL's folder); None with random weights
    random_weights: bool
    weights_seed: int

    def checkpoint(self):
        """The checkpoint, indexed; random weights are written to the cache once, or made counter-based for a large
        model (so: after the GPU check)."""
        from ..runtime.weights import Checkpoint, random_weights

        if self.random_weights:
            return random_weights(self.source.spec, self.weights_seed)
        return Checkpoint.open(self.weights)


def llm_model(model: str, weights: Path | None, random_weights: bool, weights_seed: int | None,
              own_folder: bool = False) -> LlmModel:
    """MODEL (opened once) with --weights DIR or --random-weights [--weights-seed], for every command that runs a
    language model's weights (diff, bench, run). With own_folder (run) --weights defaults to MODEL's folder; a bundled
    spec has none, which run refuses for its missing tokenizer before it opens the weights."""
    source = open_model(model)
    check_seeds(weights_seed=weights_seed)
    seed = weights_seed_of(random_weights, weights_seed)
    if weights is None and not random_weights and own_folder:
        weights = source.path.parent if source.path is not None else None
    elif (weights is None) == (not random_weights):
        raise MkportError("give exactly one of --weights DIR or --random-weights")
    return LlmModel(source, weights, random_weights, seed)


@dataclass(frozen=True)
class TtsModelArg:
    """A Qwen3-TTS model folder, or the random model the options chose, checked; nothing is written until folder()."""

    path: Path | None  # DIR; None with random weights
    random_weights: str | None
    weights_seed: int

    def folder(self) -> Path:
        """The model folder; a random one is written to the cache once (so: after the GPU check)."""
        from ..tts.model import random_model_folder

        return random_model_folder(self.random_weights, self.weights_seed) if self.random_weights else self.path


def tts_model(model: str | Path | None, random_weights: str | None, weights_seed: int = 0, option: str = "DIR",
              command: str | None = None) -> TtsModelArg:
    """DIR (speak and serve: --model DIR) or --random-weights SIZE, for every Qwen3-TTS command. With `command`
    (bench-tts, plan) DIR must hold a Qwen3-TTS config.json, an error naming the command; speak and serve check the
    whole folder when they load it."""
    from ..tts.model import RANDOM_SPECS

    sizes = "|".join(RANDOM_SPECS)
    if (model is None) == (random_weights is None):
        raise MkportError(f"give exactly one of {option} (a Qwen3-TTS model folder) or --random-weights {sizes}")
    if random_weights is not None and random_weights not in RANDOM_SPECS:
        raise MkportError(f"unknown --random-weights '{random_weights}'; supported: {', '.join(RANDOM_SPECS)}")
    check_seeds(weights_seed=weights_seed)
    folder = None if model is None else Path(model).expanduser()
    if folder is not None and command is not None:
        config = folder / "config.json"
        if not config.is_file():
            raise MkportError(f"{command} needs a Qwen3-TTS model folder (or --random-weights {sizes}); '{model}' is "
                              "not a folder with a config.json")
        model_type = read_config(config).get("model_type")
        if model_type != "qwen3_tts":
            raise MkportError(f"{command} needs a Qwen3-TTS model folder; {config} has model_type '{model_type}', "
                              "not qwen3_tts")
    return TtsModelArg(folder, random_weights, weights_seed)


def weights_seed_of(random_weights: bool, weights_seed: int | None) -> int:
    """--weights-seed (default 0), which only --random-weights takes."""
    if weights_seed is not None and not random_weights:
        raise MkportError("--weights-seed is for --random-weights")
    return weights_seed or 0


def check_seeds(**seeds) -> None:
    """Each seed given (option name with _ for -) is one the kernel takes."""
    from ..runtime.sampling import check_seed

    for option, value in seeds.items():
        if value is not None:
            check_seed(value, "--" + option.replace("_", "-"))
