"""The decoder backends a command may name (`--backend`, a plan's composition), and the one factory that builds a
decoder of a backend: speak, serve, run, bench-tts and plan all get theirs from make_decoder."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import MkportError
from ..kernel.launch_plan import plan_launch
from ..kernel.spec import ModelSpec
from .decoder import Decoder, current_device_target
from .graph_decoder import GraphDecoder
from .torch_decoder import DecoderBatch, TorchDecoder
from .weights import DecoderWeights

BACKENDS = ("megakernel", "reference")
BATCH_BACKENDS = (*BACKENDS, "graphs")  # graphs: mkport.runtime.graph_decoder, batch decoders only


def check_backend(backend: str, batched: bool = False) -> None:
    """A backend name this machine can run (for batch decoders when `batched`), or a one-line error."""
    supported = BATCH_BACKENDS if batched else BACKENDS
    if backend not in supported:
        only = " (graphs decodes batches only)" if backend in BATCH_BACKENDS else ""
        raise MkportError(f"backend '{backend}' is not supported{only}; supported: {', '.join(supported)}")
    if backend == "megakernel" and not torch.cuda.is_available():
        raise MkportError("the megakernel backend needs a CUDA GPU; none is visible (use --backend reference)")


def make_decoder(spec: ModelSpec, weights: DecoderWeights, backend: str, max_seq: int | None = None,
                 batch: int | None = None, device=None, sms: int | None = None, prefill_graphs: bool = True):
    """A decoder of `backend` for one model part. `batch` None: a one-sequence decoder (prefill, step): the
    megakernel's Decoder or the reference's TorchDecoder. `batch` B: a batch decoder of B sequences (prefill_slot,
    step_batch): Decoder(batch=B), GraphDecoder (`graphs`), or DecoderBatch over B TorchDecoders (`reference`).
    `device`: the torch backends' (default: a CUDA GPU when one is visible); the megakernel runs on the GPU.
    `sms`: the megakernel's SM budget (its grid; default every SM), to leave the rest of the GPU to work beside it
    (mkport.tts.planner). `prefill_graphs` False: the megakernel's prefill runs eagerly (for a single prompt,
    cheaper than capturing its CUDA graph)."""
    check_backend(backend, batched=batch is not None)
    if backend == "megakernel":
        plan = None
        if sms:
            target = dataclasses.replace(current_device_target(), sm_count=sms)
            plan = plan_launch(spec, target, batch=batch or 1)
        return Decoder(spec, weights, max_seq, prefill_graphs=prefill_graphs, plan=plan, batch=batch or 1)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if batch is None:
        return TorchDecoder(spec, weights, max_seq, device)
    if backend == "graphs":
        return GraphDecoder(spec, weights, max_seq, batch, device)
    return DecoderBatch([TorchDecoder(spec, weights, max_seq, device) for _ in range(batch)])


def first_sequences(decoder, batch: int):
    """A batch decoder that steps the first `batch` sequences of `decoder` (a batch decoder of at least as many):
    their state stays `decoder`'s, which prefills them, so a step costs a `batch`-sequence step. The megakernel's
    shares its caches (Decoder(share=...)); the reference's is a DecoderBatch of the same one-sequence decoders."""
    if batch == decoder.batch:
        return decoder
    if isinstance(decoder, Decoder):
        target = dataclasses.replace(current_device_target(), sm_count=decoder.plan.grid)  # the same SMs
        plan = plan_launch(decoder.spec, target, decoder.plan.kernel, batch=batch)
        return Decoder(decoder.spec, decoder.weights, decoder.max_seq, prefill_graphs=False, plan=plan, batch=batch,
                       share=decoder)
    if isinstance(decoder, DecoderBatch):
        return DecoderBatch(decoder.decoders[:batch])
    raise MkportError(f"{type(decoder).__name__} steps all its sequences: a batch sized to the live streams needs the "
                      "megakernel or the reference backend for the talker")
