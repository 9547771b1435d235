"""CUDA graphs of fixed-shape torch code, shared by the prompt prefill (runtime.Decoder) and the speech
tokenizer decoder (tts.codec.SpeechDecoder): inputs are padded to a fixed length, copied into static
buffers, the captured graph is replayed, and the rows of the real inputs are copied out."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_rows(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `rows` (t itself when it has that many already)."""
    extra = rows - t.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad {t.shape[dim]} rows down to {rows}")
    if extra == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, extra])


@torch.no_grad()  # inference: no autograd history in a graph (nor on a state the call writes, which would make a
                  # compiled call's guards differ between the eager run and the capture, and so recompile there)
def capture(fn, pool, stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Captures fn() (which reads static input buffers) into a CUDA graph that allocates from `pool`, on `stream`
    (default: torch's capture stream, one for every capture). Returns (graph, output): graph.replay() recomputes
    `output` in place from the buffers' current values.

    fn runs once eagerly on a side stream first, so that cuBLAS / cuDNN handles, workspaces and lazy
    module state are set up outside the capture (that run's side effects happen once more at replay).
    Graphs may share `pool` because each caller copies the output out right after its replay, before any
    other graph of the pool runs: an intermediate of one graph may then reuse another's output memory.
    Graphs that replay at the same time as each other need captures on different streams: a captured matmul
    keeps the address of cuBLAS's workspace, which torch keeps one of per capture stream (pytorch/pytorch#193402),
    so two such graphs replayed side by side would write each other's partial sums."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = fn()
    return graph, output
