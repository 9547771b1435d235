"""Decoder: the one object callers use to run a megakernel. It owns the weights on the GPU, the KV cache,
every scratch buffer and the attention counters, so two decoders in one process never share state."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import prefill, torch_model
from ..kernel.build import build_library, device_ptr
from ..kernel.cache import BUILDS, cache_root
from ..errors import MkportError
from .graphs import capture, pad_rows
from ..kernel.gpu import KNOWN_TARGETS, GpuTarget
from ..kernel.interface import (
    LINEAR_STATE_FIELDS, PARAM_FIELDS, TIMELINE_EVENTS, KernelParams, Tap, TraceLayout,
    kernel_params, layer_fields, layer_writes, profile_phases, trace_layer_fields,
)
from ..kernel.render import SAMPLE_MAX_K, dynamic_rope_table, render
from ..kernel.spec import LENGTH_DEPENDENT_ROPE, ModelSpec
from ..kernel.launch_plan import DEFAULT_KERNEL, LaunchPlan, moe_act_floats, plan_launch
from .kv_cache import KvCache, KvLayout, write_cache_rows
from .weights import DecoderWeights

DEFAULT_MAX_SEQ = 4096
# prefill starts other than 0 that get CUDA graphs in a decoder (the prompt prefix lengths a prefix cache
# loads: a few per model; an instruction's length makes one more); later starts run eagerly
PREFILL_GRAPH_STARTS = 8
# prompt rows whose exact (fp32) K/V a decoder keeps beside its bf16 cache: a prompt prefix of up to this many
# rows, prefilled apart and continued later (mkport.tts.prefix_cache), then gives what one pass gives
PROMPT_KV_ROWS = 64


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise MkportError("no CUDA GPU is visible: this command runs the megakernel (generate --check needs none)")


def current_device_target(device_index: int = 0) -> GpuTarget:
    """The target read off the present CUDA device (torch reads it: the kernel floor has only the table)."""
    if not torch.cuda.is_available():
        raise MkportError("no CUDA GPU is visible; the megakernel needs one (use --arch to render/compile only)")
    props = torch.cuda.get_device_properties(device_index)
    arch = f"sm_{props.major}{props.minor}"
    smem = getattr(props, "shared_memory_per_block_optin", 0) or KNOWN_TARGETS.get(arch, KNOWN_TARGETS["sm_80"]).smem_per_block
    return GpuTarget(
        arch=arch,
        name=props.name,
        sm_count=props.multi_processor_count,
        smem_per_block=int(smem),
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
        max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 2048)),
    )


SEED_MAX = 2**63 - 1  # the kernel takes its seed as a signed 64-bit integer


def check_seed(seed: int, option: str = "seed") -> None:
    if not 0 <= seed <= SEED_MAX:
        raise MkportError(f"{option} {seed}: a seed is an integer from 0 to 2**63-1")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 samples the whole distribution; top_p < 1 needs top_k >= 1."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def validate(self, vocab: int) -> None:
        check_seed(self.seed)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise MkportError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if not 0 <= self.top_k <= SAMPLE_MAX_K:
            raise MkportError(f"top_k={self.top_k}: supported 0 (off) to {SAMPLE_MAX_K}")
        if not 0 < self.top_p <= 1:
            raise MkportError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_p < 1 and self.top_k == 0 and self.temperature > 0:
            raise MkportError(f"top_p={self.top_p} needs top_k between 1 and {SAMPLE_MAX_K}")
        if not self.repetition_penalty > 0:
            raise MkportError(f"repetition_penalty={self.repetition_penalty}: must be > 0")


GREEDY = SamplingParams()


@functools.lru_cache(maxsize=1024)
def _validated(sampling: SamplingParams, vocab: int) -> None:
    """SamplingParams.validate, once per value: a batch checks every sequence's at each of its steps."""
    sampling.validate(vocab)


def suppression_bias(token_ids, vocab_size: int, device) -> torch.Tensor | None:
    """An additive logit bias of -inf on the given ids (None when there are none)."""
    ids = list(token_ids)
    if not ids:
        return None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise MkportError(f"suppressed token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    bias = torch.zeros(vocab_size, device=device)
    bias[ids] = float("-inf")
    return bias


def _positions(position, n: int, start: int, device) -> torch.Tensor:
    """[3, n] rope positions from None (start..start+n on all streams), an int, or a (t, h, w) triplet."""
    if position is None:
        pos = torch.arange(start, start + n, device=device)
        return pos.expand(3, n).contiguous()
    if isinstance(position, torch.Tensor):
        return position.to(device=device, dtype=torch.int64).reshape(3, n)
    if isinstance(position, int):
        return torch.full((3, n), position, device=device, dtype=torch.int64)
    return torch.tensor(position, device=device, dtype=torch.int64).reshape(3, n)


def _sequence_position(at, length: int) -> list[int]:
    """A sequence's (t, h, w) position at a decode step: its length, an int for all three, or a triplet as given
    (torch only for a tensor: host time a step)."""
    if at is None:
        return [length] * 3
    if isinstance(at, int):
        return [at] * 3
    return _positions(at, 1, length, "cpu").reshape(3).tolist()


def check_slot(slot: int, batch: int) -> None:
    if not 0 <= slot < batch:
        raise MkportError(f"sequence {slot} does not exist (0..{batch - 1})")


def check_table(spec: ModelSpec, table: int) -> None:
    if not 0 <= table < spec.num_embedding_tables:
        raise MkportError(f"embedding table {table} does not exist (0..{spec.num_embedding_tables - 1})")


def check_tokens(spec: ModelSpec, tokens, table: int) -> None:
    """Token ids (a host tensor or list: no device sync) of table `table`, in the vocabulary."""
    check_table(spec, table)
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    bad = tokens[(tokens < 0) | (tokens >= spec.vocab_size)]
    if bad.numel():
        raise MkportError(f"token id {int(bad[0])}: token ids must be in 0..{spec.vocab_size - 1}")


def batch_arguments(spec: ModelSpec, n: int, active, sampling, positions, head: int, tokens=None) -> tuple[list, list, list]:
    """step_batch's per-sequence arguments (shared by the batch decoders) as lists of n, checked: `active`
    (default all), `sampling` (one SamplingParams for all, or one a sequence), `positions` (default None each),
    and the output head; `tokens`, when a list is given, must have n entries too."""
    active = [True] * n if active is None else [bool(a) for a in active]
    sampling = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    positions = [None] * n if positions is None else list(positions)
    given = [("active", active), ("sampling", sampling), ("positions", positions)]
    for name, values in given + ([("tokens", list(tokens))] if tokens is not None else []):
        if len(values) != n:
            raise MkportError(f"step_batch: {name} has {len(values)} entries for a batch of {n}")
    for sp in set(sampling):  # each distinct one once: a batch mostly shares a few
        _validated(sp, spec.vocab_size)
    if not 0 <= head < spec.num_output_heads:
        raise MkportError(f"output head {head} does not exist (0..{spec.num_output_heads - 1})")
    return active, sampling, positions


class CachedRows:
    """Copying the first rows of a decoder's KV cache out and back in (a prompt prefix's K/V, saved by one
    request for the next: mkport.tts.prefix_cache). For classes with spec, max_seq, length, _check_room and
    _layer_caches (K and V, layer i's [kv_heads, rows, head_dim] at [i])."""

    def cached_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of cache rows 0..n-1 (n <= length), [layers, kv_heads, n, head_dim]."""
        if not 0 < n <= self.length:
            raise MkportError(f"cached_rows({n}): the cache holds {self.length} rows")
        k, v = self._layer_caches()
        if any(layer.shape[1] < self.max_seq for layer in k):
            raise MkportError(f"cached_rows: {self.spec.name}'s sliding layers keep a ring of their last rows, not a "
                              "prompt's first ones")
        return torch.stack([layer[:, :n] for layer in k]), torch.stack([layer[:, :n] for layer in v])

    def load_rows(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Puts rows from cached_rows into an empty cache (after reset): the state after prefilling the
        prompt they came from (its hidden states aside)."""
        k, v = rows
        if self.length:
            raise MkportError(f"load_rows needs an empty KV cache (reset first); it holds {self.length} rows")
        s = self.spec
        if k.shape != v.shape or k.shape[:2] + k.shape[3:] != (s.num_layers, s.num_kv_heads, s.head_dim):
            raise MkportError(f"KV rows of shape {tuple(k.shape)} do not fit this decoder's cache of "
                              f"{s.num_layers} layers of {s.num_kv_heads} kv heads of {s.head_dim}")
        n = k.shape[2]
        self._check_room(n)
        for cache, layers in zip(self._layer_caches(), (k, v)):
            for i, layer in enumerate(layers):
                write_cache_rows(cache[i], 0, layer)
        self.length = n


class Decoder(CachedRows):
    def __init__(
        self,
        spec: ModelSpec,
        weights: DecoderWeights,
        max_seq: int | None = None,
        trace: bool = False,
        profile: bool = False,
        log=None,
        prefill_graphs: bool = True,  # False: every prefill runs eagerly (the reference for the graphs)
        fused_prefill: bool = True,  # False: the prefill runs torch_model's plain torch (the reference for mkport.runtime.prefill)
        plan: LaunchPlan | None = None,
        kernel: str = DEFAULT_KERNEL,
        batch: int = 1,
        share: Decoder | None = None,
    ):
        """`plan` replaces the launch-plan rule's plan for this GPU (to compare plan variants in one process);
        `kernel` picks the kernel design (launch_plan.KERNELS) when no plan is given. `batch` > 1 makes a batch decoder: `batch` sequences, each
        with its own KV cache, prefilled one at a time (prefill_slot) and advanced together (step_batch). `share`: a batch
        decoder of as many sequences or more, whose first `batch` sequences this one steps (step_batch only): their KV
        caches, repetition histories, logit biases, lengths and step counts are that decoder's (views), so a sequence
        prefilled there steps here, at the cost of a `batch`-sequence step (a batch sized to the live sequences)."""
        target = current_device_target()
        self.spec, self.trace_enabled = spec, trace
        self.plan: LaunchPlan = plan or plan_launch(spec, target, kernel, batch=batch)
        self.batch = b = self.plan.batch
        sources = render(spec, self.plan)
        src_dir = sources.write(cache_root() / BUILDS)
        self.kernel, self.build_cached = build_library(src_dir, target.arch, trace, profile, log=log)
        fitting = self.kernel.blocks_per_sm() * target.sm_count
        if fitting < self.plan.grid:
            raise MkportError(
                f"only {fitting} blocks of the kernel fit on {target.name} at once, the plan needs "
                f"{self.plan.grid}: a cooperative launch would fail"
            )
        self.max_seq = max_seq or min(spec.max_position, DEFAULT_MAX_SEQ)
        # dynamic NTK scales from max_position_embeddings: running past it is what its raised base is for
        if self.max_seq > spec.max_position and spec.rope.variant != "dynamic":
            raise MkportError(f"max_seq={self.max_seq} is past max_position_embeddings={spec.max_position}")
        dev = torch.device("cuda")
        self.device = dev
        # dynamic NTK's frequencies for every length a step can have, made once on the host exactly as the prefill's
        # (render.rope_tables): a step only indexes it by its position, so nothing is copied between steps
        self.rope_table = (torch.from_numpy(dynamic_rope_table(spec, self.max_seq)).to(dev)
                           if spec.rope.variant == "dynamic" else None)
        self.weights = weights.to(dev)
        # a hybrid's Gated DeltaNet state (fp32, the sequence's like the KV cache): the kernel's decode steps and the
        # prefill's chunked scan advance the same tensors; zeroed by reset
        self.linear_state = torch_model.LinearState.zeros(spec, dev) if spec.linear_layers else None

        # the KV cache (kv_cache.KvLayout: a sliding layer's ring; a batch's spare row a sequence, where a sequence
        # left out of a step writes)
        if share is not None:
            if share.batch < b or share.spec != spec or share.max_seq != self.max_seq or share.batch == 1:
                raise MkportError(f"a decoder of {b} sequences shares a batch decoder of the same spec and max_seq "
                                  f"and at least {max(b, 2)} sequences, not {share.batch}")
            # its first b sequences' rows: the kernel strides the sequences as that decoder's does
            self.kv = share.kv
        else:
            self.kv = KvCache(KvLayout.of(spec, self.max_seq, b), dev)

        def state_of(layer: int, field: str):
            if self.linear_state is None or not spec.is_linear(layer):
                return None
            slot = spec.linear_layers.index(layer)
            return (self.linear_state.conv if field == "conv_state" else self.linear_state.recurrent)[slot]

        self._layer_table = torch.tensor(
            [[0 if t is None else t.data_ptr()
              for f in layer_fields(spec)
              for t in [state_of(i, f) if f in LINEAR_STATE_FIELDS else getattr(lw, f)]]
             for i, lw in enumerate(self.weights.layers)],
            dtype=torch.int64,
            device=dev,
        )
        s, f32 = spec, dict(device=dev, dtype=torch.float32)
        la = s.linear_attention
        # every buffer holds the batch's sequences one after another
        self.x = torch.zeros(b * s.hidden_size, **f32)
        # q/k/v rows, then a hybrid's output gate rows; or a Gated DeltaNet's input projections (q/k/v, z, b, a)
        gate_rows = s.num_heads * s.head_dim if s.attn_output_gate else 0
        self.qkv = torch.zeros(b * max(s.qkv_rows + gate_rows, la.in_rows if la else 0), **f32)
        self.attn_part = torch.zeros(b * s.num_heads * self.plan.attn_max_splits * s.head_dim, **f32)
        self.attn_ml = torch.zeros(b * s.num_heads * self.plan.attn_max_splits * 2, **f32)
        self.attn_counters = torch.zeros(b * s.num_kv_heads, device=dev, dtype=torch.int32)
        self.attn_out = torch.zeros(b * max(s.num_heads * s.head_dim, la.value_dim if la else 0), **f32)  # or read-outs
        self.act = torch.zeros(b * max(2 * s.intermediate_size, moe_act_floats(s)), **f32)  # gate rows, then up rows
        self.router_logits = torch.zeros(b * (s.moe.num_experts if s.moe else 1), **f32)
        self.forced_experts: torch.Tensor | None = None  # force_experts
        self.sub = torch.zeros(b * s.hidden_size, **f32)  # post-norm layers: a sublayer's output before its norm
        self.logits = torch.zeros(b * s.vocab_size, **f32)
        self.best_val = torch.zeros(b * self.plan.grid, **f32)
        self.best_id = torch.zeros(b * self.plan.grid, device=dev, dtype=torch.int32)
        self.hidden = torch.zeros(b * s.hidden_size, **f32)
        self.token_in = torch.zeros(b, device=dev, dtype=torch.int32)
        self.token_out = torch.zeros(b, device=dev, dtype=torch.int32)
        self.seen = share.seen[: b * s.vocab_size] if share else torch.zeros(b * s.vocab_size, device=dev, dtype=torch.uint8)
        self.input_embed = torch.zeros(b * s.input_dim, **f32)
        self.logit_bias: torch.Tensor | None = None
        self._logit_biases: dict[tuple, torch.Tensor | None] = {}
        self.slot_bias = torch.zeros(b, s.vocab_size, **f32) if b > 1 else None  # a batch's: a row a sequence
        if share is not None:
            self.slot_bias = share.slot_bias[:b]
        self.trace_layout = TraceLayout.of(spec)
        self.trace = torch.zeros(b * self.trace_layout.total if trace else 1, **f32)
        self.profile_enabled = profile
        self.phase_names = profile_phases(spec)
        self.profile_marks = torch.zeros(len(self.phase_names) + 1, device=dev, dtype=torch.int64)
        # every block's clock at each timeline event of each layer, then each block's origin (profile builds only)
        timeline_slots = (s.num_layers * len(TIMELINE_EVENTS) + 1) * self.plan.grid if profile else 1
        self.timeline_marks = torch.zeros(timeline_slots, device=dev, dtype=torch.int64)
        self.length = 0  # tokens in the KV cache
        self.steps = 0  # decode steps run, the sampler's counter
        self.lengths, self.slot_steps = [0] * b, [0] * b  # a batch decoder's, per sequence
        if share is not None:  # the same lists: step_batch reads and advances their first b entries
            self.lengths, self.slot_steps = share.lengths, share.slot_steps
        self.shared = share is not None
        # longrope's and dynamic's prefill picks its frequencies by its largest position, read back on the host
        # (torch_model.rope_cos_sin), which a CUDA graph cannot capture
        # a hybrid's neither: a padded row would advance its linear-attention state
        self.prefill_graphs = (prefill_graphs and spec.rope.variant not in LENGTH_DEPENDENT_ROPE
                               and not spec.linear_layers)
        self.prompt_kv = torch.zeros(2, s.num_layers, s.num_kv_heads, PROMPT_KV_ROWS, s.head_dim, **f32)
        self.exact_rows = 0  # the first rows of the cache whose exact K/V prompt_kv holds
        self.exact_prefix_rows = PROMPT_KV_ROWS
        self.fused_prefill = fused_prefill and prefill.supported(spec, self.weights)
        self._rope_tables = torch_model.rope_device_tables(spec, dev)
        self._prefill_weights = torch_model.prefill_weights(self.weights)
        # (slot, start, token input, table, bucket, exact rows) -> (graph, inputs, positions, hidden)
        self._prefill_graphs: dict = {}
        self._graph_starts: set[int] = set()  # starts other than 0 that replay graphs (_graph_start)
        self._graph_pool = torch.cuda.graph_pool_handle()
        self._params = self._kernel_params()

    def _kernel_params(self) -> KernelParams:
        """The kernel's Params with this decoder's buffers; step() writes the fields that change."""
        w = self.weights
        buffers = {
            "layers": self._layer_table, "embed": w.embed, "heads": w.heads, "final_norm": w.final_norm,
            "in_proj_w": w.in_proj_w, "in_proj_b": w.in_proj_b, "x": self.x, "qkv": self.qkv,
            "attn_part": self.attn_part, "attn_ml": self.attn_ml, "attn_counters": self.attn_counters,
            "attn_out": self.attn_out, "act": self.act, "sub": self.sub, "router_logits": self.router_logits,
            "forced_experts": None,
            "logits": self.logits, "best_val": self.best_val, "best_id": self.best_id, "k_cache": self.kv.k,
            "v_cache": self.kv.v, "hidden_out": self.hidden, "token_in": self.token_in,
            "token_out": self.token_out, "seen": self.seen, "logit_bias": None, "input_embed": self.input_embed,
            "rope_table": self.rope_table,
            "trace": self.trace if self.trace_enabled else None, "profile": self.profile_marks,
            "timeline": self.timeline_marks,
        }
        scalars = {name: 0 for name, c_type in PARAM_FIELDS if not c_type.endswith("*")}
        pointers = {k: device_ptr(t) for k, t in buffers.items()}
        return kernel_params({**pointers, **scalars, "max_seq": self.kv.layout.full_rows}, self.batch)

    # -- state --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empties the KV cache (every sequence's) and the repetition history; re-arms the attention counters."""
        if self.shared:
            raise MkportError("a decoder that shares another's sequences steps them only; reset that one")
        self.length = 0
        self.steps = 0
        self.exact_rows = 0
        self.lengths, self.slot_steps = [0] * self.batch, [0] * self.batch
        self.attn_counters.zero_()
        self.seen.zero_()
        if self.linear_state is not None:
            self.linear_state.reset()

    def _single(self, what: str) -> None:
        if self.batch > 1:
            raise MkportError(f"{what} runs one sequence; this decoder holds a batch of {self.batch}: use "
                              "prefill_slot and step_batch")

    def _no_linear_state(self, what: str) -> None:
        if self.linear_state is not None:
            raise MkportError(f"{what}: {self.spec.name}'s linear-attention state stands for every row, not only the "
                              "first ones: a hybrid's prompt prefix cannot be cached")

    def _layer_caches(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return self.kv.sequence(0)

    def cached_rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """As CachedRows, with the exact K/V of the rows when this decoder holds them."""
        self._no_linear_state("cached_rows")
        rows = super().cached_rows(n)
        return (*rows, self.prompt_kv[:, :, :, :n].clone()) if n <= self.exact_rows else rows

    def load_rows(self, rows: tuple[torch.Tensor, ...]) -> None:
        self._no_linear_state("load_rows")
        super().load_rows(rows[:2])
        self.exact_rows = 0
        if len(rows) == 3:
            self.prompt_kv[:, :, :, : self.length].copy_(rows[2])
            self.exact_rows = self.length

    def set_suppressed(self, token_ids) -> None:
        """Token ids the sampler never picks (an additive -inf bias on their logits), for every sequence; empty
        clears it. Each set's bias is made once (a host-to-device copy, which can wait for the device) and kept."""
        if self.batch > 1:
            for slot in range(self.batch):
                self.set_suppressed_slot(slot, token_ids)
            return
        self.logit_bias = self._suppression(token_ids)

    def set_suppressed_slot(self, slot: int, token_ids) -> None:
        """set_suppressed for one sequence of a batch (its row of the batch's bias, a copy on the device)."""
        check_slot(slot, self.batch)
        if self.batch == 1:
            self.set_suppressed(token_ids)
            return
        bias = self._suppression(token_ids)
        if bias is None:
            self.slot_bias[slot].zero_()
        else:
            self.slot_bias[slot].copy_(bias)

    def _suppression(self, token_ids) -> torch.Tensor | None:
        key = tuple(sorted(set(token_ids)))
        if key not in self._logit_biases:
            self._logit_biases[key] = suppression_bias(key, self.spec.vocab_size, self.device)
        return self._logit_biases[key]

    def _check_room(self, n: int, length: int | None = None) -> None:
        """n more rows fit after `length` (default: this decoder's; a batch sequence's for prefill_slot)."""
        length = self.length if length is None else length
        if length + n > self.max_seq:
            raise MkportError(
                f"position {length + n - 1} is past the KV cache length {self.max_seq} "
                "(raise max_seq, up to max_position_embeddings)"
            )

    def force_experts(self, experts: torch.Tensor | None) -> None:
        """A trace build of a mixture of experts: the next steps apply these experts, ids [layers, top_k] in
        ascending order (a dense layer's row is not read), instead of their routers' choice, which the experts tap
        still records; kernel_diff forces the reference's, so that every layer is compared on the same experts.
        None: each router's own choice again."""
        s = self.spec
        if not self.trace_enabled or s.moe is None or self.batch > 1:
            raise MkportError("forcing experts needs a trace build of a mixture of experts at batch 1")
        if experts is None:
            self.forced_experts, self._params.forced_experts = None, 0
            return
        ids = torch.as_tensor(experts).to(self.device, torch.int32).contiguous()
        if ids.shape != (s.num_layers, s.moe.top_k) or int(ids.min()) < 0 or int(ids.max()) >= s.moe.num_experts:
            raise MkportError(f"forced experts must be [{s.num_layers}, {s.moe.top_k}] ids below {s.moe.num_experts}, "
                              f"got {tuple(ids.shape)}")
        self.forced_experts = ids  # kept: the kernel reads it at every step
        self._params.forced_experts = ids.data_ptr()

    def _check_rope_positions(self, positions: list[int]) -> None:
        """Dynamic NTK: a step's position has a row in rope_table (positions below max_seq, or the original length)."""
        if self.rope_table is None:
            return
        end = self.spec.rope.original_max_position + self.rope_table.shape[0] - 1
        if max(positions) >= end:
            raise MkportError(f"position {max(positions)}: dynamic RoPE's frequencies are made for positions below "
                              f"{end} (raise max_seq)")

    # -- prefill ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens=None, embeds=None, positions=None, table: int = 0, routing: dict | None = None) -> torch.Tensor:
        """Runs a prompt of N tokens (or N input embeddings) in one pass, writing the KV cache.
        Returns the final-normed hidden states [N, hidden].

        The prompt replays a CUDA graph of the forward captured for its start and padded length (see
        _prefill_replay) when it starts at 0 (after reset) or at one of the first PREFILL_GRAPH_STARTS
        other starts seen, unless the decoder was made with prefill_graphs=False; else it runs eagerly.
        `routing` ({layer: expert ids [N, top_k]}, a mixture of experts) forces each sparse layer's experts, row by
        row, as force_experts does for the steps; such a prompt runs eagerly."""
        self._single("prefill")
        inputs, tokens = self._prefill_inputs(tokens, embeds, table)
        n = inputs.shape[0]
        self._check_room(n)
        pos = _positions(positions, n, self.length, self.device)
        hidden = []
        for first, end in self.kv.layout.passes(n):  # a sliding layer's ring takes a prompt a bounded pass at a time
            rows, start = slice(first, end), self.length
            if routing is not None:
                forced = {layer: ids[rows] for layer, ids in routing.items()}
                hidden.append(self._prefill_forward(inputs[rows], pos[:, rows], start, table, routing=forced))
            elif self.prefill_graphs and self._graph_start(start):
                hidden.append(self._prefill_replay(inputs[rows], pos[:, rows], table, start))
            else:
                hidden.append(self._prefill_forward(inputs[rows], pos[:, rows], start, table))
            if start == 0:
                self.exact_rows = min(end, PROMPT_KV_ROWS)
            self.length += end - first
        if tokens is not None:
            self.seen[tokens] = 1  # the real tokens only: padding never enters the repetition history
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def _prefill_inputs(self, tokens, embeds, table: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt's rows on the device, checked: (inputs, the token ids or None for embeddings)."""
        if (tokens is None) == (embeds is None):
            raise MkportError("prefill takes tokens or embeds, not both")
        if tokens is not None:
            tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
            check_tokens(self.spec, tokens, table)  # before the copy: no device sync for host tokens
            inputs = tokens = tokens.to(self.device)
        else:
            inputs = embeds.to(self.device, torch.float32).reshape(-1, self.spec.input_dim)
        if inputs.shape[0] == 0:
            raise MkportError("prefill needs at least one token")
        return inputs, tokens

    def _graph_start(self, start: int) -> bool:
        """Whether a prefill at `start` replays a graph: 0, and the first PREFILL_GRAPH_STARTS others (a
        start seen while there is room is taken)."""
        if start == 0 or start in self._graph_starts:
            return True
        if len(self._graph_starts) < PREFILL_GRAPH_STARTS:
            self._graph_starts.add(start)
            return True
        return False

    def _prefill_replay(self, inputs: torch.Tensor, pos: torch.Tensor, table: int, start: int,
                        slot: int | None = None) -> torch.Tensor:
        """The prefill at cache position `start` (of sequence `slot` of a batch: a graph each) as a CUDA graph
        replay: inputs and positions are padded at the end to a power-of-two bucket (torch_model.prefill_bucket
        says why that is exact) and copied into the graph's static buffers; the graph is captured on the first
        use of its (slot, start, bucket).

        The start is part of the key, a Python int fixed at capture: a start given as a device tensor
        would make the attention span the whole cache instead of the start + bucket rows. Starts other
        than 0 come from a prompt prefix loaded from a prefix cache (mkport.tts.prefix_cache), whose
        lengths are few; so that continuation prompts of any length do not capture graphs without end,
        only the first PREFILL_GRAPH_STARTS of them get graphs, and later starts run eagerly (_graph_start).
        The graph reads the cache rows before its start as they are at replay."""
        n = inputs.shape[0]
        bucket = torch_model.prefill_bucket(n, self.max_seq - start)
        inputs, pos = pad_rows(inputs, bucket), pad_rows(pos, bucket, dim=1)
        key = (slot, start, not inputs.is_floating_point(), table, bucket, min(start, self.exact_rows))
        if key not in self._prefill_graphs:
            static_inputs, static_pos = inputs.clone(), pos.clone()
            graph, hidden = capture(lambda: self._prefill_forward(static_inputs, static_pos, start, table, slot),
                                    self._graph_pool)
            self._prefill_graphs[key] = (graph, static_inputs, static_pos, hidden)
        graph, static_inputs, static_pos, hidden = self._prefill_graphs[key]
        static_inputs.copy_(inputs)
        static_pos.copy_(pos)
        graph.replay()
        return hidden[:n].clone()

    def _prefill_forward(self, inputs: torch.Tensor, pos: torch.Tensor, start: int, table: int,
                         slot: int | None = None, routing: dict | None = None) -> torch.Tensor:
        """The prefill's forward pass: mkport's fused kernels (mkport.runtime.prefill) where they apply, else torch.
        Rows before `start` that prompt_kv holds exactly are attended to as they were computed. `slot`: into
        that sequence's cache of a batch, which keeps no exact rows."""
        k, v = self.kv.sequence(0 if slot is None else slot)
        exact = 0 if slot is not None else min(start, self.exact_rows)
        if self.fused_prefill:
            return prefill.prefill_forward(self.kernel, self.spec, self.weights, inputs, pos, k, v, start, table,
                                           self.prompt_kv, exact)
        return torch_model.prefill_forward(self.spec, self._prefill_weights, inputs, pos, k, v, start, table,
                                           self._rope_tables, self.prompt_kv, exact, routing, self.linear_state)

    # -- decode -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        token=None,
        embed: torch.Tensor | None = None,
        position=None,
        table: int = 0,
        head: int = 0,
        sampling: SamplingParams = SamplingParams(),
    ) -> torch.Tensor:
        """One decode step on the megakernel. The input is a token id (int), an input embedding (a
        device tensor of input_dim), or, with neither, the token this decoder sampled last (kept on the
        device, no host round trip). Returns the sampled token as a device int32 tensor of one element;
        `self.hidden` holds the final-normed hidden state and `self.logits` the processed logits."""
        self._single("step")
        s = self.spec
        _validated(sampling, s.vocab_size)
        if not 0 <= head < s.num_output_heads:
            raise MkportError(f"output head {head} does not exist (0..{s.num_output_heads - 1})")
        self._check_room(1)
        token_ptr = self.token_in.data_ptr()
        input_kind = 0
        if embed is not None:
            self.input_embed.copy_(embed.reshape(s.input_dim))
            input_kind = 1
        elif token is not None:
            check_tokens(self.spec, torch.tensor([int(token)]), table)
            self.token_in.fill_(int(token))
        else:
            check_table(self.spec, table)
            token_ptr = self.token_out.data_ptr()  # read before the kernel writes it, see input_phase
        pos = _sequence_position(position, self.length)
        self._check_rope_positions([pos[0]])
        p = self._params  # pointers set once (_kernel_params); what changes from step to step:
        p.token_in = token_ptr
        p.seen = self.seen.data_ptr() if sampling.repetition_penalty != 1.0 else 0
        p.logit_bias = 0 if self.logit_bias is None else self.logit_bias.data_ptr()
        p.input_kind[0], p.table[0], p.head[0] = input_kind, table, head  # the one sequence's fields
        p.cache_pos[0], p.pos_t[0], p.pos_h[0], p.pos_w[0] = self.length, pos[0], pos[1], pos[2]
        p.attn_splits[0] = self.plan.attention_splits(self.length + 1)
        p.top_k[0], p.seed[0], p.rng_step[0] = min(sampling.top_k, s.vocab_size), sampling.seed, self.steps
        p.temperature[0], p.top_p[0] = sampling.temperature, sampling.top_p
        p.rep_penalty[0] = sampling.repetition_penalty
        self.kernel.launch(p, torch.cuda.current_stream().cuda_stream)
        self.length += 1
        self.steps += 1
        return self.token_out

    # -- batch ------------------------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        """Empties one sequence of a batch (its cache and repetition history): a new request can take it."""
        check_slot(slot, self.batch)
        self.lengths[slot], self.slot_steps[slot] = 0, 0
        self.seen[slot * self.spec.vocab_size : (slot + 1) * self.spec.vocab_size].zero_()

    @torch.no_grad()
    def prefill_slot(self, slot: int, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor:
        """A batch decoder's prefill of one sequence's prompt (tokens or input embeddings) after its current
        length, into its own cache. Returns the final-normed hidden states [N, hidden]. A prompt from position 0
        replays a CUDA graph of the sequence's slot and padded length (captured on first use, as prefill's);
        one that continues a sequence runs eagerly."""
        check_slot(slot, self.batch)
        inputs, tokens = self._prefill_inputs(tokens, embeds, table)
        n = inputs.shape[0]
        self._check_room(n, self.lengths[slot])
        pos = _positions(positions, n, self.lengths[slot], self.device)
        hidden = []
        for first, end in self.kv.layout.passes(n):  # a sliding layer's ring takes a prompt a bounded pass at a time
            rows, start = slice(first, end), self.lengths[slot]
            if self.prefill_graphs and start == 0:
                hidden.append(self._prefill_replay(inputs[rows], pos[:, rows], table, start, slot))
            else:
                hidden.append(self._prefill_forward(inputs[rows], pos[:, rows], start, table, slot))
            self.lengths[slot] += end - first
        if tokens is not None:
            vocab = self.spec.vocab_size
            self.seen[slot * vocab + tokens] = 1
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    @torch.no_grad()
    def step_batch(self, tokens=None, embeds: torch.Tensor | None = None, positions=None, table: int = 0,
                   head: int = 0, sampling=SamplingParams(), active=None) -> torch.Tensor:
        """One decode step of every sequence of the batch. Inputs: `tokens`, one entry a sequence (a token id,
        or None for the token that sequence sampled last, kept on the device), or `embeds` [batch, input_dim]
        on the device. `positions`: None (each sequence's length), or one entry a sequence (None, an int or a
        (t, h, w) triplet). `sampling`: one SamplingParams for all or one a sequence. `active`: which sequences
        advance (default all); one left out still runs, at a spare cache row, and keeps its state. Returns the
        sampled tokens (device int32 [batch]); `hidden` holds the final-normed states [batch * hidden].
        A decoder of batch 1 takes this API or prefill/step, not both between two resets (each keeps its own
        length)."""
        s, n = self.spec, self.batch
        given_tokens = None if embeds is not None or tokens is None else tokens
        active, sampling, positions = batch_arguments(s, n, active, sampling, positions, head, given_tokens)
        for b in range(n):
            if active[b] and self.lengths[b] >= self.max_seq:
                raise MkportError(f"sequence {b}: position {self.lengths[b]} is past the KV cache length {self.max_seq}")
        p = self._params
        if embeds is not None:
            self.input_embed.copy_(embeds.reshape(n * s.input_dim))
            kind = 1
        else:
            check_table(self.spec, table)
            tokens = [None] * n if tokens is None else list(tokens)
            given = {b: int(t) for b, t in enumerate(tokens) if t is not None}
            if given:
                check_tokens(self.spec, torch.tensor(list(given.values())), table)
            if len(given) < n:
                self.token_in.copy_(self.token_out)  # the sequences fed their last token, on the device
            if given:
                self.token_in[list(given)] = torch.tensor(list(given.values()), dtype=torch.int32).to(self.device)
            kind = 0
        p.token_in = self.token_in.data_ptr()
        p.seen = self.seen.data_ptr()
        bias = self.slot_bias if self.slot_bias is not None else self.logit_bias
        p.logit_bias = 0 if bias is None else bias.data_ptr()
        full = [b for b in range(n) if self.lengths[b] >= self.kv.layout.full_rows]  # the spare row takes one left out
        if full:
            raise MkportError(f"sequence {full[0]} is full ({self.max_seq} positions): reset it before it runs again")
        # each field written once for the whole batch (a ctypes field is a new object each time it is read)
        lengths = self.lengths[:n]  # a sharing decoder's lists are longer
        pos = [_sequence_position(at, length) for at, length in zip(positions, lengths)]
        self._check_rope_positions([at[0] for at in pos])
        sps = [sp if on else GREEDY for sp, on in zip(sampling, active)]  # left out: greedy, history untouched
        p.input_kind[:], p.table[:], p.head[:] = [kind] * n, [table] * n, [head] * n
        p.cache_pos[:] = lengths
        p.pos_t[:], p.pos_h[:], p.pos_w[:] = ([at[i] for at in pos] for i in range(3))
        p.attn_splits[:] = [self.plan.attention_splits(length + 1) for length in lengths]
        p.top_k[:] = [min(sp.top_k, s.vocab_size) for sp in sps]
        p.seed[:], p.rng_step[:] = [sp.seed for sp in sps], self.slot_steps[:n]
        p.temperature[:], p.top_p[:] = [sp.temperature for sp in sps], [sp.top_p for sp in sps]
        p.rep_penalty[:] = [sp.repetition_penalty for sp in sps]
        self.kernel.launch(p, torch.cuda.current_stream().cuda_stream)
        for b in range(n):
            if active[b]:
                self.lengths[b] += 1
                self.slot_steps[b] += 1
        return self.token_out

    def phase_cycles(self) -> dict[str, int]:
        """SM clock cycles of each phase of the last step (barrier to barrier, block 0's clock)."""
        if not self.profile_enabled:
            raise MkportError("this decoder was built without profiling; create it with profile=True")
        marks = self.profile_marks.cpu().tolist()
        return {name: marks[i + 1] - marks[i] for i, name in enumerate(self.phase_names)}

    def timeline(self) -> torch.Tensor:
        """The last step's timeline: [layer, block, TIMELINE_EVENTS] SM cycles since each block left the step's first
        grid barrier (an event a design does not pass through is negative)."""
        if not self.profile_enabled:
            raise MkportError("this decoder was built without profiling; create it with profile=True")
        L, grid, events = self.spec.num_layers, self.plan.grid, len(TIMELINE_EVENTS)
        marks = self.timeline_marks.cpu()
        origin = marks[L * grid * events:]
        return marks[: L * grid * events].view(L, grid, events) - origin.view(1, grid, 1)

    def trace_taps(self, slot: int = 0) -> dict[str, torch.Tensor]:
        """The states the last step traced for one sequence, by tap name (the names torch_model and the
        reference use)."""
        if not self.trace_enabled:
            raise MkportError("this decoder was built without trace; create it with trace=True")
        check_slot(slot, self.batch)
        layout = self.trace_layout
        t = self.trace[slot * layout.total : (slot + 1) * layout.total]
        taps = {Tap.EMBED: t[: layout.hidden].clone()}
        widths = trace_layer_fields(self.spec)
        for i in range(self.spec.num_layers):
            base = layout.layer0 + i * layout.layer_stride
            for name, off in layout.layer_offsets.items():
                if not layer_writes(self.spec, i, name):
                    continue  # a dense layer of a mixture of experts, or one kind of a hybrid's layers, leaves it unwritten
                taps[Tap.layer(i, name)] = t[base + off : base + off + widths[name]].clone()
        taps[Tap.FINAL_NORM] = t[layout.final : layout.final + layout.hidden].clone()
        return taps
