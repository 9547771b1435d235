"""The KV cache's layout, once: how many rows each layer keeps, where they sit in one flat buffer, and its bytes. The
megakernel's Decoder, GraphDecoder and the server's memory fit (serve.batched.stream_bytes) all take it from here.

A full-attention layer keeps a row for every position (a batch one more a sequence: the spare row where a sequence
left out of a step writes). A sliding layer keeps a ring (interface.ring_rows: its window and one prefill pass) when
that is fewer: position p sits at row p % rows. The megakernel's buffer is sequence-major, a sequence's layers one
after another, [kv head][row][head_dim] each (attention.cuh finds a layer's rows by the same arithmetic, from
constants.cuh's KV_FULL_BEFORE); so a decoder sharing a batch's first sequences strides them as the batch does.
GraphDecoder's is layer-major (a layer's rows of every sequence are one batch of matrices) and without rings (its step
masks rows by position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MkportError
from ..kernel.interface import ring_chunk_rows, ring_rows
from ..kernel.spec import ModelSpec


@dataclass(frozen=True)
class KvLayout:
    """Where K (or V: the same layout in a buffer of its own) of every layer and sequence sits, in elements."""

    batch: int
    kv_heads: int
    head_dim: int
    full_rows: int  # rows of a full-attention layer: every position (and a batch's spare row)
    rows: tuple[int, ...]  # rows of each layer a kv head
    offsets: tuple[int, ...]  # where sequence 0's rows of each layer start
    sequence_strides: tuple[int, ...]  # from one sequence's rows of a layer to the next's
    elements: int  # of the whole buffer
    chunk_rows: int  # the most rows a prefill pass writes (0: any number, no layer is a ring)

    @classmethod
    def of(cls, spec: ModelSpec, max_seq: int, batch: int = 1, rings: bool = True) -> "KvLayout":
        """The layout of `batch` sequences of up to max_seq positions: the megakernel's, or with rings=False
        GraphDecoder's (every layer full, layer-major)."""
        full = max_seq + (1 if batch > 1 else 0)
        ring = min(ring_rows(spec), full) if rings else 0
        rows = tuple(ring if ring and spec.window(i) else full for i in range(spec.num_layers))
        head = spec.num_kv_heads * spec.head_dim  # elements of one row of every kv head
        sizes = [r * head for r in rows]  # one sequence's elements of each layer
        if rings:  # sequence-major: a sequence's layers one after another
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            strides = (sum(sizes),) * len(sizes)
        else:  # layer-major: a layer's sequences one after another
            offsets = [batch * sum(sizes[:i]) for i in range(len(sizes))]
            strides = tuple(sizes)
        chunk = ring_chunk_rows(spec) if ring and ring < full else 0
        return cls(batch, spec.num_kv_heads, spec.head_dim, full, rows, tuple(offsets), strides, batch * sum(sizes),
                   chunk)

    def sequence_bytes(self, element_bytes: int = 2) -> int:
        """K and V of one sequence, every layer (bf16 by default)."""
        return 2 * sum(self.rows) * self.kv_heads * self.head_dim * element_bytes

    def layer_view(self, buffer: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer` of a flat buffer of this layout as [batch, kv_heads, rows, head_dim] (a view)."""
        rows, hd = self.rows[layer], self.head_dim
        strides = (self.sequence_strides[layer], rows * hd, hd, 1)
        return buffer.as_strided((self.batch, self.kv_heads, rows, hd), strides,
                                 buffer.storage_offset() + self.offsets[layer])

    def passes(self, n: int) -> list[tuple[int, int]]:
        """A prefill of n rows as [first, end) passes of at most chunk_rows rows (one pass without rings)."""
        step = self.chunk_rows or n
        return [(first, min(n, first + step)) for first in range(0, n, step)]


class KvCache:
    """K and V buffers of a KvLayout (bf16, zeroed), and each layer's view of them."""

    def __init__(self, layout: KvLayout, device, dtype=torch.bfloat16):
        self.layout = layout
        self.k = torch.zeros(layout.elements, device=device, dtype=dtype)
        self.v = torch.zeros(layout.elements, device=device, dtype=dtype)
        self.k_layers = tuple(layout.layer_view(self.k, i) for i in range(len(layout.rows)))
        self.v_layers = tuple(layout.layer_view(self.v, i) for i in range(len(layout.rows)))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def sequence(self, slot: int = 0) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """K and V of sequence `slot`, a [kv_heads, rows, head_dim] view a layer (torch_model's caches)."""
        return tuple(k[slot] for k in self.k_layers), tuple(v[slot] for v in self.v_layers)


def cache_rows(cache: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Positions [first, end) of one layer's cache [kv_heads, rows, head_dim] (a ring's rows p % rows) as
    [kv_heads, end - first, head_dim]; they must all still be held (end - first <= rows)."""
    rows = cache.shape[1]
    if end - first > rows:
        raise MkportError(f"positions {first}..{end - 1}: a cache of {rows} rows holds {rows} of them at most")
    at = first % rows
    if at + end - first <= rows:
        return cache[:, at : at + end - first]
    return torch.cat([cache[:, at:], cache[:, : at + end - first - rows]], dim=1)


def write_cache_rows(cache: torch.Tensor, first: int, values: torch.Tensor) -> None:
    """values [kv_heads, n, head_dim] into one layer's cache at positions first..first+n-1 (a ring's rows p % rows;
    of more rows than it holds, the last ones, which are what a later position reads)."""
    rows, n = cache.shape[1], values.shape[1]
    if n > rows:
        first, values, n = first + n - rows, values[:, n - rows :], rows
    at = first % rows
    head = min(n, rows - at)
    cache[:, at : at + head] = values[:, :head]  # rounded to the cache's dtype in the copy
    if head < n:
        cache[:, : n - head] = values[:, head:]
