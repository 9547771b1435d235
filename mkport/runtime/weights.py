"""Weights: Hugging Face safetensors (a local folder, sharded or not) -> the kernel's layout.

Random weights are made in the checkpoint's own naming and written as safetensors, so that tests go
through the same loading code as a real model folder; past COUNTER_WEIGHTS_BYTES they are counter-based
(CounterCheckpoint), computed where they are read, through the same code from Checkpoint.read on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..kernel.cache import RANDOM_WEIGHTS, cache_root, write_once
from ..errors import MkportError
from ..kernel.spec import HYBRID_FAMILIES, ModelSpec

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class WeightNames:
    """Checkpoint names of one decoder's tensors."""

    layer: str  # prefix of layer i, with {i}
    embed: tuple[str, ...]  # one per embedding table
    heads: tuple[str, ...]  # one per output head; empty when tied
    final_norm: str
    in_proj: str | None = None  # prefix of the input projection (weight, bias)


def weight_names(spec: ModelSpec, model_prefix: str = "model.") -> WeightNames:
    if spec.role == "tts_talker":
        return WeightNames(
            layer="talker.model.layers.{i}.",
            embed=("talker.model.codec_embedding.weight",),
            heads=("talker.codec_head.weight",),
            final_norm="talker.model.norm.weight",
        )
    if spec.role == "tts_code_predictor":
        n = spec.num_embedding_tables
        return WeightNames(
            layer="talker.code_predictor.model.layers.{i}.",
            embed=tuple(f"talker.code_predictor.model.codec_embedding.{j}.weight" for j in range(n)),
            heads=tuple(f"talker.code_predictor.lm_head.{j}.weight" for j in range(spec.num_output_heads)),
            final_norm="talker.code_predictor.model.norm.weight",
            in_proj="talker.code_predictor.small_to_mtp_projection." if spec.input_projection else None,
        )
    # a multimodal checkpoint in the older layout keeps its head beside its decoder, under language_model.
    head = ("language_model." if model_prefix.startswith("language_model.") else "") + "lm_head.weight"
    return WeightNames(
        layer=model_prefix + "layers.{i}.",
        embed=(model_prefix + "embed_tokens.weight",),
        heads=() if spec.tie_embeddings else (head,),
        final_norm=model_prefix + "norm.weight",
    )


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint names of a sparse layer's MLP (after the layer prefix), as the family's released checkpoints hold
    them: one 2-D tensor a projection an expert ({e}), or (fused) every expert's in one 3-D tensor, gate: gate_up
    [experts, 2 x width, hidden] (each expert's gate rows, then its up rows) and down [experts, hidden, width]; the
    router, and qwen2_moe's shared expert with its gate."""

    router: str
    gate: str
    up: str | None
    down: str
    shared: str | None = None  # prefix of the shared expert's gate_proj / up_proj / down_proj
    shared_gate: str | None = None
    fused: bool = False
    # fused: what transformers 5's modules call router, gate_up and down where the checkpoint names them otherwise
    modules: tuple[str, str, str] | None = None


QWEN_EXPERTS = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                           "mlp.experts.{e}.down_proj.weight")
EXPERT_NAMES = {
    "qwen3_moe": QWEN_EXPERTS,
    "olmoe": QWEN_EXPERTS,
    "qwen2_moe": dataclasses.replace(QWEN_EXPERTS, shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight"),
    # Mixtral's w1 is the gate, w3 the up and w2 the down projection (MixtralBlockSparseTop2MLP before transformers 5)
    "mixtral": ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                           "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    # Qwen3.5's released checkpoints hold transformers 5's own fused expert tensors
    "qwen3_5_moe": ExpertNames("mlp.gate.weight", "mlp.experts.gate_up_proj", None, "mlp.experts.down_proj",
                               shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight", fused=True),
    # Granite's MoE checkpoints: every expert's gate then up rows in input_linear, its down in output_linear
    "granitemoe": ExpertNames("block_sparse_moe.router.layer.weight", "block_sparse_moe.input_linear.weight", None,
                              "block_sparse_moe.output_linear.weight", fused=True,
                              modules=("block_sparse_moe.router.weight", "block_sparse_moe.experts.gate_up_proj",
                                       "block_sparse_moe.experts.down_proj")),
}


def layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s tensor names (after the layer prefix) and shapes."""
    h, hd, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    # the order of the seeded random draws (random_checkpoint): dense layers keep the order they always had
    sparse = spec.sparse(layer)
    if spec.fused_projections:
        projections = {"self_attn.qkv_proj.weight": (q + 2 * kv, h)}
    else:
        projections = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                       "self_attn.v_proj.weight": (kv, h)}
    if spec.fused_gate_up:
        projections["mlp.gate_up_proj.weight"] = (2 * i, h)
    elif not sparse:
        projections.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h)})
    shapes = {
        "input_layernorm.weight": (h,),
        **projections,
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        **(expert_shapes(spec) if sparse else {"mlp.down_proj.weight": (h, i)}),
    }
    if spec.qk_norm:  # per head (qwen3), or over the whole projection (olmoe)
        shapes["self_attn.q_norm.weight"] = (hd,) if spec.qk_norm_span == "head" else (q,)
        shapes["self_attn.k_norm.weight"] = (hd,) if spec.qk_norm_span == "head" else (kv,)
    if not spec.pre_norms:  # olmo2/3 have no input_layernorm
        del shapes["input_layernorm.weight"]
    # gemma2/3's and glm4's sandwich norms, olmo2/3's MLP output norm; after the others, so that other families'
    # seeded draws keep their order (post_attention_layernorm is among those)
    attn_out, mlp_in, mlp_out = post_norm_names(spec)
    if spec.sandwich_norms:  # whichever of the two is post_attention_layernorm keeps its place above
        shapes[f"{attn_out}.weight"] = shapes[f"{mlp_in}.weight"] = (h,)
    if spec.post_norms:
        shapes[f"{mlp_out}.weight"] = (h,)
    if spec.qkv_bias:
        shapes["self_attn.q_proj.bias"] = (q,)
        shapes["self_attn.k_proj.bias"] = (kv,)
        shapes["self_attn.v_proj.bias"] = (kv,)
    return shapes


def expert_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP tensors (after the layer prefix) and shapes."""
    moe, h, names = spec.moe, spec.hidden_size, EXPERT_NAMES[spec.family]
    w = moe.expert_intermediate_size
    shapes = {names.router: (moe.num_experts, h)}
    if names.fused:
        shapes.update({names.gate: (moe.num_experts, 2 * w, h), names.down: (moe.num_experts, h, w)})
    else:
        for e in range(moe.num_experts):
            shapes.update({names.gate.format(e=e): (w, h), names.up.format(e=e): (w, h), names.down.format(e=e): (h, w)})
    if names.shared:
        width = moe.shared_expert_intermediate_size
        shapes.update({names.shared + "gate_proj.weight": (width, h), names.shared + "up_proj.weight": (width, h),
                       names.shared + "down_proj.weight": (h, width)})
        shapes[names.shared_gate] = (1, h)
    return shapes


def hybrid_layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's layer `layer`, as transformers 5 names it: Gated DeltaNet (linear_attn.*) or full attention whose
    q_proj holds each head's query and output gate side by side (2 x head_dim rows a head)."""
    h, hd, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    shapes.update(expert_shapes(spec) if spec.sparse(layer) else
                  {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
    la = spec.linear_attention
    if spec.is_linear(layer):
        nv = la.num_value_heads
        shapes.update({"linear_attn.in_proj_qkv.weight": (la.conv_dim, h), "linear_attn.in_proj_z.weight": (la.value_dim, h),
                       "linear_attn.in_proj_b.weight": (nv, h), "linear_attn.in_proj_a.weight": (nv, h),
                       "linear_attn.conv1d.weight": (la.conv_dim, 1, la.conv_kernel), "linear_attn.A_log": (nv,),
                       "linear_attn.dt_bias": (nv,), "linear_attn.norm.weight": (la.value_head_dim,),
                       "linear_attn.out_proj.weight": (h, la.value_dim)})
    else:
        q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
        shapes.update({"self_attn.q_proj.weight": (2 * q, h), "self_attn.k_proj.weight": (kv, h),
                       "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                       "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return shapes


def checkpoint_shapes(spec: ModelSpec, names: WeightNames) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i in range(spec.num_layers):
        for key, shape in (hybrid_layer_shapes(spec, i) if spec.family in HYBRID_FAMILIES else layer_shapes(spec, i)).items():
            shapes[names.layer.format(i=i) + key] = shape
    for name in names.embed:
        shapes[name] = (spec.vocab_size, spec.input_dim)
    for name in names.heads:
        shapes[name] = (spec.vocab_size, spec.hidden_size)
    shapes[names.final_norm] = (spec.hidden_size,)
    if names.in_proj:
        shapes[names.in_proj + "weight"] = (spec.hidden_size, spec.input_dim)
        shapes[names.in_proj + "bias"] = (spec.hidden_size,)
    return shapes


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor | None  # None (olmo2/3): attention reads the residual stream itself
    wqkv: torch.Tensor  # q, k, v projections stacked by rows
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor | None  # None (olmo2/3): the MLP reads the residual stream itself
    w_gate: torch.Tensor | None  # the dense MLP; in a sparse layer qwen2_moe's shared expert, else None
    w_up: torch.Tensor | None
    w_down: torch.Tensor | None
    router: torch.Tensor | None = None  # a sparse layer's [experts, hidden]
    expert_gate: torch.Tensor | None = None  # [experts, expert_intermediate, hidden]
    expert_up: torch.Tensor | None = None  # [experts, expert_intermediate, hidden]
    expert_down: torch.Tensor | None = None  # [experts, hidden, expert_intermediate]
    shared_gate: torch.Tensor | None = None  # qwen2_moe: [1, hidden], the shared expert's sigmoid gate
    # qwen3_5: a full-attention layer's output gate rows; a Gated DeltaNet layer's weights (wqkv, wo and the q/k
    # norms are None there)
    q_gate: torch.Tensor | None = None  # [heads * head_dim, hidden]
    lin_in: torch.Tensor | None = None  # [conv_dim + value_dim + 2 * value_heads, hidden]: q/k/v, z, b, a rows
    lin_conv: torch.Tensor | None = None  # [conv_dim, conv_kernel]: the depthwise conv's taps, oldest input first
    lin_a_log: torch.Tensor | None = None  # [value_heads]
    lin_dt_bias: torch.Tensor | None = None  # [value_heads]
    lin_norm: torch.Tensor | None = None  # [value_head_dim]: the gated RMSNorm's weight (w, not 1 + w)
    lin_out: torch.Tensor | None = None  # [hidden, value_dim]
    # gemma2/3's sandwich norms and olmo2/3's post norms: the attention output's (post_attention_layernorm) and the MLP
    # output's (post_feedforward_layernorm); gemma2/3's mlp_norm is then pre_feedforward_layernorm
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None


@dataclass
class DecoderWeights:
    """One decoder's weights in the kernel's layout (bf16)."""

    embed: torch.Tensor  # [tables, vocab, input_dim]
    heads: torch.Tensor | None  # [heads, vocab, hidden]; None when tied to embed[0]
    final_norm: torch.Tensor
    in_proj_w: torch.Tensor | None
    in_proj_b: torch.Tensor | None
    layers: list[LayerWeights] = field(default_factory=list)

    def map(self, fn) -> "DecoderWeights":
        """The same weights with fn applied to every tensor."""
        def apply(t):
            return None if t is None else fn(t)

        return DecoderWeights(
            embed=apply(self.embed),
            heads=apply(self.heads),
            final_norm=apply(self.final_norm),
            in_proj_w=apply(self.in_proj_w),
            in_proj_b=apply(self.in_proj_b),
            layers=[LayerWeights(**{k: apply(v) for k, v in vars(lw).items()}) for lw in self.layers],
        )

    def to(self, device) -> "DecoderWeights":
        return self.map(lambda t: t.to(device).contiguous())

    def head(self, index: int) -> torch.Tensor:
        return self.embed[0] if self.heads is None else self.heads[index]


INDEX = "model.safetensors.index.json"
KEPT_DTYPES = ("BF16",)
CONVERTED_DTYPES = ("F16", "F32", "F64")  # converted to bf16, with a note on stderr


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # as safetensors names it: BF16, F32, I8, ...
    shape: tuple[int, ...]


class Checkpoint:
    """A local folder of safetensors, opened and indexed once per command: each tensor's file, dtype and
    shape, from model.safetensors.index.json (shards confined to the folder) or from every *.safetensors in
    the folder, read from the file headers. Damaged files and indexes are refused here with one line naming
    the file."""

    def __init__(self, folder: Path, tensors: dict[str, TensorInfo]):
        self.folder = folder
        self.tensors = tensors
        self._noted_conversion = False
        self._noted_mtp = False

    @classmethod
    def open(cls, folder) -> "Checkpoint":
        folder = Path(folder)
        if not folder.is_dir():
            raise MkportError(f"weights folder not found: {folder}")
        index = folder / INDEX
        if index.exists():
            shards = _read_index(index)
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise MkportError(f"no *.safetensors files in {folder}")
            shards = {path: None for path in files}
        tensors = {}
        for path, expected in shards.items():
            found = _read_header(path)
            if expected is not None:
                absent = sorted(set(expected) - set(found))
                if absent:
                    raise MkportError(f"{index}: tensor '{absent[0]}' is not in {path.name}, which the index names for it")
                found = {name: found[name] for name in expected}
            tensors.update(found)
        return cls(folder, tensors)

    @property
    def files(self) -> dict[str, Path]:
        """Tensor name -> file."""
        return {name: info.file for name, info in self.tensors.items()}

    def model_prefix(self, spec: ModelSpec) -> str:
        """Causal-LM checkpoints keep the decoder under model., multimodal ones under model.language_model."""
        if spec.role != "llm":
            return "model."
        for prefix in ("model.", "model.language_model.", "language_model.model."):
            if prefix + "embed_tokens.weight" in self.tensors:
                return prefix
        return "model."

    def check(self, wanted: dict[str, tuple[int, ...]]) -> None:
        """Every wanted tensor is there, with its shape and a supported dtype (from the headers alone)."""
        missing = [n for n in wanted if n not in self.tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise MkportError(f"tensor '{missing[0]}' is missing from the checkpoint in {self.folder}{more}")
        for name, shape in wanted.items():
            info = self.tensors[name]
            if info.shape != tuple(shape):
                raise MkportError(f"tensor '{name}' in {info.file} has shape {info.shape}, expected {tuple(shape)}")
            if info.dtype not in KEPT_DTYPES + CONVERTED_DTYPES:
                raise MkportError(
                    f"tensor '{name}' in {info.file} is {info.dtype}: quantized and integer weights are not "
                    f"supported; supported: BF16 ({', '.join(CONVERTED_DTYPES)} are converted to BF16)"
                )

    def read(self, wanted: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The wanted tensors as bf16, checked (see check) and refused when any value is NaN or Inf."""
        self.check(wanted)
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out, converted = {}, sorted({self.tensors[n].dtype for n in wanted} - set(KEPT_DTYPES))
        for path, names in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        out[name] = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise MkportError(f"{path} cannot be read: {_first_line(e)}") from None
        for name, t in out.items():
            out[name] = t = t.to(DTYPE)  # first: a float32 value past bf16's range becomes Inf here
            low, high = torch.aminmax(t)  # one pass (a tenth of isfinite's time); a NaN makes both NaN
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                raise MkportError(f"tensor '{name}' in {self.tensors[name].file} has NaN or Inf values")
        if converted and not self._noted_conversion:
            self._noted_conversion = True
            print(f"note: {self.folder}: {'/'.join(converted)} weights converted to BF16", file=sys.stderr)
        return out


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _read_index(index: Path) -> dict[Path, list[str]]:
    """Shard file -> the tensor names the index puts in it. Shard names must stay inside the folder."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MkportError(f"{index} is not valid JSON: {e}") from None
    except OSError as e:
        raise MkportError(f"cannot read {index}: {e.strerror}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise MkportError(f"{index} has no weight_map (an object of tensor name -> shard file)")
    shards: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise MkportError(f"{index}: tensor '{name}' has shard {shard!r}, expected a file name")
        rel = PurePosixPath(shard)
        if rel.is_absolute() or ".." in rel.parts or "\\" in shard:
            raise MkportError(f"{index}: shard '{shard}' is outside the model folder; shards must be files in it")
        path = index.parent / rel
        if not path.is_file():
            raise MkportError(f"{index}: shard '{shard}' does not exist")
        shards.setdefault(path, []).append(name)
    return shards


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        infos = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                infos[name] = TensorInfo(path, view.get_dtype(), tuple(view.get_shape()))
        return infos
    except (SafetensorError, OSError) as e:
        raise MkportError(f"{path} is not a readable safetensors file: {_first_line(e)}") from None


def read_checkpoint(spec: ModelSpec, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The spec's tensors, checked by name, shape, dtype and value, as bf16. Multi-token-prediction heads (mtp.*,
    Qwen3.5) are left in the file, with a note: the decode step does not use them."""
    mtp = [name for name in checkpoint.tensors if name.startswith("mtp.")]
    if mtp and not checkpoint._noted_mtp:
        checkpoint._noted_mtp = True
        print(f"note: {checkpoint.folder}: {len(mtp)} multi-token-prediction tensors (mtp.*) skipped: the decode "
              "step does not use them", file=sys.stderr)
    return checkpoint.read(checkpoint_shapes(spec, weight_names(spec, checkpoint.model_prefix(spec))))


def to_kernel_layout(spec: ModelSpec, tensors: dict[str, torch.Tensor], model_prefix: str = "model.",
                     release: bool = False) -> DecoderWeights:
    """release: each expert's tensors leave `tensors` as they are stacked, so that a mixture of experts never holds
    its experts twice (a 30B model's 57 GB of them on a 141 GB GPU)."""
    names = weight_names(spec, model_prefix)
    layers = []
    for i in range(spec.num_layers):
        p = names.layer.format(i=i)
        if spec.family in HYBRID_FAMILIES:
            layers.append(_hybrid_layer(spec, tensors, p, i, release))
            continue
        bias = None
        if spec.qkv_bias:
            bias = torch.cat([tensors[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]).contiguous()
        if spec.fused_projections:  # phi3: q, k, v rows in that order
            wqkv = tensors[p + "self_attn.qkv_proj.weight"]
        else:
            wqkv = torch.cat([tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if spec.fused_gate_up:  # gate_up_proj's first half is the gate
            w_gate, w_up = tensors[p + "mlp.gate_up_proj.weight"].chunk(2)
        else:
            w_gate, w_up = tensors.get(p + "mlp.gate_proj.weight"), tensors.get(p + "mlp.up_proj.weight")
        if spec.rope.adjacent_pairs:
            wqkv, bias = pairs_to_halves(spec, wqkv), None if bias is None else pairs_to_halves(spec, bias)
        mlp = {"w_gate": w_gate, "w_up": w_up, "w_down": tensors.get(p + "mlp.down_proj.weight")}
        if spec.sparse(i):
            mlp = _expert_layout(spec, tensors, p, release)
        norms = {"attn_norm": tensors[p + "input_layernorm.weight"] if spec.pre_norms else None,
                 "mlp_norm": tensors[p + "post_attention_layernorm.weight"]}
        if spec.post_norms:
            attn_out, mlp_in, mlp_out = post_norm_names(spec)
            norms.update(mlp_norm=tensors[p + f"{mlp_in}.weight"] if spec.pre_norms else None,
                         post_attn_norm=tensors[p + f"{attn_out}.weight"],
                         post_mlp_norm=tensors[p + f"{mlp_out}.weight"])
        layers.append(
            LayerWeights(
                wqkv=wqkv.contiguous(),
                bqkv=bias,
                q_norm=tensors.get(p + "self_attn.q_norm.weight"),
                k_norm=tensors.get(p + "self_attn.k_norm.weight"),
                wo=tensors[p + "self_attn.o_proj.weight"],
                **norms,
                **{k: None if v is None else v.contiguous() for k, v in mlp.items()},
            )
        )
    return DecoderWeights(
        embed=torch.stack([tensors[n] for n in names.embed]),
        heads=torch.stack([tensors[n] for n in names.heads]) if names.heads else None,
        final_norm=tensors[names.final_norm],
        in_proj_w=tensors[names.in_proj + "weight"] if names.in_proj else None,
        in_proj_b=tensors[names.in_proj + "bias"] if names.in_proj else None,
        layers=layers,
    )


def post_norm_names(spec: ModelSpec) -> tuple[str, str, str]:
    """A post-norm layer's norms of the attention output, the MLP input and the MLP output, as its checkpoint names
    them: GLM-4's post_attention_layernorm norms the MLP input, Gemma 2/3's and OLMo 2/3's the attention output."""
    if spec.family == "glm4":
        return "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"
    return "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"


def halves_order(head_dim: int, rotary_dim: int = 0) -> torch.Tensor:
    """A head's dimensions in rotate-half order from adjacent-pair order: of the first rotary_dim (all when 0), 0, 2,
    4, ... then 1, 3, 5, ...; the dimensions RoPE leaves alone (partial RoPE) after them as they are."""
    rotated = rotary_dim or head_dim
    return torch.cat([torch.arange(rotated).view(rotated // 2, 2).t().reshape(-1), torch.arange(rotated, head_dim)])


def pairs_to_halves(spec: ModelSpec, rows: torch.Tensor) -> torch.Tensor:
    """q/k/v rows (or their bias) with each q and k head's RoPE pairs (2i, 2i + 1) moved to (i, i + r/2) of the r
    rotated dimensions, where the kernel rotates them with the same frequency i (RopeSpec.adjacent_pairs); v's rows
    as they are. Scores are sums over a head's dimensions, so q and k in the same new order give the same attention."""
    qk_rows = (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    heads = rows[:qk_rows].unflatten(0, (-1, spec.head_dim))[:, halves_order(spec.head_dim, spec.rotary_dim)]
    return torch.cat([heads.flatten(0, 1), rows[qk_rows:]])


def _expert_layout(spec: ModelSpec, tensors: dict[str, torch.Tensor], p: str, release: bool = False
                   ) -> dict[str, torch.Tensor | None]:
    """A sparse layer's MLP in the kernel's layout: each projection of every expert stacked by expert index, so
    that expert e's rows start at e * rows; qwen2_moe's shared expert where the dense MLP sits."""
    names = EXPERT_NAMES[spec.family]
    experts = range(spec.moe.num_experts)
    take = tensors.pop if release else tensors.__getitem__

    def stack(pattern: str) -> torch.Tensor:
        return torch.stack([take(p + pattern.format(e=e)) for e in experts])

    if names.fused:  # each half copied out, so that the fused tensor is freed (release)
        gate, up = (half.contiguous() for half in take(p + names.gate).chunk(2, dim=1))
        stacked = {"expert_gate": gate, "expert_up": up, "expert_down": take(p + names.down)}
    else:
        stacked = {"expert_gate": stack(names.gate), "expert_up": stack(names.up), "expert_down": stack(names.down)}
    out = {"router": tensors[p + names.router], **stacked, "w_gate": None, "w_up": None, "w_down": None}
    if names.shared:
        out.update({f"w_{x}": tensors[p + names.shared + f"{x}_proj.weight"] for x in ("gate", "up", "down")})
        out["shared_gate"] = tensors[p + names.shared_gate]
    return out


def _hybrid_layer(spec: ModelSpec, tensors: dict[str, torch.Tensor], p: str, layer: int,
                  release: bool = False) -> LayerWeights:
    """A Qwen3.5 layer in the kernel's layout: the DeltaNet's four input projections stacked into one matrix (one
    matvec), the conv's taps as [channels, kernel]; a full-attention layer's q_proj split into the query rows (into
    wqkv, as every family's) and the gate rows (q_gate): q_proj interleaves them a head at a time. A sparse layer's
    experts as _expert_layout lays them out."""
    if spec.sparse(layer):
        mlp = _expert_layout(spec, tensors, p, release)
    else:
        mlp = {f"w_{x}": tensors[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up", "down")}
    common = dict(attn_norm=tensors[p + "input_layernorm.weight"], mlp_norm=tensors[p + "post_attention_layernorm.weight"],
                  bqkv=None, **mlp)
    if spec.is_linear(layer):
        la = p + "linear_attn."
        stacked = torch.cat([tensors[la + f"in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")])
        return LayerWeights(**common, wqkv=None, q_norm=None, k_norm=None, wo=None, lin_in=stacked.contiguous(),
                            lin_conv=tensors[la + "conv1d.weight"][:, 0].contiguous(), lin_a_log=tensors[la + "A_log"],
                            lin_dt_bias=tensors[la + "dt_bias"], lin_norm=tensors[la + "norm.weight"],
                            lin_out=tensors[la + "out_proj.weight"])
    q_and_gate = tensors[p + "self_attn.q_proj.weight"].view(spec.num_heads, 2, spec.head_dim, spec.hidden_size)
    wqkv = torch.cat([q_and_gate[:, 0].reshape(-1, spec.hidden_size), tensors[p + "self_attn.k_proj.weight"],
                      tensors[p + "self_attn.v_proj.weight"]])
    return LayerWeights(**common, wqkv=wqkv.contiguous(), q_norm=tensors[p + "self_attn.q_norm.weight"],
                        k_norm=tensors[p + "self_attn.k_norm.weight"], wo=tensors[p + "self_attn.o_proj.weight"],
                        q_gate=q_and_gate[:, 1].reshape(-1, spec.hidden_size).contiguous())


def load_weights(spec: ModelSpec, checkpoint: Checkpoint) -> DecoderWeights:
    return to_kernel_layout(spec, read_checkpoint(spec, checkpoint), checkpoint.model_prefix(spec), release=True)


def _init_rule(spec: ModelSpec, names: WeightNames, name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """How a random tensor is drawn, scaled like a trained model's: ("normal", std, mean) or ("uniform", low, high).
    Unit-variance projections, norm weights near 1, and an output head whose logits spread over several units so
    that greedy decoding has clear winners (not all-tied logits). Both generators below follow it."""
    if name.endswith("linear_attn.A_log"):  # decay rates exp(A_log) from 0.05 to 1: slow and fast forgetting
        return "uniform", math.log(0.05), 0.0
    if name.endswith("linear_attn.dt_bias"):
        return "normal", 0.5, 0.0
    if name.endswith("linear_attn.conv1d.weight"):  # unit output variance over the kernel's taps
        return "normal", 1.0 / math.sqrt(shape[-1]), 0.0
    if name.endswith("linear_attn.norm.weight"):  # the gated norm scales by w itself
        return "normal", 0.1, 1.0
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return "normal", 0.1, 1.0 - spec.norm_weight_offset  # (1 + w) norms: w near 0
    if name.endswith(".bias"):
        return "normal", 0.1, 0.0
    if name in names.embed or name in names.heads:
        return "normal", 4.0 / math.sqrt(spec.hidden_size), 0.0
    return "normal", 1.0 / math.sqrt(shape[-1]), 0.0  # a projection: unit output variance for unit input variance


def random_checkpoint(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in checkpoint naming (_init_rule), drawn in order from one CPU generator: every
    bundled spec's random model and recorded number comes from this sequence."""
    gen = torch.Generator().manual_seed(seed)
    names = weight_names(spec)
    out = {}
    for name, shape in checkpoint_shapes(spec, names).items():
        kind, a, b = _init_rule(spec, names, name, shape)
        if kind == "uniform":
            out[name] = torch.empty(shape).uniform_(a, b, generator=gen).to(DTYPE)
        else:
            out[name] = (torch.randn(shape, generator=gen) * a + b).to(DTYPE)
    return out


# Counter-based random weights: element j of tensor `name` is a hash of (seed, name, j), so a tensor can be made on
# any device, in any order and in chunks, without a checkpoint on disk. The hash uses only integer ops on values below
# 2^49 (no overflow: products split into 16-bit halves), the normal is a sum of four 16-bit uniforms (an exact integer
# below 2^24, so exactly a float32), and the scale is one float32 multiply and add: every step is exact or IEEE-rounded,
# so CPU and GPU give the same bits. Sums of four uniforms have the normal's mean and std with tails cut at 3.46 std.
COUNTER_CHUNK = 1 << 22  # elements a chunk: ~200 MB of int64 temporaries
_MASK32 = 0xFFFFFFFF
_UNIFORM16 = 1 << 16
_SUM4_MEAN = 2 * (_UNIFORM16 - 1)  # the mean of four uniforms on 0..65535
_SUM4_STD = math.sqrt((_UNIFORM16**2 - 1) / 3)  # four times the variance (M^2 - 1) / 12 of one


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32): c in 16-bit halves keeps every product below 2^48 (int64 never wraps)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection of [0, 2^32)); x is non-negative, so >> is a logical shift."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_key(seed: int, name: str) -> tuple[int, int]:
    """Two 32-bit keys of a tensor, from the seed and its checkpoint name alone."""
    digest = hashlib.sha256(f"mkport-counter:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def counter_bits(key: tuple[int, int], counter: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) for each non-negative int64 counter."""
    low, high = counter & _MASK32, counter >> 32
    return _mix32(_mix32(low ^ key[0]) ^ high ^ key[1])


def counter_tensor(key: tuple[int, int], shape: tuple[int, ...], rule: tuple[str, float, float], device="cpu",
                   chunk: int = COUNTER_CHUNK) -> torch.Tensor:
    """A bf16 tensor drawn by `rule` (_init_rule) from the counter hash, made `chunk` elements at a time on `device`."""
    kind, a, b = rule
    out = torch.empty(math.prod(shape), dtype=DTYPE, device=device)
    for start in range(0, out.numel(), chunk):
        index = torch.arange(start, min(start + chunk, out.numel()), dtype=torch.int64, device=device)
        if kind == "uniform":  # 24 bits, centred in their cell: (u + 0.5) / 2^24 in (0, 1), exact in float32
            u = (counter_bits(key, index) >> 8).float()
            value = (u + 0.5) * (2.0**-24 * (b - a)) + a
        else:  # two hashes, four 16-bit uniforms: counters 2j and 2j + 1
            first, second = counter_bits(key, 2 * index), counter_bits(key, 2 * index + 1)
            total = (first & 0xFFFF) + (first >> 16) + (second & 0xFFFF) + (second >> 16) - _SUM4_MEAN
            value = total.float() * (a / _SUM4_STD) + b
        out[start : start + index.numel()] = value.to(DTYPE)
    return out.view(shape)


def counter_checkpoint(spec: ModelSpec, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the spec from the counter-based generator (CounterCheckpoint reads them a few at a time)."""
    return CounterCheckpoint(spec, seed, device).read(checkpoint_shapes(spec, weight_names(spec)))


class CounterCheckpoint(Checkpoint):
    """Counter-based random weights behind Checkpoint's interface: each tensor is computed on `device` when read,
    never written, so a model larger than the disk (or than host memory) loads straight onto the GPU, and a layer at
    a time for the layered reference."""

    def __init__(self, spec: ModelSpec, seed: int = 0, device="cpu"):
        self.spec, self.seed, self.device = spec, seed, torch.device(device)
        shapes = checkpoint_shapes(spec, weight_names(spec))
        # folder is only named in messages: there is none
        super().__init__(f"counter-based random weights of {spec.name} (seed {seed})",
                         {name: TensorInfo(None, "BF16", tuple(shape)) for name, shape in shapes.items()})

    def read(self, wanted: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        self.check(wanted)
        names = weight_names(self.spec)
        return {name: counter_tensor(counter_key(self.seed, name), tuple(shape),
                                     _init_rule(self.spec, names, name, tuple(shape)), self.device)
                for name, shape in wanted.items()}


def write_random_weights(spec: ModelSpec, folder: Path, seed: int = 0) -> Path:
    """Writes random weights as <folder>/model.safetensors (refuses to overwrite a different file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    if path.exists():
        raise MkportError(f"{path} exists; refusing to overwrite it with random weights")
    save_file(random_checkpoint(spec, seed), str(path), metadata={"mkport_seed": str(seed), "spec": spec.name})
    return path


# Above this many bytes of bf16 weights (every bundled spec is below: mistral-7b's 14.5 GB), random weights are the
# counter-based ones, made where they are used: a checkpoint written first would fill the disk (a 30B model's is
# 61 GB) and take minutes. Below it the sequential generator stays, so no existing random model or number changes.
COUNTER_WEIGHTS_BYTES = 16e9


def checkpoint_bytes(spec: ModelSpec) -> int:
    """The bf16 bytes of every tensor of the spec's checkpoint (all experts)."""
    return 2 * sum(math.prod(shape) for shape in checkpoint_shapes(spec, weight_names(spec)).values())


def random_weights(spec: ModelSpec, seed: int = 0) -> Checkpoint:
    """The spec's seeded random weights: a cached checkpoint below COUNTER_WEIGHTS_BYTES, counter-based ones above
    (made on the GPU when there is one)."""
    if checkpoint_bytes(spec) > COUNTER_WEIGHTS_BYTES:
        return CounterCheckpoint(spec, seed, "cuda" if torch.cuda.is_available() else "cpu")
    return Checkpoint.open(random_weights_folder(spec, seed))


def random_weights_folder(spec: ModelSpec, seed: int = 0) -> Path:
    """A seeded random checkpoint of the spec in the mkport cache, written once and reused."""
    folder = cache_root() / RANDOM_WEIGHTS / f"{spec.name}-{spec.digest()}-seed{seed}"
    return write_once(folder, lambda tmp: write_random_weights(spec, tmp, seed))
