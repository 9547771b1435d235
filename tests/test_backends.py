"""The one decoder factory (mkport.runtime.backends.make_decoder) and the TTS pair built on it
(mkport.tts.pipeline.make_decoders): each backend and batch gets its decoder with the interface its callers step;
the megakernel's arguments are checked on the CPU through a stand-in Decoder; a bad name is one line."""

from __future__ import annotations

import warnings

import pytest
import torch

from mkport.errors import MkportError
from mkport.kernel.gpu import KNOWN_TARGETS
from mkport.runtime import backends
from mkport.runtime.backends import first_sequences, make_decoder
from mkport.runtime.graph_decoder import GraphDecoder
from mkport.runtime.torch_decoder import DecoderBatch, TorchDecoder

warnings.filterwarnings("ignore", category=FutureWarning)

from mkport.tts.model import TtsModel, write_random_tts_model  # noqa: E402
from mkport.tts.pipeline import make_decoders  # noqa: E402

MAX_SEQ = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return TtsModel.load(write_random_tts_model(tmp_path_factory.mktemp("backends") / "tiny", "tiny", seed=0))


class FakeDecoder:
    """Decoder's arguments, kept: the megakernel's branch runs without a GPU."""

    def __init__(self, spec, weights, max_seq=None, **kwargs):
        self.spec, self.weights, self.max_seq, self.kwargs = spec, weights, max_seq, kwargs
        self.batch, self.plan = kwargs["batch"], kwargs.get("plan")


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "Decoder", FakeDecoder)
    monkeypatch.setattr(backends, "current_device_target", lambda: KNOWN_TARGETS["sm_90"])


def test_each_backend_and_batch_gets_its_decoder(tiny):
    spec, w = tiny.talker_spec, tiny.talker_weights
    one = make_decoder(spec, w, "reference", MAX_SEQ, device="cpu")
    assert type(one) is TorchDecoder and one.max_seq == MAX_SEQ and one.device == torch.device("cpu")
    batch = make_decoder(spec, w, "reference", MAX_SEQ, batch=3, device="cpu")
    assert type(batch) is DecoderBatch and batch.batch == 3 and len({id(d) for d in batch.decoders}) == 3
    assert all(type(d) is TorchDecoder and d.max_seq == MAX_SEQ for d in batch.decoders)
    graphs = make_decoder(spec, w, "graphs", MAX_SEQ, batch=2, device="cpu")
    assert type(graphs) is GraphDecoder and graphs.batch == 2 and graphs.max_seq == MAX_SEQ


def test_the_megakernel_gets_its_batch_budget_and_prefill_graphs(tiny, fake_gpu):
    spec, w = tiny.talker_spec, tiny.talker_weights
    one = make_decoder(spec, w, "megakernel", MAX_SEQ, prefill_graphs=False)
    assert one.max_seq == MAX_SEQ and one.kwargs == {"prefill_graphs": False, "batch": 1}
    batch = make_decoder(spec, w, "megakernel", MAX_SEQ, batch=4)
    assert batch.kwargs == {"prefill_graphs": True, "batch": 4}  # the Decoder plans for every SM
    split = make_decoder(spec, w, "megakernel", MAX_SEQ, batch=4, sms=100)
    assert split.kwargs["plan"].grid == 100 and split.kwargs["plan"].batch == 4


def test_the_megakernel_alone_gets_its_own_options(tiny, fake_gpu):
    """bench and diff trace and time the megakernel through the factory too; a torch backend has no such options."""
    spec, w = tiny.talker_spec, tiny.talker_weights
    traced = make_decoder(spec, w, "megakernel", MAX_SEQ, 2, trace=True, kernel="v20")
    assert traced.kwargs == {"prefill_graphs": True, "batch": 2, "trace": True, "kernel": "v20"}
    with pytest.raises(MkportError, match=r"^the reference backend takes none of the megakernel's options \(trace\)$"):
        make_decoder(spec, w, "reference", MAX_SEQ, device="cpu", trace=True)


def test_first_sequences_step_the_owners_on_its_sms(tiny, fake_gpu):
    """A smaller batch over a megakernel's first sequences: the owner's state (share), its SMs and kernel design, no
    prefill of its own; the whole batch is the owner itself."""
    owner = make_decoder(tiny.talker_spec, tiny.talker_weights, "megakernel", MAX_SEQ, batch=4, sms=100)
    view = first_sequences(owner, 2)
    assert view.kwargs["share"] is owner and not view.kwargs["prefill_graphs"]
    assert (view.plan.grid, view.plan.batch, view.plan.kernel) == (100, 2, owner.plan.kernel)
    assert first_sequences(owner, 4) is owner


def test_the_tts_pair_follows_the_model(tiny, fake_gpu, monkeypatch):
    """The predictor's cache holds a frame's pass (16 steps + 1); the prefill's graphs follow TtsModel.graphs;
    a composition may give the predictor a backend of its own."""
    talker, predictor = make_decoders(tiny, "megakernel", MAX_SEQ)
    assert (talker.spec, predictor.spec) == (tiny.talker_spec, tiny.predictor_spec)
    assert (talker.max_seq, predictor.max_seq) == (MAX_SEQ, tiny.config.num_code_groups + 1)
    assert talker.kwargs["prefill_graphs"] and predictor.kwargs["prefill_graphs"]
    monkeypatch.setattr(tiny, "graphs", False)
    assert not any(d.kwargs["prefill_graphs"] for d in make_decoders(tiny, "megakernel", MAX_SEQ))
    talker, predictor = make_decoders(tiny, "megakernel", MAX_SEQ, batch=2, predictor_backend="graphs", device="cpu")
    assert isinstance(talker, FakeDecoder) and type(predictor) is GraphDecoder and predictor.batch == 2


@pytest.mark.parametrize("backend, batch, words", [
    ("warp", None, "backend 'warp' is not supported; supported: megakernel, reference$"),
    ("warp", 2, "backend 'warp' is not supported; supported: megakernel, reference, graphs$"),
    ("graphs", None, r"backend 'graphs' is not supported \(graphs decodes batches only\); supported: megakernel, "
                     "reference$"),
])
def test_a_backend_that_is_not_one_is_one_line(tiny, backend, batch, words):
    with pytest.raises(MkportError, match=words):
        make_decoder(tiny.talker_spec, tiny.talker_weights, backend, MAX_SEQ, batch=batch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_the_megakernel_without_a_gpu_is_one_line(tiny):
    with pytest.raises(MkportError, match="the megakernel backend needs a CUDA GPU; none is visible "
                                          r"\(use --backend reference\)$"):
        make_decoder(tiny.talker_spec, tiny.talker_weights, "megakernel", MAX_SEQ, batch=2)
