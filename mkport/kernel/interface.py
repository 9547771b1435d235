"""The host/device interface of the decode-step library, defined once: both the rendered CUDA sources (through
render.py) and the ctypes side (runtime/decoder.py, runtime/prefill.py) are made from these lists.

- PARAM_FIELDS: the kernel's Params struct; SEQUENCE_FIELDS: its per-sequence arrays (params_type, kernel_params);
- LAYER_FIELDS: the per-layer weight pointer table (LayerWeights);
- ring_chunk_rows, ring_rows: the rows a sliding layer's KV cache ring holds (runtime/kv_cache.py lays the cache out);
- Tap, TraceLayout: the names of the traced states and where each sits in the trace buffer;
- LAYER_PHASES, layer_phases, profile_phases: the phases a profile build times, between the grid barriers of decode_step.cu;
- PREFILL_FUNCTIONS: the prefill's fused kernels (prefill.cuh, gated_delta_net_prefill.cuh, delta_rule_prefill.cuh)
  and their argument types.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from ..errors import MkportError
from .spec import ModelSpec

# Per-layer weight pointers, in the order of the kernel's LayerWeights struct.
LAYER_FIELDS = (
    "attn_norm",
    "wqkv",
    "bqkv",
    "q_norm",
    "k_norm",
    "wo",
    "mlp_norm",
    "w_gate",
    "w_up",
    "w_down",
    "post_attn_norm",  # post-norm layers (gemma2/3's sandwich norms, olmo2/3): the attention output's norm
    "post_mlp_norm",  # and the MLP output's; null elsewhere
)
# A mixture-of-experts spec's table has these after LAYER_FIELDS (null in its dense layers): the router, each projection
# of every expert stacked by expert index (weights.DecoderWeights), qwen2_moe's shared expert gate (its shared expert
# sits in w_gate, w_up and w_down).
MOE_LAYER_FIELDS = ("router", "expert_gate", "expert_up", "expert_down", "shared_gate")
# A hybrid spec's (qwen3_5) table has these after LAYER_FIELDS: a full-attention layer's output gate rows (null in a
# linear-attention layer), a Gated DeltaNet layer's weights (weights.LayerWeights; null in a full-attention layer), then
# LINEAR_STATE_FIELDS.
HYBRID_LAYER_FIELDS = ("q_gate", "lin_in", "lin_conv", "lin_a_log", "lin_dt_bias", "lin_norm", "lin_out")
# A Gated DeltaNet layer's fp32 state, owned by the decoder (torch_model.LinearState, one slot a linear layer): the
# conv's last inputs [conv_kernel - 1][conv_dim], oldest first, and the delta-rule state [value_heads][dk][dv].
LINEAR_STATE_FIELDS = ("conv_state", "delta_state")


def layer_fields(spec: ModelSpec) -> tuple[str, ...]:
    """The spec's per-layer weight table (LayerWeights), in order."""
    hybrid = HYBRID_LAYER_FIELDS + LINEAR_STATE_FIELDS if spec.linear_layers or spec.attn_output_gate else ()
    return LAYER_FIELDS + (MOE_LAYER_FIELDS if spec.moe is not None else ()) + hybrid


def layer_field_types(spec: ModelSpec) -> list[tuple[str, str]]:
    """layer_fields with their C types: weights are bf16, a linear layer's state fp32 (read and written)."""
    return [("float*" if name in LINEAR_STATE_FIELDS else "const bf16*", name) for name in layer_fields(spec)]


# A sliding layer's KV cache is a ring of rows (a position's row: position % rows). A decode step at p writes p, then
# reads p-W+1..p; a prefill pass of C rows (its graph's padding included) at start s writes s..s+C-1, then its first
# row reads s-W+1..s: W - 1 + C rows keep every row a pass reads. So a prompt is prefilled C rows a pass on a spec with
# rings: the window rounded up to a power of two (a graph's bucket is one, torch_model.prefill_bucket), at least 16
# (a pass has a fixed cost) and at most 256 (the ring's rows past the window). Every sliding layer of a spec has the
# same ring (its largest window's: configs give one), so that the kernel finds a layer's rows by arithmetic.
RING_CHUNK_MIN, RING_CHUNK_MAX = 16, 256


def ring_chunk_rows(spec: ModelSpec) -> int:
    """The most rows a prefill pass of this sliding spec takes: for its smallest window (0 without sliding layers)."""
    windows = [w for w in spec.attention_windows if w]
    if not windows:
        return 0
    return min(RING_CHUNK_MAX, max(RING_CHUNK_MIN, 1 << (min(windows) - 1).bit_length()))


def ring_rows(spec: ModelSpec) -> int:
    """Rows of a sliding layer's ring (0: no sliding layers). A decoder whose positions fit fewer rows holds those
    (kv_cache.KvLayout, and attention.cuh as constants.cuh's KV_RING_ROWS)."""
    windows = [w for w in spec.attention_windows if w]
    return max(windows) - 1 + ring_chunk_rows(spec) if windows else 0


# Kernel parameters: (name, C type). Every field is 8 bytes: pointers, long long or double.
PARAM_FIELDS = (
    ("layers", "const LayerWeights*"),
    ("embed", "const bf16*"),
    ("heads", "const bf16*"),
    ("final_norm", "const bf16*"),
    ("in_proj_w", "const bf16*"),
    ("in_proj_b", "const bf16*"),
    ("x", "float*"),
    ("qkv", "float*"),
    ("attn_part", "float*"),
    ("attn_ml", "float*"),
    ("attn_counters", "unsigned*"),
    ("attn_out", "float*"),
    ("act", "float*"),
    ("sub", "float*"),  # post-norm layers: a sublayer's output before its norm and residual add (post_norm.cuh)
    ("x_alt", "float*"),  # post-norm layers: the residual stream's second copy, x and x_alt by turns (post_norm.cuh)
    ("router_logits", "float*"),  # mixture of experts: a sparse layer's router logits, [sequence][expert]
    # trace builds of a mixture of experts: the experts each sparse layer applies, [layer][sequence][top_k] int32 in
    # ascending index (the reference's choice, so that every layer is compared on the same experts); null: its own
    ("forced_experts", "const int*"),
    ("logits", "float*"),
    ("best_val", "float*"),
    ("best_id", "int*"),
    ("k_cache", "bf16*"),
    ("v_cache", "bf16*"),
    ("hidden_out", "float*"),
    ("token_in", "const int*"),
    ("token_out", "int*"),
    ("seen", "unsigned char*"),
    ("logit_bias", "const float*"),
    ("input_embed", "const float*"),
    # dynamic NTK RoPE: its frequencies for each sequence length from its original length on, [rows][HD / 2] (row r:
    # length original + r; row 0 also every shorter one), rope.cuh's rope_length; null for every other RoPE
    ("rope_table", "const float*"),
    ("trace", "float*"),
    ("profile", "long long*"),  # clock64 at each grid barrier of block 0, with -DMK_PROFILE=1
    ("timeline", "long long*"),  # clock64 of every block at each TIMELINE_EVENTS of each layer, with -DMK_PROFILE=1
    ("input_kind", "long long"),  # 0: token_in through embedding table `table`; 1: input_embed
    ("table", "long long"),
    ("head", "long long"),
    ("cache_pos", "long long"),
    ("pos_t", "long long"),
    ("pos_h", "long long"),
    ("pos_w", "long long"),
    ("max_seq", "long long"),
    ("attn_splits", "long long"),
    ("top_k", "long long"),
    ("seed", "long long"),
    ("rng_step", "long long"),
    ("temperature", "double"),
    ("top_p", "double"),
    ("rep_penalty", "double"),
    # 1: the sequence advances this step; 0: a batch step leaves it out, and a hybrid's linear-attention state is kept
    # (its KV cache needs no flag: the spare row). Last, so that the other fields keep their offsets.
    ("advances", "long long"),
    # a batch's mixture of experts: the experts each sparse layer read (the union of its sequences'), added up over
    # steps, [layers] int32 (bench's floor of the bytes a step read); null: not counted. After advances, for the same reason
    ("experts_read", "int*"),
)
# Fields with one value per sequence of a batch (arrays of plan.batch in the kernel's Params).
SEQUENCE_FIELDS = ("input_kind", "table", "head", "cache_pos", "pos_t", "pos_h", "pos_w", "attn_splits", "top_k", "seed",
                   "rng_step", "temperature", "top_p", "rep_penalty", "advances")


def _ctype(c_type: str):
    return ctypes.c_double if c_type == "double" else ctypes.c_uint64 if c_type.endswith("*") else ctypes.c_int64


@functools.cache
def params_type(batch: int = 1) -> type[ctypes.Structure]:
    """The kernel's Params on the host for a batch size, field for field from PARAM_FIELDS (the list the
    rendered C struct is made from), 8 bytes a value; a SEQUENCE_FIELDS field is an array of `batch`. A name
    that is not a field cannot be set (no instance dict)."""

    def field(name, c_type):
        ctype = _ctype(c_type)
        return (name, ctype * batch if name in SEQUENCE_FIELDS else ctype)

    return type(f"KernelParams{batch}", (ctypes.Structure,), {"__slots__": (), "_fields_": [field(*f) for f in PARAM_FIELDS]})


KernelParams = params_type(1)


def kernel_params(values: dict, batch: int = 1) -> ctypes.Structure:
    """Params with every field given (a per-sequence field as one value for every sequence, or a list of
    `batch`), or an error naming those missing or unknown (a missing pointer would otherwise reach the kernel
    as null)."""
    names = [name for name, _ in PARAM_FIELDS]
    missing, unknown = [n for n in names if n not in values], sorted(set(values) - set(names))
    if missing or unknown:
        raise MkportError(f"kernel params: missing {missing}, unknown {unknown}")
    params = params_type(batch)()
    for name, value in values.items():
        if name in SEQUENCE_FIELDS:
            getattr(params, name)[:] = value if isinstance(value, (list, tuple)) else [value] * batch
        else:
            setattr(params, name, value)
    return params


class Tap:
    """Names of the traced states of a decode step, the one list that the kernel's trace buffer
    (TraceLayout), torch_model.forward, the transformers reference and `mkport diff` share."""

    EMBED = "embed"  # the step's input, after any input projection
    ATTN_NORM = "attn_norm"
    Q = "q"  # after q norm and rope
    K = "k"
    ATTN = "attn"  # attention output, before o_proj
    ATTN_RESIDUAL = "attn_residual"
    MLP_RESIDUAL = "mlp_residual"
    FINAL_NORM = "final_norm"
    LOGITS = "logits"
    LAYER = (ATTN_NORM, Q, K, ATTN, ATTN_RESIDUAL, MLP_RESIDUAL)  # each layer's, in schedule order
    # A sparse layer's, between ATTN_RESIDUAL and MLP_RESIDUAL
    ROUTER = "router_logits"  # [experts]
    EXPERTS = "experts"  # the top-k experts its own router logits choose, ascending index (as floats)
    EXPERT_WEIGHTS = "expert_weights"  # the weights of the experts applied, in the same order
    MOE = "moe"  # the expert block's output (qwen2_moe: with its gated shared expert), before the residual add
    MOE_LAYER = (ROUTER, EXPERTS, EXPERT_WEIGHTS, MOE)
    # a Gated DeltaNet layer's (qwen3_5), in schedule order
    CONV = "conv"  # the causal conv's output after SiLU: q, k, v channels
    GATES = "gates"  # per value head: the log decay g, then beta
    STATE_OUT = "state_out"  # the delta-rule state's read-out, before the gated norm
    GATED_NORM = "gated_norm"  # the gated RMSNorm's output, before out_proj
    LINEAR_LAYER = (ATTN_NORM, CONV, GATES, STATE_OUT, GATED_NORM, ATTN_RESIDUAL, MLP_RESIDUAL)

    @staticmethod
    def layer(index: int, op: str) -> str:
        return f"layers.{index}.{op}"

    @staticmethod
    def layer_ops(spec: ModelSpec, index: int) -> tuple[str, ...]:
        """The traced ops of layer `index`: a linear-attention layer's or an attention layer's (olmo2/3's without
        attn_norm: it has no input norm)."""
        if spec.is_linear(index):
            return Tap.LINEAR_LAYER
        return Tap.LAYER if spec.pre_norms else tuple(op for op in Tap.LAYER if op != Tap.ATTN_NORM)


def trace_layer_fields(spec: ModelSpec) -> dict[str, int]:
    """Per-layer trace slots (Tap.LAYER, then a mixture of experts' Tap.MOE_LAYER, which its dense layers leave
    unwritten, or a hybrid's linear-attention ops, which its full-attention layers leave unwritten, as its linear layers
    leave q, k and attn) and their widths, in buffer order."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    widths = {Tap.ATTN_NORM: h, Tap.Q: q, Tap.K: kv, Tap.ATTN: q, Tap.ATTN_RESIDUAL: h, Tap.MLP_RESIDUAL: h}
    fields = {op: widths[op] for op in Tap.LAYER}
    if spec.moe is not None:
        k = spec.moe.top_k
        fields.update({Tap.ROUTER: spec.moe.num_experts, Tap.EXPERTS: k, Tap.EXPERT_WEIGHTS: k, Tap.MOE: h})
    la = spec.linear_attention
    if spec.linear_layers:
        fields.update({Tap.CONV: la.conv_dim, Tap.GATES: 2 * la.num_value_heads, Tap.STATE_OUT: la.value_dim,
                       Tap.GATED_NORM: la.value_dim})
    return fields


def layer_writes(spec: ModelSpec, layer: int, op: str) -> bool:
    """Whether the kernel traces `op` in layer `layer` (a slot of trace_layer_fields that this layer's kind has)."""
    if op in Tap.MOE_LAYER:
        return spec.sparse(layer)
    if spec.linear_layers:
        return op in Tap.layer_ops(spec, layer)
    return True


@dataclass(frozen=True)
class TraceLayout:
    """Where each traced state sits in the trace buffer (float offsets)."""

    hidden: int
    layer0: int
    layer_stride: int
    layer_offsets: dict
    final: int
    total: int

    @classmethod
    def of(cls, spec: ModelSpec) -> "TraceLayout":
        offsets, at = {}, 0
        for name, width in trace_layer_fields(spec).items():
            offsets[name] = at
            at += width
        h = spec.hidden_size
        layer0 = h  # the step's input (after any projection) comes first
        final = layer0 + spec.num_layers * at
        return cls(h, layer0, at, offsets, final, final + h)


# What a profile build times (decode_step.cu reads the clock at each grid barrier, in this order): the input,
# each layer's phases, then the head's. A post-norm layer's norms (gemma2/3, olmo2/3) are made at the start of the phase
# after each sublayer (post_norm.cuh), in no phase of their own; a sparse layer (mixture of experts) a router phase before gate_up (layer_phases).
LAYER_PHASES = ("qkv", "attention", "o_proj", "gate_up", "down")
SPARSE_PHASES = ("qkv", "attention", "o_proj", "router", "gate_up", "down")
# a Gated DeltaNet layer (linear_attention.cuh): input projections and conv, the delta rule, gated norm and out_proj
LINEAR_PHASES = ("linear_in", "delta_rule", "linear_out", "gate_up", "down")


def layer_phases(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    if spec.is_linear(layer):
        return LINEAR_PHASES
    if spec.sparse(layer):
        return SPARSE_PHASES
    return LAYER_PHASES


# What a profile build's timeline records of each layer in every block (thread 0's SM clock, cycles since the block
# left the step's first grid barrier): a phase's start after its barrier, its input ready (the norm made, or the
# vector copied into shared memory), its end before the next barrier; the MLP's gate/up and down as one. Attention's
# chain in the blocks that own a split: the first K/V tile and the query heads in shared memory, the split's partial
# result made, and the split counted (after its publishing fence and atomic; the last split then combines).
TIMELINE_EVENTS = ("qkv_start", "qkv_input", "qkv_end", "attention_start", "attn_tile_ready", "attn_computed",
                   "attn_counted", "attention_end", "o_proj_start", "o_proj_input", "o_proj_end", "mlp_start",
                   "mlp_input", "gate_up_end", "down_input", "down_end")


def profile_phases(spec: ModelSpec) -> list[str]:
    """The phase names of a profile build's marks, in order (one mark more than phases: the kernel's start)."""
    layers = [f"layers.{i}.{phase}" for i in range(spec.num_layers) for phase in layer_phases(spec, i)]
    return ["input", *layers, *(("lm_head", "sample") if spec.output_mode == "logits" else ("final_norm",))]


# The prefill's fused kernels (cuda/prefill.cuh, gated_delta_net_prefill.cuh, delta_rule_prefill.cuh): name -> argument
# types, each followed by the stream.
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
PREFILL_FUNCTIONS = {
    "mk_prefill_norm": [_P, _P, _P, _P, _P, _P, _I],
    "mk_prefill_qkv": [_P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _L],
    "mk_prefill_attn": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P],
    "mk_prefill_attn_split": [_P, _P, _I],
    "mk_prefill_act": [_P, _P, _P, _I],
    "mk_prefill_linear_inputs": [_P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P],
    "mk_prefill_delta_rule": [_P, _P, _P, _P, _P, _I, _P, _P, _P],
    "mk_prefill_gated_norm": [_P, _P, _P, _P, _I],
}
