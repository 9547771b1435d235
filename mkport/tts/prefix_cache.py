"""Prefix KV cache: the K/V of a prompt's leading rows that do not depend on the text (Prompt.prefix_rows:
instruct, role and codec control rows), computed once and copied into the KV cache of later requests, which
then prefill only the rows after them.

An entry is keyed by (the talker decoder, Prompt.prefix_key): the same key on the same decoder means the
same input rows through the same weights, so the same K/V; another speaker, language or instruction is
another key. Entries belong to one decoder object (they are dropped when it is garbage collected, so a new
decoder never sees them), and are evicted least recently used past `max_entries` or `max_bytes`.

A miss prefills the prefix rows alone (then the rest), so its K/V are those a hit copies in: a request's
codes do not depend on whether its prefix was cached.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from ..errors import MkportError
from ..runtime.decoder_api import SequenceDecoder

DEFAULT_MAX_ENTRIES = 64
# an entry of the 0.6B or 1.7B talker (28 layers, 8 KV heads of 128, bf16) is 112 KiB a row, ~1 MiB for the
# 9 rows of a prompt without an instruction
DEFAULT_MAX_BYTES = 256 << 20


def _nbytes(rows: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in rows)


class PrefixCache:
    """LRU map (decoder, prefix key) -> the decoder's cached_rows (K and V rows [layers, kv_heads, n, head_dim],
    and their exact values where the decoder keeps them) on its device. Thread-safe; a decoder's entries go
    when the decoder does."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise MkportError(f"a prefix cache needs room for an entry: max_entries={max_entries}, "
                              f"max_bytes={max_bytes} (pass no cache to turn it off)")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[int, tuple], tuple[torch.Tensor, ...]] = OrderedDict()
        self._owners: dict[int, weakref.finalize] = {}
        # ids of decoders collected since the last call: the finalizer only records them, since it may run
        # inside a call (garbage collection), and they are purged before an id can be used again
        self._dead: list[int] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, decoder, key: tuple) -> tuple[torch.Tensor, ...] | None:
        with self._lock:
            self._purge()
            rows = self._entries.get((id(decoder), key))
            if rows is None:
                self.misses += 1
                return None
            self._entries.move_to_end((id(decoder), key))
            self.hits += 1
            return rows

    def put(self, decoder, key: tuple, rows: tuple[torch.Tensor, ...]) -> None:
        """Stores rows (owned by the cache from now on); one larger than max_bytes is not kept."""
        size = _nbytes(rows)
        if size > self.max_bytes:
            return
        with self._lock:
            self._purge()
            owner = id(decoder)
            if owner not in self._owners:
                self._owners[owner] = weakref.finalize(decoder, self._dead.append, owner)
            old = self._entries.pop((owner, key), None)
            if old is not None:
                self.bytes -= _nbytes(old)
            self._entries[(owner, key)] = rows
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                self._evict(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._entries):
                self._evict(entry)

    def _evict(self, entry: tuple[int, tuple]) -> None:
        self.bytes -= _nbytes(self._entries.pop(entry))

    def _purge(self) -> None:
        while self._dead:
            owner = self._dead.pop()
            self._owners.pop(owner, None)
            for entry in [e for e in self._entries if e[0] == owner]:
                self._evict(entry)


# what generate_frames uses unless given another cache (or None: off); its bounds hold for the process
SHARED_CACHE = PrefixCache()


def prefill_prompt(decoder: SequenceDecoder, embeds: torch.Tensor, prefix_rows: int, prefix_key: tuple,
                   cache: PrefixCache | None) -> None:
    """Prefills embeds [N, input_dim] into `decoder` right after its reset. The first prefix_rows (0 < n <= N)
    are copied from `cache` when it holds them for this decoder, else prefilled alone and stored; the rest
    is prefilled after them. Without a cache (or a prefix), one prefill of all N rows."""
    n = prefix_rows
    # a prefix longer than the decoder keeps exact would be attended to as bf16 rows: prefilled in one pass
    if cache is None or not 0 < n <= min(embeds.shape[0], decoder.exact_prefix_rows):
        decoder.prefill(embeds=embeds)
        return
    rows = cache.get(decoder, prefix_key)
    if rows is None:
        decoder.prefill(embeds=embeds[:n])
        cache.put(decoder, prefix_key, decoder.cached_rows(n))
    else:
        decoder.load_rows(rows)
    if embeds.shape[0] > n:
        decoder.prefill(embeds=embeds[n:])
