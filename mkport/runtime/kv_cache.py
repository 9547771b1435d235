"""The KV cache's layout, once: how many rows each layer keeps, where they sit in one flat buffer, and its bytes. The
megakernel's Decoder, GraphDecoder and the server's memory fit (serve.batched.stream_bytes) all take it from here.

A full-attention layer keeps a row for every position (a batch one more a sequence: the spare row where a sequence
left out of a step writes). A sliding layer keeps a ring (interface.ring_rows: its window and one prefill pass) when
that is fewer: position p sits at row p % rows. The megakernel's buffer without sliding layers is [sequence][layer]
[kv head][row][head_dim], its fixed strides; with them [layer][sequence][kv head][row][head_dim], and the kernel finds
each layer through its table (interface.KV_CACHE_LAYER_FIELDS): the layers differ in rows. GraphDecoder's is
layer-major too (a layer's rows of every sequence are one batch of matrices), without rings (it masks by position).
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
        """The layout of `batch` sequences of up to max_seq positions. rings=False: every layer full (a decoder whose
        attention reads the cache by position, GraphDecoder)."""
        full = max_seq + (1 if batch > 1 else 0)
        ring = [ring_rows(spec, i) if rings else 0 for i in range(spec.num_layers)]
        rows = tuple(min(r, full) if r else full for r in ring)
        head = spec.num_kv_heads * spec.head_dim  # elements of one row of every kv head
        if spec.sliding or not rings:  # layer-major: a layer's sequences one after another, each layer its own rows
            strides = tuple(r * head for r in rows)
            offsets, at = [], 0
            for stride in strides:
                offsets.append(at)
                at += batch * stride
        else:  # sequence-major, as the kernel strides it: sequence b, layer l at (b * layers + l) * rows * head
            strides = (spec.num_layers * full * head,) * spec.num_layers
            offsets = [i * full * head for i in range(spec.num_layers)]
            at = batch * strides[0]
        chunk = ring_chunk_rows(spec) if any(r < full for r, w in zip(rows, ring) if w) else 0
        return cls(batch, spec.num_kv_heads, spec.head_dim, full, rows, tuple(offsets), strides, at, chunk)

    def is_ring(self, layer: int) -> bool:
        return self.rows[layer] < self.full_rows

    def sequence_bytes(self, element_bytes: int = 2) -> int:
        """K and V of one sequence, every layer (bf16 by default)."""
        return 2 * sum(self.rows) * self.kv_heads * self.head_dim * element_bytes

    def layer_view(self, buffer: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer` of a flat buffer of this layout as [batch, kv_heads, rows, head_dim] (a view)."""
        rows, hd = self.rows[layer], self.head_dim
        return buffer.as_strided((self.batch, self.kv_heads, rows, hd), (self.sequence_strides[layer], rows * hd, hd, 1),
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
