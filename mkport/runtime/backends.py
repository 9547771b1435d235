"""The decoder backends a command may name (`--backend`, a plan's composition), and the one factory that builds a
decoder: every command gets its decoders from make_decoder (bench and diff with the megakernel's own options)."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import MkportError
from ..kernel.launch_plan import DEFAULT_KERNEL, plan_launch
from ..kernel.spec import ModelSpec
from .decoder import Decoder, current_device_target
from .decoder_api import BatchDecoder, SequenceDecoder
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
                 batch: int | None = None, device=None, sms: int | None = None, prefill_graphs: bool = True,
                 **megakernel) -> SequenceDecoder | BatchDecoder:
    """A decoder of `backend` for one model part. `batch` None: a one-sequence decoder (SequenceDecoder): the
    megakernel's Decoder (of batch 1) or the reference's TorchDecoder. `batch` B: a batch decoder of B sequences
    (BatchDecoder): Decoder(batch=B), GraphDecoder (`graphs`), or DecoderBatch over B TorchDecoders (`reference`).
    `device`: the torch backends' (default: a CUDA GPU when one is visible); the megakernel runs on the GPU.
    `sms`: the megakernel's SM budget (its grid; default every SM), to leave the rest of the GPU to work beside it
    (mkport.tts.planner). `prefill_graphs` False: the megakernel's prefill runs eagerly (for a single prompt,
    cheaper than capturing its CUDA graph). `megakernel`: Decoder's own options (trace, profile, log, kernel,
    plan, fused_prefill, share, invariant_to), for the commands that trace or time the megakernel alone, and for
    the batch-invariant server (invariant_to)."""
    check_backend(backend, batched=batch is not None)
    if backend == "megakernel":
        if sms:
            target = dataclasses.replace(current_device_target(), sm_count=sms)
            megakernel["plan"] = plan_launch(spec, target, megakernel.get("kernel", DEFAULT_KERNEL), batch=batch or 1,
                                             invariant_to=megakernel.pop("invariant_to", 0))
        return Decoder(spec, weights, max_seq, prefill_graphs=prefill_graphs, batch=batch or 1, **megakernel)
    if megakernel:
        raise MkportError(f"the {backend} backend takes none of the megakernel's options ({', '.join(megakernel)})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if batch is None:
        return TorchDecoder(spec, weights, max_seq, device)
    if backend == "graphs":
        return GraphDecoder(spec, weights, max_seq, batch, device)
    return DecoderBatch([TorchDecoder(spec, weights, max_seq, device) for _ in range(batch)])


def invariance(invariant_to: int) -> dict:
    """make_decoder's option for a batch-invariant megakernel plan (none when 0)."""
    return {"invariant_to": invariant_to} if invariant_to else {}


def first_sequences(decoder: BatchDecoder, batch: int, invariant_to: int = 0, every_sm: bool = False) -> BatchDecoder:
    """A batch decoder that steps the first `batch` sequences of `decoder` (a batch decoder of at least as many):
    their state stays `decoder`'s, which prefills them, so a step costs a `batch`-sequence step. The megakernel's
    shares its caches (Decoder(share=...)), on the SMs of `decoder` or, `every_sm`, on all of them; with
    `invariant_to` N its plan sums a row as batch N's (launch_plan's batch-invariant plans: `decoder` itself of N, or
    invariant to N). The reference's is a DecoderBatch of the same one-sequence decoders (its rows' sums never depend
    on the batch)."""
    megakernel = isinstance(decoder, Decoder)
    if batch == decoder.batch and not (every_sm and megakernel):
        return decoder
    if megakernel:
        grid = None if every_sm else decoder.plan.grid
        return make_decoder(decoder.spec, decoder.weights, "megakernel", decoder.max_seq, batch, sms=grid,
                            prefill_graphs=False, kernel=decoder.plan.kernel, share=decoder,
                            **invariance(invariant_to))
    if isinstance(decoder, DecoderBatch):
        return DecoderBatch(decoder.decoders[:batch])
    raise MkportError(f"{type(decoder).__name__} steps all its sequences: a batch sized to the live streams needs the "
                      "megakernel or the reference backend for the talker")
