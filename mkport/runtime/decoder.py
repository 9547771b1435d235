"""Decoder: the megakernel's batch engine, the one object callers use to run a megakernel. It owns the weights on
the GPU, the KV caches, every scratch buffer and the attention counters, so two decoders in one process never share
state (unless one is made to step another's sequences: share)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from . import prefill, rope_switch, torch_model
from ..kernel.build import build_library, device_ptr
from ..kernel.cache import BUILDS, cache_root
from ..errors import MkportError
from .decoder_api import (
    DEFAULT_MAX_SEQ, CachedRows, batch_arguments, check_head, check_slot, check_table, check_tokens, prefill_inputs,
    prompt_positions, step_position,
)
from .graphs import capture, pad_rows
from ..kernel.gpu import KNOWN_TARGETS, GpuTarget
from ..kernel.interface import (
    LINEAR_STATE_FIELDS, PARAM_FIELDS, TIMELINE_EVENTS, KernelParams, Tap, TraceLayout, kernel_params, layer_fields,
    layer_writes, profile_phases, trace_layer_fields,
)
from ..kernel.render import dynamic_rope_table, render
from ..kernel.spec import GPU_UNVALIDATED_FAMILIES, LENGTH_DEPENDENT_ROPE, ModelSpec
from ..kernel.launch_plan import DEFAULT_KERNEL, LaunchPlan, moe_act_floats, plan_launch
from .kv_cache import KvCache, KvLayout
from .sampling import GREEDY, SamplingParams, SuppressionBiases, validated
from .weights import DecoderWeights, checkpoint_bytes

# prefill starts other than 0 that get CUDA graphs in a decoder (the prompt prefix lengths a prefix cache
# loads: a few per model; an instruction's length makes one more); later starts run eagerly
PREFILL_GRAPH_STARTS = 8
# prompt rows whose exact (fp32) K/V a decoder keeps beside its bf16 cache: a prompt prefix of up to this many
# rows, prefilled apart and continued later (mkport.tts.prefix_cache), then gives what one pass gives
PROMPT_KV_ROWS = 64


def require_gpu(spec: ModelSpec | None = None) -> None:
    """A CUDA GPU, and with `spec` one whose free memory holds the model's bf16 weights (every expert: the megakernel
    keeps them all on the GPU), checked before weights are read, made or written: a model too large for the GPU is
    refused in one line, not an out-of-memory error minutes into loading it. A family whose megakernel has not passed
    `mkport diff` on a GPU yet gets a note saying so."""
    if not torch.cuda.is_available():
        raise MkportError("no CUDA GPU is visible: this command runs the megakernel (generate --check needs none)")
    if spec is None:
        return
    need, (free, total) = checkpoint_bytes(spec), torch.cuda.mem_get_info()
    if need > free:
        experts = f" with all {spec.moe.num_experts} experts of a layer" if spec.moe else ""
        raise MkportError(f"{spec.name}: its weights take {need / 1e9:.1f} GB in bf16{experts}, more than the "
                          f"{free / 1e9:.1f} GB free of {total / 1e9:.1f} GB on {torch.cuda.get_device_name()}; "
                          "mkport runs a model on one GPU")
    if spec.family in GPU_UNVALIDATED_FAMILIES:
        print(f"note: {spec.family}'s megakernel has not passed mkport diff on a GPU yet (it is validated on the CPU "
              "only): run mkport diff on this model before trusting its output", file=sys.stderr)


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


@dataclass
class SequenceState:
    """One sequence of a decoder: where its next step writes and what its sampler counts."""

    length: int = 0  # tokens in its KV cache
    steps: int = 0  # decode steps since its reset: its sampler's counter

    def reset(self) -> None:
        self.length = self.steps = 0


class Decoder(CachedRows):
    """`batch` sequences on the megakernel, each with its own KV cache, state (SequenceState), repetition history and
    suppression bias: each prefilled alone (prefill_slot) and all advanced by one launch (step_batch).

    One sequence is a thin front on the same engine: a decoder of batch 1 runs the batch-1 kernel (a plan of one
    sequence, caches without the spare row: faster than a batch's), and prefill, step, length, steps, cached_rows
    and load_rows are its sequence 0's. The front's step skips what the batch step pays for (the copy of the last
    token, the repetition history without a penalty), and its prefill keeps a prompt's first rows exact
    (prompt_kv) and replays graphs at continuing starts."""

    # where the prefill graphs are captured (graphs.capture; None: torch's one capture stream): prefills replayed
    # beside other decoders' (the server's frame lanes) need a capture stream of their own, their matmuls' cuBLAS
    # workspace being that stream's
    capture_stream: torch.cuda.Stream | None = None

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
        invariant_to: int = 0,
    ):
        """`plan` replaces the launch-plan rule's plan for this GPU (to compare plan variants in one process);
        `kernel` picks the kernel design (launch_plan.KERNELS) when no plan is given. `batch` > 1 makes a batch decoder: `batch` sequences, each
        with its own KV cache, prefilled one at a time (prefill_slot) and advanced together (step_batch). `share`: a batch
        decoder of as many sequences or more, whose first `batch` sequences this one steps (step_batch only): their KV
        caches, repetition histories, logit biases and sequence states are that decoder's (views), so a sequence
        prefilled there steps here, at the cost of a `batch`-sequence step (a batch sized to the live sequences).
        `invariant_to` N: the plan for `batch` that sums each sequence's rows as batch N's does (launch_plan's
        batch-invariant plans), so a sequence's bits are the same stepped here or by a decoder of N."""
        target = current_device_target()
        self.spec, self.trace_enabled = spec, trace
        self.plan: LaunchPlan = plan or plan_launch(spec, target, kernel, batch=batch, invariant_to=invariant_to)
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
        if self.max_seq > spec.max_context:
            raise MkportError(f"max_seq={self.max_seq} is past {spec.max_context_text}")
        dev = torch.device("cuda")
        self.device = dev
        # dynamic NTK's frequencies for every length a step can have, made once on the host exactly as the prefill's
        # (render.rope_tables): a step only indexes it by its position, so nothing is copied between steps
        self.rope_table = (torch.from_numpy(dynamic_rope_table(spec, self.max_seq)).to(dev)
                           if spec.rope.variant == "dynamic" else None)
        self.weights = weights.to(dev)
        # a hybrid's Gated DeltaNet state (fp32, a sequence's like its KV cache): the kernel's decode steps and the
        # prefill's chunked scan advance the same tensors; a slot's is zeroed by reset, reset_slot and a prefill from
        # position 0. [linear layer, sequence, ...]: a layer's pointer in the table is sequence 0's state and sequence
        # b's is b states after it, an offset the kernel knows at any batch (linear_attention.cuh); a sharing decoder
        # steps its owner's first sequences' states through the same pointers
        self.linear_state = None
        if spec.linear_layers:
            self.linear_state = (share.linear_state if share is not None
                                 else torch_model.LinearState.zeros(spec, dev, batch=b))

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
            return (self.linear_state.conv if field == "conv_state" else self.linear_state.recurrent)[slot, 0]

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
        self.act = torch.zeros(b * max(2 * s.intermediate_size, moe_act_floats(s, b)), **f32)  # gate rows, then up rows
        self.router_logits = torch.zeros(b * (s.moe.num_experts if s.moe else 1), **f32)
        # a batch's mixture of experts: the experts each sparse layer read (its union), added up over steps; zero it
        # to count from there (bench's floor of the bytes a batch step read)
        self.experts_read = torch.zeros(s.num_layers, device=dev, dtype=torch.int32) if s.moe and b > 1 else None
        self.forced_experts: torch.Tensor | None = None  # force_experts
        self.sub = torch.zeros(b * s.hidden_size, **f32)  # post-norm layers: a sublayer's output before its norm
        self.x_alt = torch.zeros(b * s.hidden_size if s.post_norms else 1, **f32)  # and the residual's second copy
        self.logits = torch.zeros(b * s.vocab_size, **f32)
        self.best_val = torch.zeros(b * self.plan.grid, **f32)
        self.best_id = torch.zeros(b * self.plan.grid, device=dev, dtype=torch.int32)
        self.hidden = torch.zeros(b * s.hidden_size, **f32)
        self.token_in = torch.zeros(b, device=dev, dtype=torch.int32)
        self.token_out = torch.zeros(b, device=dev, dtype=torch.int32)
        self.seen = share.seen[: b * s.vocab_size] if share else torch.zeros(b * s.vocab_size, device=dev, dtype=torch.uint8)
        self.input_embed = torch.zeros(b * s.input_dim, **f32)
        self._biases = SuppressionBiases(s.vocab_size, dev)
        # the kernel's logit bias: a batch's holds a row a sequence; a decoder of one sequence points the kernel at
        # the kept bias of its set (or at none), so that a set costs no copy
        self.logit_bias = torch.zeros(b, s.vocab_size, **f32) if b > 1 else None
        if share is not None:
            self.logit_bias = share.logit_bias[:b]
        self.trace_layout = TraceLayout.of(spec)
        self.trace = torch.zeros(b * self.trace_layout.total if trace else 1, **f32)
        self.profile_enabled = profile
        self.phase_names = profile_phases(spec)
        self.profile_marks = torch.zeros(len(self.phase_names) + 1, device=dev, dtype=torch.int64)
        # every block's clock at each timeline event of each layer, then each block's origin (profile builds only)
        timeline_slots = (s.num_layers * len(TIMELINE_EVENTS) + 1) * self.plan.grid if profile else 1
        self.timeline_marks = torch.zeros(timeline_slots, device=dev, dtype=torch.int64)
        # a sharing decoder's are its owner's first b (the same objects): its steps advance them there
        self.sequences = share.sequences[:b] if share else [SequenceState() for _ in range(b)]
        # Phi-3's recompute at its longrope switch (rope_switch): each sequence's inputs until then; None for others
        self.early_inputs = None
        if rope_switch.switches(spec):
            self.early_inputs = share.early_inputs[:b] if share else [rope_switch.EarlyInputs(spec) for _ in range(b)]
        self.shared = share is not None
        # longrope's and dynamic's prefill picks its frequencies by its largest position, read back on the host
        # (torch_model.rope_cos_sin), which a CUDA graph cannot capture
        self.prefill_graphs = prefill_graphs and spec.rope.variant not in LENGTH_DEPENDENT_ROPE
        self.prompt_kv = torch.zeros(2, s.num_layers, s.num_kv_heads, PROMPT_KV_ROWS, s.head_dim, **f32)
        self.exact_rows = 0  # the first rows of the cache whose exact K/V prompt_kv holds
        self.exact_prefix_rows = PROMPT_KV_ROWS
        self.fused_prefill = fused_prefill and prefill.supported(spec, self.weights)
        # a hybrid's prefill is torch_model's but for its Gated DeltaNet layers, in mkport's kernels where they run
        runs_linear = prefill.linear_layers_run(spec, self.weights, self.kernel.prefill_delta_smem(),
                                                target.smem_per_block)
        self._linear_attention = prefill.gated_delta_net(self.kernel) if fused_prefill and runs_linear else None
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
            "attn_out": self.attn_out, "act": self.act, "sub": self.sub, "x_alt": self.x_alt, "router_logits": self.router_logits,
            "forced_experts": None,
            "logits": self.logits, "best_val": self.best_val, "best_id": self.best_id, "k_cache": self.kv.k,
            "v_cache": self.kv.v, "hidden_out": self.hidden, "token_in": self.token_in,
            "token_out": self.token_out, "seen": self.seen, "logit_bias": None, "input_embed": self.input_embed,
            "rope_table": self.rope_table,
            "trace": self.trace if self.trace_enabled else None, "profile": self.profile_marks,
            "timeline": self.timeline_marks, "experts_read": self.experts_read,
        }
        scalars = {name: 0 for name, c_type in PARAM_FIELDS if not c_type.endswith("*")}
        pointers = {k: device_ptr(t) for k, t in buffers.items()}
        return kernel_params({**pointers, **scalars, "max_seq": self.kv.layout.full_rows}, self.batch)

    # -- state --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empties the KV cache (every sequence's) and the repetition history; re-arms the attention counters."""
        if self.shared:
            raise MkportError("a decoder that shares another's sequences steps them only; reset that one")
        for sequence in self.sequences:
            sequence.reset()
        for kept in self.early_inputs or ():
            kept.reset()
        self.exact_rows = 0
        self.attn_counters.zero_()
        self.seen.zero_()
        if self.linear_state is not None:
            self.linear_state.reset()

    def reset_slot(self, slot: int) -> None:
        """Empties one sequence of a batch (its cache and repetition history): a new request can take it."""
        check_slot(slot, self.batch)
        self.sequences[slot].reset()
        if self.early_inputs is not None:
            self.early_inputs[slot].reset()
        self.seen[slot * self.spec.vocab_size : (slot + 1) * self.spec.vocab_size].zero_()
        if self.linear_state is not None:
            self.linear_state.sequence(slot).reset()

    def set_suppressed(self, token_ids) -> None:
        """Token ids the sampler never picks (an additive -inf bias on their logits), for every sequence; empty
        clears it."""
        for slot in range(self.batch):
            self.set_suppressed_slot(slot, token_ids)

    def set_suppressed_slot(self, slot: int, token_ids) -> None:
        """set_suppressed for one sequence (a batch's: a copy into its row of the bias, on the device)."""
        check_slot(slot, self.batch)
        bias = self._biases.of(token_ids)
        if self.batch == 1 and not self.shared:
            self.logit_bias = bias
        elif bias is None:
            self.logit_bias[slot].zero_()
        else:
            self.logit_bias[slot].copy_(bias)

    def _check_room(self, n: int, length: int | None = None) -> None:
        """n more rows fit after `length` (default: the one sequence's)."""
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

    def _check_rope_positions(self, positions) -> None:
        """Dynamic NTK: a step's position has a row in rope_table (positions below max_seq, or the original length)."""
        if self.rope_table is None:
            return
        end = self.spec.rope.original_max_position + self.rope_table.shape[0] - 1
        if max(positions) >= end:
            raise MkportError(f"position {max(positions)}: dynamic RoPE's frequencies are made for positions below "
                              f"{end} (raise max_seq)")

    # -- one sequence: the front of a decoder of batch 1 -------------------------------------------
    @property
    def length(self) -> int:
        """Tokens in the one sequence's KV cache (load_rows sets it)."""
        return self.sequences[0].length

    @length.setter
    def length(self, n: int) -> None:
        self.sequences[0].length = n

    @property
    def steps(self) -> int:
        """Decode steps the one sequence ran since its reset (its sampler's counter)."""
        return self.sequences[0].steps

    def _one_sequence(self, what: str) -> None:
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
        self._one_sequence("cached_rows")
        self._no_linear_state("cached_rows")
        rows = super().cached_rows(n)
        return (*rows, self.prompt_kv[:, :, :, :n].clone()) if n <= self.exact_rows else rows

    def load_rows(self, rows: tuple[torch.Tensor, ...]) -> None:
        self._one_sequence("load_rows")
        self._no_linear_state("load_rows")
        super().load_rows(rows[:2])
        self.exact_rows = 0
        if len(rows) == 3:
            self.prompt_kv[:, :, :, : self.length].copy_(rows[2])
            self.exact_rows = self.length

    def prefill(self, tokens=None, embeds=None, positions=None, table: int = 0, routing: dict | None = None) -> torch.Tensor:
        """Runs a prompt of N tokens (or N input embeddings) in one pass (on a spec with sliding layers' rings, a
        bounded pass at a time: kv_cache.KvLayout.passes), writing the KV cache. Returns the final-normed hidden
        states [N, hidden].

        The prompt replays a CUDA graph of the forward captured for its start and padded length (see
        _prefill_replay) when it starts at 0 (after reset) or at one of the first PREFILL_GRAPH_STARTS
        other starts seen (a hybrid's only at 0: _replays_at), unless the decoder was made with prefill_graphs=False;
        else it runs eagerly. `routing` ({layer: expert ids [N, top_k]}, a mixture of experts) forces each sparse
        layer's experts, row by row, as force_experts does for the steps; such a prompt runs eagerly."""
        self._one_sequence("prefill")
        return self._prefill(0, tokens, embeds, positions, table, routing, one_sequence=True)

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
        self._one_sequence("step")
        s = self.spec
        validated(sampling, s.vocab_size)
        check_head(s, head)
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
        pos = step_position(position, self.length)
        if self.early_inputs is not None:
            token_ids = None if embed is not None else (self.token_in if token is not None else self.token_out)
            self._switch(0, token_ids, self.input_embed, table, pos, one_sequence=True)
        p = self._params  # pointers set once (_kernel_params); what changes from step to step:
        p.token_in = token_ptr
        p.seen = self.seen.data_ptr() if sampling.repetition_penalty != 1.0 else 0
        p.logit_bias = 0 if self.logit_bias is None else self.logit_bias.data_ptr()
        self._launch(input_kind, table, head, [pos], [sampling], [True])
        return self.token_out

    # -- batch --------------------------------------------------------------------------------------
    def prefill_slot(self, slot: int, tokens=None, embeds=None, positions=None, table: int = 0) -> torch.Tensor:
        """A batch decoder's prefill of one sequence's prompt (tokens or input embeddings) after its current
        length, into its own cache. Returns the final-normed hidden states [N, hidden]. A prompt from position 0
        replays a CUDA graph of the sequence's slot and padded length (captured on first use, as prefill's);
        one that continues a sequence runs eagerly."""
        check_slot(slot, self.batch)
        return self._prefill(slot, tokens, embeds, positions, table)

    @staticmethod
    def prompts_together(decoders: list) -> bool:
        """Whether prompts into slots of these decoders can be prefilled together (prefill_prompts): batch decoders
        of their own sequences, of one spec, KV layout and weights (the same tensors), on the fused prefill with
        graphs, whose caches hold a whole prompt in one pass (no sliding layer's ring) and that keep no state beside
        them (a hybrid's linear attention, a longrope switch's inputs)."""
        first = decoders[0]
        return all(isinstance(d, Decoder) and d.batch > 1 and not d.shared and d.fused_prefill and d.prefill_graphs
                   and d.linear_state is None and d.early_inputs is None and not d.kv.layout.chunk_rows
                   and d.spec == first.spec and d.kv.layout == first.kv.layout and d.max_seq == first.max_seq
                   and d.weight_addresses == first.weight_addresses for d in decoders)

    @functools.cached_property
    def weight_addresses(self) -> DecoderWeights:
        """Where each of the weights is on the device (a decoder's weights do not move): the same for decoders that
        read the same tensors."""
        return self.weights.map(torch.Tensor.data_ptr)

    @torch.no_grad()
    def prefill_prompts(self, prompts: list[tuple[Decoder, int, torch.Tensor]]) -> torch.Tensor:
        """Prompts (decoder, slot, input embeddings [n, input_dim] on the device) into empty slots of this decoder
        and others it can take them for (prompts_together), in one prefill: the weights read once for them all, each
        row attending to its own prompt's rows and writing its own slot's cache (prefill.PromptRows), as each prompt
        prefilled alone into its slot from position 0 (prefill_slot). Replays a CUDA graph of this decoder's for the
        rows' padded count, captured on first use (on capture_stream). Returns the final-normed hidden states of the
        rows, one prompt after another [rows, hidden]."""
        decoders = [self, *(d for d, _, _ in prompts)]
        if not prompts or not Decoder.prompts_together(decoders):
            raise MkportError("prompts are prefilled together into batch decoders of one spec, cache layout and "
                              "weights, on the fused prefill with graphs")
        inputs = []  # each prompt's rows, checked as a lone prompt's (prefill_inputs)
        for d, slot, embeds in prompts:
            check_slot(slot, d.batch)
            if d.sequences[slot].length:
                raise MkportError(f"slot {slot} is not empty: prompts prefilled together start at position 0")
            inputs.append(prefill_inputs(self.spec, None, embeds, 0, self.device)[0])
            d._check_room(inputs[-1].shape[0], 0)
        sizes = [rows.shape[0] for rows in inputs]
        total, layout = sum(sizes), self.kv.layout
        # padding continues the last prompt (prefill.prompt_rows), whose cache must hold it
        bucket = torch_model.prefill_bucket(total, total - sizes[-1] + self.max_seq)
        caches = [(d.kv.k_layers[0][slot].data_ptr(), d.kv.v_layers[0][slot].data_ptr()) for d, slot, _ in prompts]
        table = prefill.prompt_rows(sizes, caches, bucket).pin_memory()
        key = ("prompts", bucket)
        if key not in self._prefill_graphs:
            static_inputs = torch.zeros(bucket, self.spec.input_dim, device=self.device)
            static_table = table.to(self.device)
            rows = prefill.PromptRows(static_table, layout.offsets, layout.rows)
            row_index = torch.arange(bucket, device=self.device)

            def forward() -> torch.Tensor:
                positions = (row_index - static_table[0]).expand(3, bucket).contiguous()  # each row's in its prompt
                return prefill.prefill_forward(self.kernel, self.spec, self.weights, static_inputs, positions, None,
                                               None, 0, prompts=rows)

            graph, hidden = capture(forward, self._graph_pool, self.capture_stream)
            self._prefill_graphs[key] = (graph, static_inputs, static_table, hidden)
        graph, static_inputs, static_table, hidden = self._prefill_graphs[key]
        static_inputs[:total].copy_(torch.cat(inputs))
        static_inputs[total:].zero_()
        static_table.copy_(table, non_blocking=True)
        graph.replay()
        for (d, slot, _), n in zip(prompts, sizes):
            d.sequences[slot].length = n
        return hidden[:total].clone()

    @torch.no_grad()
    def step_batch(self, tokens=None, embeds: torch.Tensor | None = None, positions=None, table: int = 0,
                   head: int = 0, sampling=SamplingParams(), active=None) -> torch.Tensor:
        """One decode step of every sequence of the batch. Inputs: `tokens`, one entry a sequence (a token id,
        or None for the token that sequence sampled last, kept on the device), or `embeds` [batch, input_dim]
        on the device. `positions`: None (each sequence's length), or one entry a sequence (None, an int or a
        (t, h, w) triplet). `sampling`: one SamplingParams for all or one a sequence. `active`: which sequences
        advance (default all); one left out still runs, at a spare cache row, and keeps its state. Returns the
        sampled tokens (device int32 [batch]); `hidden` holds the final-normed states [batch * hidden]."""
        s, n = self.spec, self.batch
        given_tokens = None if embeds is not None or tokens is None else tokens
        active, sampling, positions = batch_arguments(s, n, active, sampling, positions, head, given_tokens)
        if n == 1 and self.linear_state is not None and not active[0]:  # the batch-1 kernel reads no `advances`
            raise MkportError("a hybrid's decoder of one sequence advances its linear-attention state at every step: "
                              "leave the sequence out by not stepping")
        lengths = [sequence.length for sequence in self.sequences]
        for b in range(n):
            if active[b] and lengths[b] >= self.max_seq:
                raise MkportError(f"sequence {b}: position {lengths[b]} is past the KV cache length {self.max_seq}")
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
        p.logit_bias = 0 if self.logit_bias is None else self.logit_bias.data_ptr()
        full = [b for b in range(n) if lengths[b] >= self.kv.layout.full_rows]  # the spare row takes one left out
        if full:
            raise MkportError(f"sequence {full[0]} is full ({self.max_seq} positions): reset it before it runs again")
        pos = [step_position(at, length) for at, length in zip(positions, lengths)]
        if self.early_inputs is not None:
            for b in (b for b in range(n) if active[b]):
                token_ids = None if embeds is not None else self.token_in[b : b + 1]
                self._switch(b, token_ids, self.input_embed[b * s.input_dim : (b + 1) * s.input_dim], table, pos[b])
        sps = [sp if on else GREEDY for sp, on in zip(sampling, active)]  # left out: greedy, history untouched
        self._launch(kind, table, head, pos, sps, active)
        return self.token_out

    # -- what step and step_batch, prefill and prefill_slot share ---------------------------------
    def _launch(self, input_kind: int, table: int, head: int, positions: list[list[int]], sampling: list,
                advancing: list[bool]) -> None:
        """Writes each sequence's fields of the Params (its input kind, cache row, position, attention splits,
        sampler and counter; the pointers are the caller's) and launches the step, then advances the sequences
        that do. Each field is written once for the whole batch (a ctypes field is a new object each time it is
        read)."""
        p, n, vocab = self._params, self.batch, self.spec.vocab_size
        pos_t, pos_h, pos_w = zip(*positions)
        self._check_rope_positions(pos_t)
        lengths = [sequence.length for sequence in self.sequences]
        p.input_kind[:], p.table[:], p.head[:] = [input_kind] * n, [table] * n, [head] * n
        p.cache_pos[:], p.pos_t[:], p.pos_h[:], p.pos_w[:] = lengths, pos_t, pos_h, pos_w
        p.attn_splits[:] = [self.plan.attention_splits(length + 1) for length in lengths]
        p.rng_step[:] = [sequence.steps for sequence in self.sequences]
        p.advances[:] = [int(a) for a in advancing]
        p.top_k[:], p.seed[:], p.temperature[:], p.top_p[:], p.rep_penalty[:] = zip(
            *[(min(sp.top_k, vocab), sp.seed, sp.temperature, sp.top_p, sp.repetition_penalty) for sp in sampling])
        self.kernel.launch(p, torch.cuda.current_stream().cuda_stream)
        for sequence, advances in zip(self.sequences, advancing):
            if advances:
                sequence.length += 1
                sequence.steps += 1

    @torch.no_grad()
    def _prefill(self, slot: int, tokens, embeds, positions, table: int, routing: dict | None = None,
                 one_sequence: bool = False) -> torch.Tensor:
        """A prompt into sequence `slot` after its length. `one_sequence`: the front's prefill, which keeps the
        first rows' exact K/V (prompt_kv, one sequence's) and replays graphs at continuing starts too; a batch's
        sequences keep no exact rows, and continue eagerly (a graph a slot and start would be too many)."""
        inputs, tokens = prefill_inputs(self.spec, tokens, embeds, table, self.device)
        sequence = self.sequences[slot]
        n, start = inputs.shape[0], sequence.length
        self._check_room(n, start)
        pos = prompt_positions(positions, n, start, self.device)
        if self.early_inputs is not None:
            self._switch(slot, tokens, None if tokens is not None else inputs, table, pos, one_sequence)
        hidden = []
        for first, end in self.kv.layout.passes(n):  # a sliding layer's ring takes a prompt a bounded pass at a time
            rows, start = slice(first, end), sequence.length
            exact = min(start, self.exact_rows) if one_sequence else 0
            if self.prefill_graphs and routing is None and self._replays_at(start, one_sequence):
                hidden.append(self._prefill_replay(inputs[rows], pos[:, rows], table, start, slot, exact))
            else:
                forced = None if routing is None else {layer: ids[rows] for layer, ids in routing.items()}
                hidden.append(self._prefill_forward(inputs[rows], pos[:, rows], start, table, slot, exact, forced))
            if one_sequence and start == 0:
                self.exact_rows = min(end, PROMPT_KV_ROWS)
            sequence.length += end - first
        if tokens is not None:  # the real tokens only: padding never enters the repetition history
            self.seen[slot * self.spec.vocab_size + tokens] = 1
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def _switch(self, slot: int, tokens: torch.Tensor | None, embeds: torch.Tensor, table: int, pos,
                one_sequence: bool = False) -> None:
        """Before rows at `pos` ([3, n], or a step's (t, h, w)) are fed to sequence `slot`: Phi-3's recompute at its
        longrope switch (rope_switch), where due; then the rows are kept while a later call may need them. `tokens`:
        the rows' token ids on the device, or None for `embeds` (a step's: its row of input_embed)."""
        kept, start = self.early_inputs[slot], self.sequences[slot].length
        pos = torch.as_tensor(pos).reshape(3, -1)
        n = pos.shape[1]
        if rope_switch.recomputes(self.spec, start, n):
            self._recompute(slot, *kept.again(self._prefill_weights, start, pos), one_sequence)
        if tokens is None:
            kept.keep(start, None, embeds.reshape(n, -1), table, pos)
        else:
            kept.keep(start, tokens.long(), None, table, pos)

    def _recompute(self, slot: int, x: torch.Tensor, pos: torch.Tensor, length: int, one_sequence: bool) -> None:
        """Sequence `slot`'s cache rows 0..len(x)-1 again from its inputs x (embedded) at `pos`, rotated by the
        frequencies of `length`: torch_model's prefill, a pass at a time as _prefill's (the fused prefill rotates by
        the load-time table). The front's exact first rows (prompt_kv) are rewritten with them."""
        k, v = self.kv.sequence(slot)
        for first, end in self.kv.layout.passes(x.shape[0]):
            exact = min(first, self.exact_rows) if one_sequence else 0
            torch_model.forward(self.spec, self._prefill_weights, x[first:end], pos[:, first:end], k, v, start=first,
                                rope_tables=self._rope_tables, prompt_kv=self.prompt_kv, exact=exact,
                                rope_length=length)
            if one_sequence and first == 0:
                self.exact_rows = min(end, PROMPT_KV_ROWS)

    def _replays_at(self, start: int, one_sequence: bool) -> bool:
        """Whether a prefill at `start` replays a graph: 0, and for the one-sequence front the first
        PREFILL_GRAPH_STARTS other starts (a start seen while there is room is taken). A hybrid's only at 0, where the
        graph zeroes its linear-attention state itself: capture's warm-up run and every replay then leave the same
        state, where a graph continuing a state would advance it once more for the warm-up."""
        if start == 0:
            return True
        if self.linear_state is not None or not one_sequence:
            return False
        if start in self._graph_starts:
            return True
        if len(self._graph_starts) < PREFILL_GRAPH_STARTS:
            self._graph_starts.add(start)
            return True
        return False

    def _prefill_replay(self, inputs: torch.Tensor, pos: torch.Tensor, table: int, start: int, slot: int,
                        exact: int) -> torch.Tensor:
        """The prefill at cache position `start` of sequence `slot` (a graph each) as a CUDA graph
        replay: inputs and positions are padded at the end to a power-of-two bucket (torch_model.prefill_bucket
        says why that is exact) and copied into the graph's static buffers; the graph is captured on the first
        use of its (slot, start, bucket).

        The start is part of the key, a Python int fixed at capture: a start given as a device tensor
        would make the attention span the whole cache instead of the start + bucket rows. Starts other
        than 0 come from a prompt prefix loaded from a prefix cache (mkport.tts.prefix_cache), whose
        lengths are few; so that continuation prompts of any length do not capture graphs without end,
        only the first PREFILL_GRAPH_STARTS of them get graphs, and later starts run eagerly (_replays_at).
        The graph reads the cache rows before its start as they are at replay."""
        n = inputs.shape[0]
        bucket = torch_model.prefill_bucket(n, self.max_seq - start)
        inputs, pos = pad_rows(inputs, bucket), pad_rows(pos, bucket, dim=1)
        key = (slot, start, not inputs.is_floating_point(), table, bucket, exact)
        if key not in self._prefill_graphs:
            static_inputs, static_pos = inputs.clone(), pos.clone()
            real_rows = torch.full((), n, device=self.device)  # a hybrid's state advances by these (torch_model)
            graph, hidden = capture(lambda: self._prefill_forward(static_inputs, static_pos, start, table, slot, exact,
                                                                  real_rows=real_rows), self._graph_pool,
                                    self.capture_stream)
            self._prefill_graphs[key] = (graph, static_inputs, static_pos, real_rows, hidden)
        graph, static_inputs, static_pos, real_rows, hidden = self._prefill_graphs[key]
        static_inputs.copy_(inputs)
        static_pos.copy_(pos)
        real_rows.fill_(n)
        graph.replay()
        return hidden[:n].clone()

    def _prefill_forward(self, inputs: torch.Tensor, pos: torch.Tensor, start: int, table: int, slot: int,
                         exact: int, routing: dict | None = None,
                         real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The prefill's forward pass: mkport's fused kernels (mkport.runtime.prefill) where they apply, else torch.
        The first `exact` rows before `start` are attended to as prompt_kv holds them, as they were computed.
        real_rows: a graph's count of real rows, for a hybrid's state (torch_model.forward)."""
        k, v = self.kv.sequence(slot)
        if self.fused_prefill:
            return prefill.prefill_forward(self.kernel, self.spec, self.weights, inputs, pos, k, v, start, table,
                                           self.prompt_kv, exact)
        state = None if self.linear_state is None else self.linear_state.sequence(slot)  # zeroed at start 0
        return torch_model.prefill_forward(self.spec, self._prefill_weights, inputs, pos, k, v, start, table,
                                           self._rope_tables, self.prompt_kv, exact, routing, state, real_rows,
                                           self._linear_attention)

    # -- what the last step left ------------------------------------------------------------------
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
