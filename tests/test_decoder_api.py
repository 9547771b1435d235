"""The decoder interfaces of mkport.runtime.decoder_api, stated once: every decoder class offers the one its callers
step, method by method with the protocol's parameters first (names, kinds, defaults) and any others optional, and
every attribute the protocol names. Read off the classes, so the megakernel's Decoder is checked without a GPU."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from mkport.runtime.decoder import Decoder
from mkport.runtime.decoder_api import BatchDecoder, SequenceDecoder
from mkport.runtime.graph_decoder import GraphDecoder
from mkport.runtime.torch_decoder import DecoderBatch, TorchDecoder

IMPLEMENTATIONS = [(Decoder, SequenceDecoder), (Decoder, BatchDecoder), (TorchDecoder, SequenceDecoder),
                   (GraphDecoder, BatchDecoder), (DecoderBatch, BatchDecoder)]


def _methods(protocol) -> dict:
    return {name: f for name, f in vars(protocol).items() if inspect.isfunction(f) and not name.startswith("_")}


def _attributes(cls) -> set[str]:
    """What an instance of cls has beside its methods: each `self.name` assigned in its classes, and properties."""
    names = set()
    for klass in cls.__mro__[:-1]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
        names |= {name for name, value in vars(klass).items() if isinstance(value, property)}
    return names


def _parameters(f) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


@pytest.mark.parametrize("cls, protocol", IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_each_decoder_offers_its_interface(cls, protocol):
    for name, stated in _methods(protocol).items():
        offered = getattr(cls, name, None)
        assert callable(offered), f"{cls.__name__} has no {name}"
        want, got = _parameters(stated), _parameters(offered)
        assert got[: len(want)] == want, f"{cls.__name__}.{name}"
        assert all(default is not inspect.Parameter.empty for _, _, default in got[len(want):]), f"{cls.__name__}.{name}"
    missing = set(protocol.__annotations__) - _attributes(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"


def test_the_protocols_name_what_their_callers_use():
    """The two interfaces, as their callers step them (generate and the one-sequence frame loop; the batch frame
    loop and the server): a change to one is a change to every backend's class."""
    assert set(_methods(SequenceDecoder)) == {"reset", "set_suppressed", "prefill", "step", "cached_rows", "load_rows"}
    assert set(_methods(BatchDecoder)) == {"reset", "reset_slot", "set_suppressed", "set_suppressed_slot",
                                           "prefill_slot", "step_batch"}
