"""GraphDecoder: a batch decoder in plain torch whose decode step is one CUDA graph for all B sequences.

The second backend of a batch (after the megakernel, runtime.Decoder(batch=B)), with the same interface, so that a
planner can measure both per model part and batch size. A step runs torch_model's layers on B rows at once
(each weight read once for all of them), with static shapes: every per-step value (positions, cache rows,
which sequences advance, sampling parameters) lives in one device buffer that the host fills before a replay,
and attention covers a fixed number of cache rows (a power-of-two bucket of the longest sequence, see
_context_rows) with each sequence masked to its own length. One graph is captured per (input kind, embedding
table, output head, context bucket) on its first use; on the CPU the same step runs eagerly.

Sampling is batched too, with the reference's semantics (torch_decoder.process_logits, torch_decoder.sample_token: logit
bias, repetition penalty, temperature, top-k with the lowest id first among equal logits, top-p, one draw); its
random numbers are a hash of (sequence's seed, steps since its reset) instead of a torch.Generator, so that the
whole draw stays on the device and in the graph. What that guarantees: greedy (temperature 0) is exactly the
argmax of the processed logits; a sampled sequence's tokens are reproducible for its seed and the same whatever
else runs in the batch (and on CPU or GPU up to float rounding), drawn from the reference's distribution, but
not the same tokens as TorchDecoder's or the kernel's for the same seed.
"""

from __future__ import annotations

import torch

from . import torch_model
from ..errors import MkportError
from .graphs import capture
from .decoder_api import (DEFAULT_MAX_SEQ, batch_arguments, check_slot, check_tokens, prefill_inputs,
                          prompt_positions, step_position)
from .sampling import SamplingParams, SuppressionBiases
from ..kernel.spec import LENGTH_DEPENDENT_ROPE, ModelSpec
from .kv_cache import KvCache, KvLayout
from .weights import DecoderWeights

# the rows of the step's input buffer, one column a sequence (the three float rows hold float64 bits)
POS = 0  # three rows: rope positions t, h, w
WRITE_ROW, LAST_ROW, ACTIVE, TOKEN, TOP_K, SEED = 3, 4, 5, 6, 7, 8
FLOATS = 9  # temperature, top_p, repetition penalty
ROWS = 12
STAGING_BUFFERS = 4  # host buffers used in turn, so that filling one need not wait for the copy out of another

# splitmix64's constants, as signed 64-bit integers (torch's int64 arithmetic wraps)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) a sequence from its seed and step counter (int64): splitmix64 of the seed's
    stream at that step, so a sequence's numbers depend on nothing else in its batch."""
    return _shift_right(_mix(_mix(seeds) + (steps + 1) * _GOLDEN), 11).double() * 2.0**-53


def process_logits_rows(logits: torch.Tensor, bias: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor,
                        temperature: torch.Tensor) -> torch.Tensor:
    """torch_decoder.process_logits for rows [B, V] at once: + bias [B, V], repetition penalty [B] on seen [B, V]
    (a penalty of 1 leaves a logit as it is), / temperature [B] where it is > 0 (greedy rows keep theirs)."""
    l = logits.float() + bias
    r = penalty[:, None]
    l = torch.where(seen, torch.where(l > 0, l / r, l * r), l)
    t = temperature[:, None]
    return torch.where(t > 0, l / torch.where(t > 0, t, 1.0), l)


def sample_rows(l: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor,
                u: torch.Tensor) -> torch.Tensor:
    """torch_decoder.sample_token for rows [B, V] of processed logits at once: the argmax (lowest id on ties) where
    greedy; else top_k [B] (1..V) highest, ordered by logit then id, top_p [B] keeping token j while the mass of
    j and all below it exceeds 1 - top_p, and a draw at u [B] (uniform in [0, 1)). Token ids int64 [B]."""
    vocab = l.shape[-1]
    vals, ids = torch.sort(l, dim=-1, descending=True, stable=True)  # stable: lowest id first among equals
    in_k = torch.arange(vocab, device=l.device) < top_k[:, None]
    p = torch.softmax(vals.double().masked_fill(~in_k, float("-inf")), -1)
    below = p.flip(-1).cumsum(-1).flip(-1)  # mass of j and all below
    keep = in_k & (below > (1.0 - top_p)[:, None])
    keep[:, 0] = True
    mass = (p * keep).cumsum(-1)
    pick = torch.searchsorted(mass, (u * mass[:, -1])[:, None]).clamp(max=vocab - 1)
    return torch.where(greedy, l.argmax(-1), ids.gather(1, pick)[:, 0])


class _Staging:
    """Host rows copied into a device buffer without the host waiting for the device: pinned buffers in turn,
    each written again only once the copy out of it has run (an event a buffer)."""

    def __init__(self, target: torch.Tensor):
        cuda = target.is_cuda
        count = STAGING_BUFFERS if cuda else 1
        self.target = target
        self.buffers = [torch.zeros(target.shape, dtype=target.dtype, pin_memory=cuda) for _ in range(count)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(count)]
        self.turn = 0

    def next(self) -> torch.Tensor:
        """The host buffer to fill for the next send()."""
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
        return self.buffers[self.turn]

    def send(self) -> None:
        self.target.copy_(self.buffers[self.turn], non_blocking=True)
        if self.events[self.turn] is not None:
            self.events[self.turn].record()
        self.turn = (self.turn + 1) % len(self.buffers)


class GraphDecoder:
    """`batch` sequences, each with its own KV cache rows, length, repetition history, logit bias and random
    stream, prefilled one at a time (prefill_slot, eagerly) and advanced together (step_batch): the batch
    interface (decoder_api.BatchDecoder; see Decoder.step_batch) in plain torch.

    On CUDA the matrices stay bf16 as stored (torch_model.linear reads them so, to fp32 accuracy) and the KV
    cache is bf16 as the megakernel's (`kv_dtype` overrides): a step reads the bytes the megakernel's reads, so
    that a planner compares like with like. On the CPU both are fp32, as TorchDecoder's (equal within 1e-5).
    The cache is kv_cache.KvLayout's without rings, a layer's [batch, kv_heads, max_seq + 1, head_dim] (layer-major,
    so that a layer's rows of all sequences are one strided batch of matrices; the extra row a sequence is where one
    left out of a step writes): its step masks the rows by position, which a ring's rows are not. `graphs=False` runs
    every step eagerly on CUDA too (the reference for the graphs)."""

    def __init__(self, spec: ModelSpec, weights: DecoderWeights, max_seq: int | None = None, batch: int = 1,
                 device="cuda", graphs: bool = True, kv_dtype: torch.dtype | None = None):
        if batch < 1:
            raise MkportError(f"batch {batch}: a batch holds at least one sequence")
        if spec.attn_logit_softcap or spec.local_rope is not None:  # _attend and the step's one RoPE have neither
            raise MkportError(f"{spec.name} ({spec.family}): the graphs backend does not run soft-capped attention or "
                              "per-layer-type RoPE yet; use --backend reference")
        if spec.rope.variant in LENGTH_DEPENDENT_ROPE:  # one captured step serves every length of every sequence
            raise MkportError(f"{spec.name} ({spec.family}): the graphs backend does not run {spec.rope.variant} RoPE "
                              "(frequencies that follow each sequence's length) yet; use --backend reference")
        self.spec, self.batch, self.device = spec, batch, torch.device(device)
        self.max_seq = max_seq or min(spec.max_position, DEFAULT_MAX_SEQ)
        if self.max_seq > spec.max_context:
            raise MkportError(f"max_seq={self.max_seq} is past {spec.max_context_text}")
        cuda = self.device.type == "cuda"
        if cuda:
            self.weights = torch_model.prefill_weights(weights.to(self.device))
        else:  # what torch_model.linear computes on the CPU anyway, converted once instead of every call
            self.weights = weights.map(lambda t: t.to(self.device, torch.float32).contiguous())
        kv_dtype = kv_dtype or (torch.bfloat16 if cuda else torch.float32)
        self.kv = KvCache(KvLayout.of(spec, self.max_seq, batch, rings=False), self.device, kv_dtype)
        f32 = dict(device=self.device, dtype=torch.float32)
        vocab = spec.vocab_size
        self.hidden = torch.zeros(batch * spec.hidden_size, **f32)
        self.token_out = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.input_embed = torch.zeros(batch, spec.input_dim, **f32)
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=self.device)
        self.logit_bias = torch.zeros(batch, vocab, **f32)
        self.steps = torch.zeros(batch, dtype=torch.int64, device=self.device)  # each random stream's counter
        self.inputs = torch.zeros(ROWS, batch, dtype=torch.int64, device=self.device)  # the step's static inputs
        self.lengths = [0] * batch
        self.graphs = graphs and cuda
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._staging = _Staging(self.inputs)
        self._biases = SuppressionBiases(vocab, self.device)
        self._rope_tables = torch_model.rope_device_tables(spec, self.device)
        # a sequence's cache row r of kv head h is row (b * kv_heads + h) * full_rows + r of a layer's cache
        heads = torch.arange(batch * spec.num_kv_heads, device=self.device).view(batch, spec.num_kv_heads)
        self._head_rows = heads * self.kv.layout.full_rows
        self._cache_rows = torch.arange(self.max_seq, device=self.device)

    # -- state --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empties every sequence (cache, repetition history) and restarts its random stream."""
        self.lengths = [0] * self.batch
        self.seen.zero_()
        self.steps.zero_()

    def reset_slot(self, slot: int) -> None:
        """reset() for one sequence: a new request can take it."""
        check_slot(slot, self.batch)
        self.lengths[slot] = 0
        self.seen[slot].zero_()
        self.steps[slot].zero_()

    def set_suppressed(self, token_ids) -> None:
        """Token ids no sequence samples (a -inf logit bias); empty clears it."""
        for slot in range(self.batch):
            self.set_suppressed_slot(slot, token_ids)

    def set_suppressed_slot(self, slot: int, token_ids) -> None:
        """set_suppressed for one sequence."""
        check_slot(slot, self.batch)
        bias = self._biases.of(token_ids)
        if bias is None:
            self.logit_bias[slot].zero_()
        else:
            self.logit_bias[slot].copy_(bias)

    # -- prefill ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill_slot(self, slot: int, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor:
        """One sequence's prompt (token ids or input embeddings [N, input_dim]) after its current length, into
        its own cache, eagerly (torch_model.prefill_forward). Returns the final-normed hidden states [N, hidden]."""
        check_slot(slot, self.batch)
        inputs, tokens = prefill_inputs(self.spec, tokens, embeds, table, self.device)
        n, start = inputs.shape[0], self.lengths[slot]
        if start + n > self.max_seq:
            raise MkportError(f"sequence {slot}: position {start + n - 1} is past the KV cache length {self.max_seq}")
        pos = prompt_positions(positions, n, start, self.device)
        hidden = torch_model.prefill_forward(self.spec, self.weights, inputs, pos, *self.kv.sequence(slot), start,
                                             table, self._rope_tables)
        if tokens is not None:
            self.seen[slot, tokens] = True
        self.lengths[slot] += n
        return hidden

    # -- decode -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step_batch(self, tokens=None, embeds: torch.Tensor | None = None, positions=None, table: int = 0,
                   head: int = 0, sampling=SamplingParams(), active=None) -> torch.Tensor:
        """One decode step of every sequence. Inputs: `tokens`, one entry a sequence (a token id, or None for the
        token that sequence sampled last, kept on the device), or `embeds` [batch, input_dim]. `positions`:
        None (each sequence's length), or one entry a sequence (None, an int or a (t, h, w) triplet).
        `sampling`: one SamplingParams for all or one a sequence. `active`: which sequences advance (default
        all); one left out keeps its state (cache, length, history, random stream, hidden, token_out).
        Returns the sampled tokens (device int32 [batch]); `hidden` holds the final-normed states
        [batch * hidden]."""
        s, n = self.spec, self.batch
        tokens = None if embeds is not None else [None] * n if tokens is None else list(tokens)
        active, sampling, positions = batch_arguments(s, n, active, sampling, positions, head, tokens)
        if embeds is not None:
            if embeds.numel() != n * s.input_dim:
                raise MkportError(f"step_batch: embeds has {embeds.numel()} values, not batch x input_dim = "
                                  f"{n} x {s.input_dim}")
            table = 0  # not read: one graph for every table
        else:
            check_tokens(self.spec, [t for t in tokens if t is not None], table)
        for b in range(n):
            if active[b] and self.lengths[b] >= self.max_seq:
                raise MkportError(f"sequence {b}: position {self.lengths[b]} is past the KV cache length "
                                  f"{self.max_seq}")
        self._fill_inputs(self._staging.next(), tokens, positions, sampling, active)
        self._staging.send()
        if embeds is not None:
            self.input_embed.copy_(embeds.reshape(n, s.input_dim))
        longest = max((self.lengths[b] + 1 for b in range(n) if active[b]), default=1)
        self._run(embeds is not None, table, head, torch_model.prefill_bucket(longest, self.max_seq))
        for b in range(n):
            if active[b]:
                self.lengths[b] += 1
        return self.token_out

    def _fill_inputs(self, rows: torch.Tensor, tokens, positions, sampling, active) -> None:
        """The step's input rows (ROWS x batch, on the host) for the sequences' lengths."""
        vocab, spare = self.spec.vocab_size, self.max_seq
        columns = []
        for b in range(self.batch):
            at, length, sp = positions[b], self.lengths[b], sampling[b]
            pos = step_position(at, length)
            token = -1 if tokens is None or tokens[b] is None else int(tokens[b])  # -1: the last sampled
            columns.append([*pos, length if active[b] else spare, length if active[b] else 0, int(active[b]), token,
                            min(sp.top_k, vocab) or vocab, sp.seed])
        rows[:FLOATS] = torch.tensor(columns, dtype=torch.int64).t()
        floats = [[sp.temperature, sp.top_p, sp.repetition_penalty] for sp in sampling]
        rows[FLOATS:].view(torch.float64).copy_(torch.tensor(floats, dtype=torch.float64).t())

    def _run(self, embeds: bool, table: int, head: int, context: int) -> None:
        """The step for these static choices: eagerly, or as its graph (captured on first use)."""
        key = (embeds, table, head, context)
        if not self.graphs:
            self._step(*key)
            return
        if key not in self._graphs:
            # capture runs the step once eagerly first; the state that run advances is put back
            state = [self.token_out, self.steps, self.seen]
            saved = [t.clone() for t in state]
            self._graphs[key], _ = capture(lambda: self._step(*key), self._pool)
            for t, kept in zip(state, saved):
                t.copy_(kept)
        self._graphs[key].replay()

    def _step(self, embeds: bool, table: int, head: int, context: int) -> None:
        """The step on the static buffers (capture-safe: no host syncs, shapes fixed by the arguments)."""
        s, w, n, p = self.spec, self.weights, self.batch, self.inputs
        active = p[ACTIVE].bool()
        if embeds:
            x = torch_model.embed_inputs(s, w, None, self.input_embed)
        else:
            given = p[TOKEN]
            x = torch_model.embed_inputs(s, w, torch.where(given >= 0, given, self.token_out.long()), None, table)
        cos, sin = torch_model.rope_cos_sin(s, p[POS : POS + 3], self._rope_tables)
        write = (self._head_rows + p[WRITE_ROW][:, None]).reshape(-1)
        rows, last = self._cache_rows[:context], p[LAST_ROW][:, None]
        mask = rows <= last  # [batch, context]
        masks = {window: mask & (rows > last - window) if window else mask  # a sliding layer's rows last-W+1..last
                 for window in {s.window(i) for i in range(s.num_layers)}}
        h = torch_model.decoder_layers(s, w, x, cos, sin,
                                       lambda i, q, k, v: self._attend(i, q, k, v, write, masks[s.window(i)]))
        hidden = self.hidden.view(n, s.hidden_size)
        hidden.copy_(torch.where(active[:, None], h, hidden))
        temperature, top_p, penalty = p[FLOATS:].view(torch.float64)
        l = process_logits_rows(torch_model.logits(s, w, h, head), self.logit_bias, self.seen, penalty.float(),
                                temperature.float())
        tok = sample_rows(l, p[TOP_K], top_p, temperature <= 0, uniforms(p[SEED], self.steps))
        self.token_out.copy_(torch.where(active, tok.int(), self.token_out))
        self.seen.scatter_(1, tok[:, None], self.seen.gather(1, tok[:, None]) | active[:, None])
        self.steps.add_(active.long())

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, write: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Each sequence's new K/V into its cache rows `write`, then its attention over the first `context`
        rows, masked to its own (mask [batch, context]). q [batch, heads, hd], k and v [batch, kv_heads, hd]."""
        s, n = self.spec, self.batch
        nkv, g, hd, context = s.num_kv_heads, s.gqa_ratio, s.head_dim, mask.shape[1]
        k_cache, v_cache = self.kv.k_layers[layer], self.kv.v_layers[layer]
        k_cache.view(-1, hd).index_copy_(0, write, k.reshape(-1, hd).to(k_cache.dtype))
        v_cache.view(-1, hd).index_copy_(0, write, v.reshape(-1, hd).to(v_cache.dtype))
        keys = k_cache[:, :, :context].reshape(n * nkv, context, hd)  # views: no copy of the cache
        values = v_cache[:, :, :context].reshape(n * nkv, context, hd)
        # query heads j * g .. j * g + g - 1 share kv head j (GQA), one matrix product per (sequence, kv head)
        scores = torch_model.mixed_bmm(q.reshape(n * nkv, g, hd), keys.transpose(1, 2)) * s.attention_scale
        scores = scores.view(n, nkv * g, context).masked_fill(~mask[:, None, :], float("-inf"))
        attn = torch_model.mixed_bmm(scores.softmax(-1).view(n * nkv, g, context), values)
        return attn.view(n, s.num_heads, hd)
