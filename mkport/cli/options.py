"""Checks of command-line values that several commands share: lists (comma-separated, repeated, or both), seeds, --kernel,
and MODEL's weights (--weights DIR or --random-weights, --weights-seed). Each failure is an MkportError naming the option
and what it accepts. (Ranges: mkport.errors.check_range, which lower floors use too; a seed's range:
mkport.runtime.decoder.check_seed.)"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from ..errors import MkportError
from ..kernel.launch_plan import KERNELS, refuse_removed_kernel


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


def check_kernels(values: list[str]) -> list[str]:
    """--kernel's designs (all when none given); a removed design gets a line saying why it is gone."""
    for kernel in split_list(values, "--kernel"):
        refuse_removed_kernel(kernel, "--kernel")
    return choose(values, "--kernel", KERNELS)


def open_checkpoint(spec, weights: Path | None, random_weights: bool, weights_seed: int | None):
    """The checkpoint of --weights DIR, or of --random-weights (seeded, written to the cache once)."""
    from ..runtime.weights import Checkpoint, random_weights_folder

    if (weights is None) == (not random_weights):
        raise MkportError("give exactly one of --weights DIR or --random-weights")
    seed = weights_seed_of(random_weights, weights_seed)
    return Checkpoint.open(random_weights_folder(spec, seed) if random_weights else weights)


def weights_seed_of(random_weights: bool, weights_seed: int | None) -> int:
    """--weights-seed (default 0), which only --random-weights takes."""
    if weights_seed is not None and not random_weights:
        raise MkportError("--weights-seed is for --random-weights")
    return weights_seed or 0


def check_seeds(**seeds) -> None:
    """Each seed given (option name with _ for -) is one the kernel takes."""
    from ..runtime.decoder import check_seed

    for option, value in seeds.items():
        if value is not None:
            check_seed(value, "--" + option.replace("_", "-"))
