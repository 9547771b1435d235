"""The decoder backends a command may name (`--backend`, a plan's composition), checked in one place."""

from __future__ import annotations

import torch

from ..errors import MkportError

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
