"""ModelSpec: every constant of a decoder, derived once from a Hugging Face config.

Nothing downstream reads the raw config again. Unsupported configs fail here with one line naming the
field, its value and what is supported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import MkportError

FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "granite", "smollm3", "phi3", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral",
            "granitemoe", "qwen3_5", "qwen3_5_moe", "gemma", "gemma2", "gemma3", "olmo2", "olmo3", "ernie4_5", "helium",
            "seed_oss", "exaone4", "glm", "glm4")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe", "qwen3_5_moe")
# granite's four multipliers: the dense family and its mixture of experts
GRANITE_FAMILIES = ("granite", "granitemoe")
# Families validated on the CPU whose megakernel builds but has not yet passed `mkport diff` on a GPU
# (docs/validation.md): the GPU commands say so. A new family waits here until its GPU run
GPU_UNVALIDATED_FAMILIES: tuple[str, ...] = ()
# Qwen3.5's hybrids (Gated DeltaNet and gated full attention): the dense one, and the one whose every MLP is experts
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# post-norm layers: OLMo 2/3 with q/k norms over the whole projection, EXAONE 4 with them a head at a time
POST_NORM_FAMILIES = ("olmo2", "olmo3", "exaone4")
# Llama's layers with RoPE on adjacent pairs (RopeSpec.adjacent_pairs)
ADJACENT_PAIR_FAMILIES = ("ernie4_5", "helium", "glm", "glm4")
# Families whose attention_bias is a q/k/v bias (qwen2's always is)
QKV_BIAS_FAMILIES = ("qwen2", "helium", "seed_oss", "glm", "glm4")
# Families whose RoPE may rotate the first part of a head only (partial_rotary_factor), and its default there
PARTIAL_ROPE_DEFAULTS = {"phi3": 1.0, "glm": 0.5, "glm4": 0.5}
# The checkpoint holds gate/up as one gate_up_proj (phi3 q/k/v as one qkv_proj too: ModelSpec.fused_projections)
FUSED_GATE_UP_FAMILIES = ("phi3", "glm", "glm4")
ROPE_VARIANTS = ("standard", "llama3", "linear", "mrope", "yarn", "dynamic", "longrope")
# RoPE whose frequencies follow the sequence length (transformers' dynamic_rope_update)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
HEAD_DIMS = (64, 128, 256)
MAX_GQA_RATIO = 16
# Layers a spec may have: the kernel keeps a sliding model's full layers before each layer in an unsigned char
# (KV_FULL_BEFORE, constants.cuh.j2), and every layer's tables are written into the sources. The deepest released
# decoders have about 128.
MAX_LAYERS = 256
TTS_PARTS = ("talker", "code_predictor")
MAX_BASE_NAME = 64  # characters of a folder's name kept in a spec name
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

# Bundled spec name -> (file in model_specs/, part of a Qwen3-TTS config or None).
BUNDLED = {
    "qwen3-0.6b": ("qwen3-0.6b.json", None),
    "tinyllama-1.1b": ("tinyllama-1.1b.json", None),
    "mistral-7b-v0.3": ("mistral-7b-v0.3.json", None),
    "mistral-7b-v0.1": ("mistral-7b-v0.1.json", None),
    "granite-3.1-2b": ("granite-3.1-2b-instruct.json", None),
    "smollm3-3b": ("smollm3-3b.json", None),
    "qwen3-tts-0.6b-talker": ("qwen3-tts-12hz-0.6b-customvoice.json", "talker"),
    "qwen3-tts-0.6b-code-predictor": ("qwen3-tts-12hz-0.6b-customvoice.json", "code_predictor"),
    "qwen3-tts-1.7b-talker": ("qwen3-tts-12hz-1.7b-customvoice.json", "talker"),
    "qwen3-tts-1.7b-code-predictor": ("qwen3-tts-12hz-1.7b-customvoice.json", "code_predictor"),
    "qwen3-30b-a3b": ("qwen3-30b-a3b.json", None),
    "qwen1.5-moe-a2.7b": ("qwen1.5-moe-a2.7b.json", None),
    "olmoe-1b-7b": ("olmoe-1b-7b-0924.json", None),
    "mixtral-8x7b": ("mixtral-8x7b-v0.1.json", None),
    "gemma-2-2b": ("gemma-2-2b-it.json", None),
    "gemma-3-1b": ("gemma-3-1b-it.json", None),
    "olmo-2-0425-1b": ("olmo-2-0425-1b.json", None),
    "phi-3.5-mini": ("phi-3.5-mini-instruct.json", None),
    "qwen3.5-0.8b": ("qwen3.5-0.8b.json", None),
    "qwen3.5-4b": ("qwen3.5-4b.json", None),
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    variant: str  # one of ROPE_VARIANTS
    factor: float = 1.0  # llama3, linear, yarn, dynamic
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 1.0  # llama3
    original_max_position: int = 0  # llama3, yarn, longrope; dynamic: max_position_embeddings, its reference length
    mrope_section: tuple[int, ...] = ()  # mrope: frequencies per position stream (t, h, w)
    mrope_interleaved: bool = False
    attention_factor: float = 1.0  # yarn, longrope: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the correction range's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the correction range rounded out to whole dimensions
    long_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors past original_max_position
    short_factor: tuple[float, ...] = ()  # longrope: up to it
    # ERNIE 4.5 and Helium rotate adjacent pairs (2i, 2i+1) by frequency i where the kernel rotates (i, i + d/2):
    # loading reorders each q and k head's rows into halves (runtime.weights.pairs_to_halves), q . k unchanged
    adjacent_pairs: bool = False


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP, as the family's transformers classes route it: softmax over every expert's router
    logit in fp32, the top_k largest probabilities, renormalised to sum 1 when norm_topk_prob (mixtral always: the
    same as a softmax over its top-k logits). The chosen experts' outputs are weighted and summed in ascending
    expert index (transformers' order), then qwen2_moe's shared expert is added, gated by sigmoid(w . x)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # layers whose MLP is the expert block; the others are dense (intermediate_size)
    shared_expert_intermediate_size: int = 0  # qwen2_moe's shared expert; 0: none


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The shape of Qwen3.5's Gated DeltaNet layers: q/k heads (num_key_heads of key_head_dim) shared by groups of
    value heads, each value head with a [key_head_dim, value_head_dim] recurrent state; a causal depthwise conv of
    conv_kernel taps over q, k and v."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_rows(self) -> int:
        """Rows of the input projections stacked: q/k/v (conv_dim), z (value_dim), b and a (a value head each)."""
        return self.conv_dim + self.value_dim + 2 * self.num_value_heads


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # one of FAMILIES: qwen3 (q/k RMSNorm), qwen2 (q/k/v bias), llama, and the families after it
    role: str  # llm | tts_talker | tts_code_predictor: selects the weight names
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope: RopeSpec
    max_position: int
    tie_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    input_mode: str  # token | embedding (an input embedding from a device buffer; token ids still work)
    output_mode: str  # logits (head + sampling) | hidden (final hidden state only)
    num_embedding_tables: int = 1  # the code predictor has one per codebook
    num_output_heads: int = 1  # likewise
    input_dim: int = 0  # width of input embeddings; != hidden_size means a projection runs first
    # Per layer: how many positions its attention sees (0: all, a causal full layer; W: the query at cache row p sees
    # rows p-W+1..p, transformers' sliding window). Empty: every layer full.
    attention_windows: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()  # layers whose q/k get no RoPE (SmolLM3's no_rope_layers zeros)
    embedding_multiplier: float = 1.0  # granite: the input embedding is scaled by it
    residual_multiplier: float = 1.0  # granite: x + m * f(x) for attention and MLP
    attention_multiplier: float = 0.0  # granite: the attention score scale; 0 means head_dim^-0.5
    logits_scaling: float = 1.0  # granite: logits are divided by it
    # head: q/k RMSNorm per head (qwen3); projection: over all heads at once (olmoe, olmo2/3)
    qk_norm_span: str = "head"
    moe: MoeSpec | None = None  # the experts of the sparse layers; None: every layer dense
    # qwen3_5 (hybrid): layers that are Gated DeltaNet linear attention, and their shape; the rest are full attention
    linear_layers: tuple[int, ...] = ()
    linear_attention: LinearAttentionSpec | None = None
    rotary_dim: int = 0  # dimensions of a head that RoPE rotates (the first ones); 0: all of head_dim
    norm_weight_offset: float = 0.0  # 1.0: RMSNorms scale by (1 + w) (qwen3_5's zero-centred weights)
    attn_output_gate: bool = False  # qwen3_5: q_proj also gives a gate, sigmoid(gate) * attention before o_proj
    mlp_activation: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (Gemma's GeGLU, gelu_pytorch_tanh)
    attn_logit_softcap: float = 0.0  # gemma2: scores become c * tanh(scores / c) before the mask; 0: none
    final_logit_softcap: float = 0.0  # gemma2: logits become c * tanh(logits / c); 0: none
    # gemma2/3: the attention and MLP outputs are RMSNormed before their residual adds (post_attention_layernorm and
    # post_feedforward_layernorm), and the MLP's input norm is pre_feedforward_layernorm
    sandwich_norms: bool = False
    local_rope: RopeSpec | None = None  # gemma3: the sliding layers' own RoPE (rope_local_base_freq); None: rope
    # False (olmo2, olmo3): no input norms; attention and MLP read the residual stream and their outputs are RMSNormed
    # before the residual adds (post_attention_layernorm, post_feedforward_layernorm)
    pre_norms: bool = True

    def __post_init__(self):
        # the name reaches file names and rendered sources: nothing but the safe alphabet (see safe_name)
        if not SAFE_NAME.fullmatch(self.name) or ".." in self.name or len(self.name) > 2 * MAX_BASE_NAME:
            raise MkportError(f"spec name {self.name!r} is not safe: use letters, digits, '.', '_' and '-'")

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def input_projection(self) -> bool:
        return self.input_dim != self.hidden_size

    @property
    def fused_projections(self) -> bool:
        """The checkpoint holds q/k/v as one qkv_proj (phi3; its gate/up too: fused_gate_up)."""
        return self.family == "phi3"

    @property
    def fused_gate_up(self) -> bool:
        """The checkpoint holds gate/up as one gate_up_proj, the gate its first half (phi3, glm, glm4)."""
        return self.family in FUSED_GATE_UP_FAMILIES

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier or self.head_dim**-0.5

    @property
    def max_context(self) -> int:
        """Positions one sequence may use: max_position_embeddings, or with yarn original_max_position_embeddings times
        its factor where that is more (Qwen2.5's and Qwen3's long-context configs add yarn and keep
        max_position_embeddings at the pretrained length; vLLM reads them so too). Dynamic NTK raises its base for any
        length past max_position_embeddings: no bound (sys.maxsize)."""
        if self.rope.variant == "dynamic":
            return sys.maxsize
        if self.rope.variant == "yarn":
            return max(self.max_position, int(self.rope.original_max_position * self.rope.factor))
        return self.max_position

    @property
    def max_context_text(self) -> str:
        """max_context and where it comes from, for messages: "the model's 40960 positions (max_position_embeddings)".
        Dynamic NTK has no bound, so no message of its limit."""
        if self.rope.variant != "yarn" or self.max_context == self.max_position:
            return f"the model's {self.max_position} positions (max_position_embeddings)"
        return (f"the model's {self.max_context} positions (original_max_position_embeddings "
                f"{self.rope.original_max_position} x yarn factor {self.rope.factor:g})")

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends to (0: all)."""
        return self.attention_windows[layer] if self.attention_windows else 0

    @property
    def sliding(self) -> bool:
        return any(self.attention_windows)

    @property
    def post_norms(self) -> bool:
        """The attention and MLP outputs are RMSNormed before their residual adds (gemma2/3's sandwich norms, olmo2/3)."""
        return self.sandwich_norms or not self.pre_norms

    def uses_local_rope(self, layer: int) -> bool:
        """Layer `layer` rotates with local_rope (gemma3's and olmo3's sliding layers)."""
        return self.local_rope is not None and self.window(layer) > 0

    def uses_rope(self, layer: int) -> bool:
        return layer not in self.nope_layers

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` is Gated DeltaNet linear attention (no KV cache; a recurrent state instead)."""
        return layer in self.linear_layers

    def sparse(self, layer: int) -> bool:
        """Layer `layer`'s MLP is the expert block."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def weight_bytes_per_step(self, all_experts: bool = False, experts_read: dict | None = None) -> int:
        """bf16 bytes one decode step must read: every layer, the final norm, one head, one input row. In a sparse
        layer that is the router, the top_k chosen experts and the shared expert; with all_experts, every expert
        (the checkpoint's size); with experts_read (sparse layer -> experts, a mean over steps), that many (a batch
        reads the union of its sequences' experts)."""
        h, q_rows, la = self.hidden_size, self.num_heads * self.head_dim, self.linear_attention
        elems = h + self.input_dim
        for i in range(self.num_layers):
            elems += (4 if self.sandwich_norms else 2) * h + self._mlp_elems(i, all_experts, experts_read)
            if self.is_linear(i):
                elems += (la.in_rows * h + la.conv_dim * la.conv_kernel + 2 * la.num_value_heads + la.value_head_dim
                          + h * la.value_dim)
                continue
            elems += self.qkv_rows * h + h * q_rows
            if self.qk_norm:  # one weight a q/k head (per head), or one a q/k row (over the projection)
                per_head = self.qk_norm_span == "head"
                elems += 2 * self.head_dim if per_head else (self.num_heads + self.num_kv_heads) * self.head_dim
            if self.qkv_bias:
                elems += self.qkv_rows
            if self.attn_output_gate:
                elems += q_rows * h
        if self.input_projection:
            elems += self.input_dim * h + h
        if self.output_mode == "logits":
            elems += self.vocab_size * h
        return round(2 * elems)

    def _mlp_elems(self, layer: int, all_experts: bool, experts_read: dict | None = None) -> int:
        h, moe = self.hidden_size, self.moe
        if not self.sparse(layer):
            return 3 * h * self.intermediate_size
        experts = moe.num_experts if all_experts else moe.top_k if experts_read is None else experts_read[layer]
        shared = 3 * h * moe.shared_expert_intermediate_size + h if moe.shared_expert_intermediate_size else 0
        return moe.num_experts * h + experts * 3 * h * moe.expert_intermediate_size + shared

    def to_dict(self) -> dict:
        """The spec's fields; RopeSpec.adjacent_pairs only where set, so that every other spec's spec.json (part of its
        build's digest) is what it was before that field, and its cached builds and random weights stay valid."""
        out = dataclasses.asdict(self)
        for rope in (out["rope"], out["local_rope"]):
            if rope is not None and not rope["adjacent_pairs"]:
                del rope["adjacent_pairs"]
        return out

    def digest(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def with_name(self, name: str) -> "ModelSpec":
        return dataclasses.replace(self, name=name)


def bundled_names() -> list[str]:
    return list(BUNDLED)


def _bundled_path(filename: str) -> Path:
    return Path(str(resources.files("mkport.kernel") / "model_specs" / filename))


def safe_name(raw: str) -> str:
    """A spec name from a folder or file name, safe in a path and in a rendered source comment: letters,
    digits, '.', '_' and '-' only (each run of other characters becomes one '_'), no '..', not starting with
    '.' or '-', at most MAX_BASE_NAME characters; 'model' when nothing is left."""
    name = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", raw)).lstrip(".-")
    return name[:MAX_BASE_NAME] or "model"


def read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MkportError(f"no such file or folder: {path}") from None
    except IsADirectoryError:
        raise MkportError(f"{path} is a folder, not a config file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MkportError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise MkportError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise MkportError(f"{path} is not a config: its JSON is a {type(data).__name__}, not an object")
    return data


@dataclass(frozen=True)
class ModelSource:
    """MODEL, resolved once per command: the raw config (for the reference, which must not read it through
    ModelSpec), where it came from, and the spec derived from it."""

    config: dict
    base_name: str  # the folder's or file's name, made safe; the bundled name for a bundled spec
    part: str | None  # the Qwen3-TTS decoder, or None
    path: Path | None  # the config.json read; None for a bundled spec
    spec: ModelSpec

    @classmethod
    def of(cls, config: dict, base_name: str, part: str | None = None, path: Path | None = None) -> "ModelSource":
        # a bundled name already names its part; a folder's gets it appended
        name = base_name if path is None or part is None else f"{base_name}-{part.replace('_', '-')}"
        try:
            spec = spec_from_config(config, name=name, part=part)
        except MkportError as e:
            raise MkportError(f"{path}: {e}" if path else str(e)) from None
        return cls(config, base_name, part, path, spec)

    def with_part(self, part: str) -> "ModelSource":
        """The other decoder of the same Qwen3-TTS config, without reading it again."""
        return ModelSource.of(self.config, self.base_name, part, self.path)


def open_model(model: str) -> ModelSource:
    """MODEL is a bundled spec name, a config.json path or a local model folder; a Qwen3-TTS config takes
    the part after a colon: `folder:talker` or `folder:code_predictor`."""
    if not model.strip():  # Path("") is the working folder
        raise MkportError("MODEL is empty: give a bundled spec name (mkport specs), a config.json path or a model "
                          "folder")
    if model in BUNDLED:
        filename, part = BUNDLED[model]
        return ModelSource.of(read_config(_bundled_path(filename)), model, part)
    path_str, part = model, None
    if ":" in model and model.rsplit(":", 1)[1] in TTS_PARTS:
        path_str, part = model.rsplit(":", 1)
    path = Path(path_str).expanduser()
    if not path.exists():
        folder, _, other = path_str.rpartition(":")
        if folder and Path(folder).expanduser().exists():  # a part that is not one
            raise MkportError(f"{model}: model part '{other}' is not supported; supported: {', '.join(TTS_PARTS)} "
                              "(of a Qwen3-TTS folder)")
        if os.sep not in path_str and not path_str.endswith(".json"):
            raise MkportError(
                f"unknown model '{model}': not a bundled spec ({', '.join(BUNDLED)}), and no such file or folder"
            )
        raise MkportError(f"no such file or folder: {path_str}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MkportError(f"{path_str} has no config.json")
        path = path / "config.json"
    resolved = path.resolve()
    base = resolved.parent.name if resolved.name == "config.json" else resolved.stem
    return ModelSource.of(read_config(path), safe_name(base), part, path)


def load_spec(model: str) -> ModelSpec:
    return open_model(model).spec


# model_type -> family. mistral and ministral are the llama shape with sliding windows; granite adds its four
# multipliers; smollm3 its NoPE layers; phi3 fuses q/k/v and gate/up in its checkpoints (split at load).
LLM_FAMILIES = {"qwen3": "qwen3", "qwen3_vl_text": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "mistral",
                "ministral": "mistral", "granite": "granite", "smollm3": "smollm3", "phi3": "phi3",
                "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "olmoe": "olmoe", "mixtral": "mixtral",
                "granitemoe": "granitemoe", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
                "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "olmo2": "olmo2", "olmo3": "olmo3",
                "ernie4_5": "ernie4_5", "helium": "helium", "seed_oss": "seed_oss", "exaone4": "exaone4", "glm": "glm",
                "glm4": "glm4", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}
GEMMA_MODEL_TYPES = tuple(t for t, family in LLM_FAMILIES.items() if family in GEMMA_FAMILIES)
# The mixture-of-experts families' config fields, and their defaults where a config leaves one out (each family's
# transformers config class): the expert count's key, experts a token, the expert width's key (olmoe and mixtral
# have no dense layers: intermediate_size is the expert's), norm_topk_prob (mixtral: always renormalised), and the
# shared expert's shared_expert_intermediate_size (families without one: absent).
MOE_FIELDS = {
    "qwen3_moe": {"experts": ("num_experts", 128), "top_k": 8, "width": ("moe_intermediate_size", 768), "norm": False},
    "qwen2_moe": {"experts": ("num_experts", 60), "top_k": 4, "width": ("moe_intermediate_size", 1408), "norm": False,
                  "shared": 5632},
    "olmoe": {"experts": ("num_experts", 64), "top_k": 8, "width": ("intermediate_size", None), "norm": False},
    "mixtral": {"experts": ("num_local_experts", 8), "top_k": 2, "width": ("intermediate_size", None), "norm": None},
    # GraniteMoeTopKRouter: softmax over the top k logits, which is the renormalised softmax of every logit
    "granitemoe": {"experts": ("num_local_experts", 8), "top_k": 2, "width": ("intermediate_size", None), "norm": None},
    # Qwen3.5's router always renormalises (it has no norm_topk_prob), and every layer has qwen2_moe's shared expert
    "qwen3_5_moe": {"experts": ("num_experts", 256), "top_k": 8, "width": ("moe_intermediate_size", 512), "norm": None,
                    "shared": 512},
}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# tie_word_embeddings when a config leaves it out, as each family's transformers config class defaults it
TIE_DEFAULT = {"smollm3": True, "gemma": True, "gemma2": True, "gemma3": True}
# rms_norm_eps when a config leaves it out, where the family's config class does not default it to 1e-6
RMS_EPS_DEFAULT = {"olmo2": 1e-5, "olmo3": 1e-5}
# Families of today's popular checkpoints that need a feature mkport does not build yet: the first one that blocks
# each (the field, or the weights, that carry it).
UNBUILT_FAMILY_FEATURES = {
    # Qwen3.5's layers, but the Gated DeltaNet's q/k/v/z and b/a rows interleaved a key head at a time in two matrices
    "qwen3_next": "its fused Gated DeltaNet projections (in_proj_qkvz, in_proj_ba)",
}
# The Qwen-VL wrappers' text decoders, whose references are transformers' text models (check.reference); Qwen2-VL's
# and Qwen2.5-VL's released configs are flat (the decoder's fields at the top, beside vision_config), later ones
# written by transformers 5 have a text_config
VL_TEXT_TYPES = {"qwen3_vl": "qwen3_vl_text", "qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}
# A multimodal wrapper's text decoder type, where its text_config may leave model_type out
WRAPPED_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text",
                      "mistral3": "mistral"}
HYBRID_MODEL_TYPES = tuple(t for t, family in LLM_FAMILIES.items() if family in HYBRID_FAMILIES)
# Fields a family's config class defaults where mkport's reading would require them or default them otherwise: the
# released multimodal Gemma 3 configs' text_config lists only what differs from Gemma3TextConfig's defaults; RoPE
# theta where the class's default_theta is not 10000 (a null head_dim stays null: hidden_size / heads, as theirs)
CLASS_DEFAULTS = {"gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                  "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                                  "max_position_embeddings": 131072},
                  "ernie4_5": {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                               "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                               "rope_theta": 500000.0},
                  "helium": {"num_attention_heads": 20, "num_key_value_heads": 20, "head_dim": 128,
                             "rms_norm_eps": 1e-8, "rope_theta": 100000.0},
                  "seed_oss": {"attention_bias": True, "num_attention_heads": 80, "num_key_value_heads": 8,
                               "head_dim": 128, "max_position_embeddings": 524288},
                  "exaone4": {"num_key_value_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                              "sliding_window": 4096, "sliding_window_pattern": 4},
                  **{glm: {"attention_bias": True, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                           "max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-07} for glm in ("glm", "glm4")},
                  "mixtral": {"rope_theta": 1e6}, "smollm3": {"rope_theta": 2e6}, "qwen3_vl_text": {"rope_theta": 5e5},
                  **{vl: {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                          "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                          "rms_norm_eps": 1e-5, "rope_theta": 1e6} for vl in ("qwen2_vl_text", "qwen2_5_vl_text")}}
# Config fields that carry a feature mkport does not build, whatever the model_type.
UNBUILT_FIELDS = (
    ("kv_lora_rank", "multi-head latent attention (MLA)"),
    ("hidden_size_per_layer_input", "per-layer inputs"),
)


def spec_from_config(config: dict, name: str, part: str | None = None) -> ModelSpec:
    model_type = config.get("model_type", "")
    if model_type == "qwen3_tts":
        return _tts_spec(config, name, part)
    if part is not None:
        raise MkportError(f"model part '{part}' given, but model_type '{model_type}' is not qwen3_tts")
    if model_type in UNBUILT_FAMILY_FEATURES:
        raise MkportError(f"model_type '{model_type}': {UNBUILT_FAMILY_FEATURES[model_type]} is not supported")
    if WRAPPED_TEXT_TYPES.get(model_type) in HYBRID_MODEL_TYPES and "text_config" not in config:
        raise MkportError(f"model_type '{model_type}': its decoder is read from text_config, which this config lacks")
    if "text_config" in config:  # the Qwen-VL, Qwen3.5 and Gemma 3 multimodal wrappers: the text decoder
        text = dict(_dict_field(config, "text_config"))
        # Gemma3Config ties the head to the embeddings by default, the others do not
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", model_type == "gemma3"))
        wrapped = {**WRAPPED_TEXT_TYPES, **VL_TEXT_TYPES}
        if model_type in wrapped:  # the wrapper's text_config is of this type when it does not say
            text.setdefault("model_type", wrapped[model_type])
        return spec_from_config(text, name)
    if model_type in VL_TEXT_TYPES:  # a flat Qwen2-VL / Qwen2.5-VL config: the decoder's fields beside vision_config
        text = {k: v for k, v in config.items() if k != "vision_config"}
        return spec_from_config({**text, "model_type": VL_TEXT_TYPES[model_type]}, name)
    config = {**CLASS_DEFAULTS.get(model_type, {}), **config}
    moe_key = next((k for k in MOE_KEYS if config.get(k)), None)
    if moe_key and LLM_FAMILIES.get(model_type) not in MOE_FIELDS:  # DeepSeek's n_routed_experts among them
        raise MkportError(f"{moe_key}={config[moe_key]}: mixture of experts is supported for model_type "
                          f"{', '.join(MOE_FIELDS)}, not '{model_type}'")
    _refuse_unbuilt_features(config)
    if model_type not in LLM_FAMILIES:
        raise MkportError(
            f"model_type '{model_type}' is not supported; supported: "
            f"{', '.join(t for t in LLM_FAMILIES if t not in (*VL_TEXT_TYPES.values(), *HYBRID_MODEL_TYPES))}, "
            "qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe and gemma3 (text decoder), qwen3_5_text, qwen3_5_moe_text, "
            "qwen3_tts (talker, code_predictor)"
        )
    return _decoder_spec(
        config, name, family=LLM_FAMILIES[model_type], role="llm", input_mode="token", output_mode="logits"
    )


def _refuse_unbuilt_features(config: dict) -> None:
    """One line naming the field and the feature, for a feature no family here has."""
    for key, feature in UNBUILT_FIELDS:
        if config.get(key):
            raise MkportError(f"{key}={config[key]}: {feature} is not supported")
    layer_types = config.get("layer_types") or []
    hybrid = config.get("model_type") in HYBRID_MODEL_TYPES
    if isinstance(layer_types, list) and "linear_attention" in layer_types and not hybrid:
        raise MkportError("layer_types contains 'linear_attention': hybrid linear-attention layers are not supported")


def _tts_spec(config: dict, name: str, part: str | None) -> ModelSpec:
    if part is None:
        raise MkportError(
            f"'{name}' is a Qwen3-TTS config: name the decoder as MODEL:talker or MODEL:code_predictor"
        )
    talker = _dict_field(config, "talker_config")
    if part == "talker":
        cfg = dict(talker, tie_word_embeddings=False)
        return _decoder_spec(
            cfg, name, family="qwen3", role="tts_talker", input_mode="embedding", output_mode="logits"
        )
    predictor = _dict_field(talker, "code_predictor_config")
    groups = _optional_int(predictor, "num_code_groups", _optional_int(talker, "num_code_groups", 16))
    if groups < 2:
        raise MkportError(f"num_code_groups={groups}: the code predictor needs at least 2 code groups")
    cfg = dict(predictor, tie_word_embeddings=False)
    return _decoder_spec(
        cfg,
        name,
        family="qwen3",
        role="tts_code_predictor",
        input_mode="embedding",
        output_mode="logits",
        num_tables=groups - 1,
        num_heads_out=groups - 1,
        input_dim=_require_int(talker, "hidden_size"),
    )


def _as_int(key: str, value) -> int:
    """A positive integer config value; an integral float such as 128.0 (some exporters write them) is
    taken as the integer."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MkportError(f"config field '{key}' must be a positive integer, got {value!r}")
    return value


def _require_int(config: dict, key: str) -> int:
    return _as_int(key, config.get(key))


def _optional_int(config: dict, key: str, default: int) -> int:
    value = config.get(key)
    return default if value is None else _as_int(key, value)


def _optional_float(config: dict, key: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise MkportError(f"config field '{key}' must be a positive number, got {value!r}")
    return float(value)


def _optional_bool(config: dict, key: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):  # bool("false") is True: a string here is refused, not guessed
        raise MkportError(f"config field '{key}' must be true or false, got {value!r}"[:200])
    return value


def _dict_field(config: dict, key: str) -> dict:
    value = config.get(key)
    if not isinstance(value, dict):
        raise MkportError(f"config field '{key}' must be an object, got {value!r}"[:200])
    return value


def _rope(config: dict) -> RopeSpec:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise MkportError(f"config field 'rope_parameters' / 'rope_scaling' must be an object, got {params!r}"[:200])
    theta = _optional_float(params, "rope_theta", _optional_float(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    section = params.get("mrope_section")
    if section:
        if rope_type not in ("default", "mrope"):  # Qwen2-VL configs spell it type "mrope"
            raise MkportError(f"rope_type '{rope_type}' with mrope_section is not supported; supported: default")
        # Qwen3-VL and Qwen3.5 always interleave (transformers ignores the flag); Qwen2-VL's sections are contiguous
        always = config.get("model_type") in ("qwen3_vl_text", *HYBRID_MODEL_TYPES)
        interleaved = always or bool(params.get("interleaved", params.get("mrope_interleaved", False)))
        if not isinstance(section, list):
            raise MkportError(f"config field 'mrope_section' must be a list of integers, got {section!r}")
        section = tuple(_as_int("mrope_section", s) for s in section)
        return RopeSpec(theta, "mrope", mrope_section=section, mrope_interleaved=interleaved)
    def need(key: str) -> float:
        value = params.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise MkportError(f"rope_type '{rope_type}' needs a positive number '{key}', got {value!r}")
        return value

    if rope_type == "default":
        return RopeSpec(theta, "standard")
    if rope_type == "linear":
        return RopeSpec(theta, "linear", factor=float(need("factor")))
    if rope_type == "llama3":
        low, high = float(need("low_freq_factor")), float(need("high_freq_factor"))
        if high <= low:
            raise MkportError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high} and {low}")
        return RopeSpec(
            theta,
            "llama3",
            factor=float(need("factor")),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position=_as_int("original_max_position_embeddings", need("original_max_position_embeddings")),
        )
    if rope_type in ("yarn", "longrope", "dynamic"):
        return _scaled_rope(config, params, rope_type, theta, need)
    raise MkportError(f"rope_type '{rope_type}' is not supported; supported: default, linear, llama3, mrope, yarn, "
                      "dynamic, longrope")


def _scaled_rope(config: dict, params: dict, rope_type: str, theta: float, need) -> RopeSpec:
    """yarn, dynamic and longrope, with the defaults transformers 5's standardize_rope_params and rope init functions
    fill in: original_max_position_embeddings from the top level (Phi-3 keeps it there; phi3's default 4096), else
    rope_parameters, else max_position_embeddings; longrope's missing factor is max / original; the attention
    factor from the factor (and yarn's mscale / mscale_all_dim) unless given."""
    max_position = _optional_int(config, "max_position_embeddings", 4096)
    if rope_type == "dynamic":
        return RopeSpec(theta, "dynamic", factor=float(need("factor")), original_max_position=max_position)
    default_original = 4096 if config.get("model_type") == "phi3" else None
    original = config.get("original_max_position_embeddings", default_original)
    if original is None:
        original = params.get("original_max_position_embeddings", max_position)
    original = _as_int("original_max_position_embeddings", original)
    # transformers' config refuses a yarn without factor; longrope's defaults to max / original (Phi-3 gives none)
    given_factor = rope_type == "yarn" or params.get("factor") is not None
    factor = float(need("factor")) if given_factor else max_position / original
    given = params.get("attention_factor")
    if given is not None and (not isinstance(given, (int, float)) or isinstance(given, bool) or given <= 0):
        raise MkportError(f"rope_type '{rope_type}' needs a positive number 'attention_factor', got {given!r}")
    if rope_type == "longrope":
        def factors(key: str) -> tuple[float, ...]:
            value = params.get(key)
            if not isinstance(value, list) or not all(isinstance(v, (int, float)) and v > 0 for v in value):
                raise MkportError(
                    f"rope_type 'longrope' needs '{key}': a list of positive numbers, got {value!r}"[:200])
            return tuple(float(v) for v in value)

        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeSpec(theta, "longrope", factor=factor, original_max_position=original,
                        attention_factor=float(given) if given is not None else scale,
                        long_factor=factors("long_factor"), short_factor=factors("short_factor"))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if given is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        given = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeSpec(theta, "yarn", factor=factor, original_max_position=original, attention_factor=float(given),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)))


def _check_supported(config: dict) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu" and config.get("model_type") not in GEMMA_MODEL_TYPES:  # Gemma's GeGLU: read by _gemma
        raise MkportError(f"hidden_act '{act}' is not supported; supported: silu")
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0)
    if partial not in (None, 1, 1.0) and config.get("model_type") not in (*HYBRID_MODEL_TYPES, *PARTIAL_ROPE_DEFAULTS):
        raise MkportError(f"partial_rotary_factor={partial}: partial rotary embeddings are not supported "
                          f"(supported for qwen3_5, qwen3_5_moe and {', '.join(PARTIAL_ROPE_DEFAULTS)})")
    if config.get("mlp_bias"):
        raise MkportError("mlp_bias=true is not supported; supported: MLP without bias")


def _layer_types(config: dict, layers: int) -> list[str] | None:
    layer_types = config.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise MkportError(f"config field 'layer_types' must be a list of {layers} layer types, got {layer_types!r}"[:200])
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise MkportError(f"layer_types has {other}: supported: full_attention, sliding_attention")
    return layer_types


def _attention_windows(config: dict, family: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), read the way the family's transformers classes read it."""
    if family in HYBRID_FAMILIES:  # its layer_types name linear and full attention layers (_hybrid), never a window
        return ()
    layer_types = _layer_types(config, layers)
    model_type = config.get("model_type")
    if family in ("gemma2", "gemma3", "olmo3"):
        # Without layer_types: Gemma2Config slides every other layer, Gemma3TextConfig all but every 6th, Olmo3Config
        # all but every 4th
        if layer_types is None:
            pattern = {"gemma2": 2, "olmo3": 4}.get(family) or _optional_int(config, "sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        window = _optional_int(config, "sliding_window", 4096)
        if "sliding_attention" in layer_types and "sliding_window" in config and config["sliding_window"] is None:
            raise MkportError("layer_types has sliding_attention layers but sliding_window is null")
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        return windows if any(windows) else ()
    if family == "exaone4":
        window = config.get("sliding_window")
        types = _exaone4_layer_types(config, layers)
        if "sliding_attention" in types and window is None:
            raise MkportError("layer_types has sliding_attention layers but sliding_window is null")
        windows = tuple(_as_int("sliding_window", window) if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else ()
    if family in ("phi3", "mixtral"):  # their models: the window on every layer when sliding_window is set (default none)
        window = _optional_int(config, "sliding_window", 0)
        return (window,) * layers if window else ()
    if family == "mistral":
        # MistralConfig and MinistralConfig default sliding_window to 4096 when the key is absent; null means none
        window = _optional_int(config, "sliding_window", 0) if "sliding_window" in config else 4096
        if model_type == "mistral" or layer_types is None:  # MistralModel applies the window to every layer
            return (window,) * layers if window else ()
        if "sliding_attention" in layer_types and not window:
            raise MkportError("layer_types has sliding_attention layers but sliding_window is null")
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        return windows if any(windows) else ()
    if family == "smollm3":
        window = _optional_int(config, "sliding_window", 0)
        use = _optional_bool(config, "use_sliding_window", False)
        if layer_types is None:  # SmolLM3Config: sliding on the NoPE layers when use_sliding_window and a window
            windows = tuple(window if use and i in _nope_layers(config, family, layers) else 0 for i in range(layers))
            return windows if any(windows) else ()
        if "sliding_attention" in layer_types and not (use and window):
            # transformers' eager mask would slide these layers while its flash attention would not: refused
            raise MkportError("layer_types has sliding_attention layers but use_sliding_window is false or "
                              "sliding_window is null: ambiguous in transformers, not supported")
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        return windows if any(windows) else ()
    if family == "olmoe" and config.get("sliding_window"):
        # OlmoeModel's mask is causal while its flash attention would slide: ambiguous in transformers
        raise MkportError(f"sliding_window={config['sliding_window']} is not supported for olmoe (transformers' "
                          "OLMoE masks without it but passes it to flash attention)")
    if _optional_bool(config, "use_sliding_window", False):
        raise MkportError(f"use_sliding_window=true: sliding-window attention is not supported for {family} "
                          "(supported: mistral, ministral, smollm3)")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise MkportError(f"layer_types has sliding_attention layers: sliding-window attention is not supported "
                          f"for {family} (supported: mistral, ministral, smollm3)")
    return ()


def _exaone4_layer_types(config: dict, layers: int) -> list[str]:
    """EXAONE 4's layer types as Exaone4Config reads them: layer_types, or from an integer sliding_window_pattern P
    every P-th layer full and the rest sliding (the class derives none from a null window or a pattern string)."""
    layer_types = _layer_types(config, layers)
    if layer_types is not None:
        return layer_types
    pattern = config.get("sliding_window_pattern")
    if config.get("sliding_window") is None or not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
        raise MkportError(f"exaone4 without layer_types needs a sliding_window and an integer sliding_window_pattern "
                          f"(Exaone4Config derives the layer types from them), got {config.get('sliding_window')!r} and "
                          f"{pattern!r}"[:200])
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _nope_layers(config: dict, family: str, layers: int) -> tuple[int, ...]:
    """Layers without RoPE: SmolLM3's no_rope_layers holds 1 for a layer that uses RoPE and 0 for one that does
    not; absent, every no_rope_layer_interval-th layer (the 4th, 8th, ...) has none. EXAONE 4's full layers have none
    where it has a sliding window (Exaone4Attention rotates only its sliding layers then)."""
    if family == "exaone4":
        if config.get("sliding_window") is None:
            return ()
        return tuple(i for i, t in enumerate(_exaone4_layer_types(config, layers)) if t == "full_attention")
    if family != "smollm3":
        if "no_rope_layers" in config:
            raise MkportError(f"no_rope_layers is not supported for {family}: layers without RoPE (NoPE) are "
                              "supported for smollm3")
        return ()
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = _optional_int(config, "no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise MkportError(f"config field 'no_rope_layers' must be a list of {layers} flags 0 or 1, got {flags!r}"[:200])
    return tuple(i for i, f in enumerate(flags) if not f)


def _hybrid(config: dict, family: str, layers: int, head_dim: int) -> dict:
    """Qwen3.5's fields as ModelSpec fields, with Qwen3_5TextConfig's defaults: layer_types (or every
    full_attention_interval-th layer full, 4 by default), the Gated DeltaNet shape, the rotated part of a head
    (partial_rotary_factor, 0.25 by default), (1 + w) RMSNorms, and the attention output gate."""
    if family not in HYBRID_FAMILIES:
        return {}
    layer_types = config.get("layer_types")
    if layer_types is None:
        interval = _optional_int(config, "full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise MkportError(f"config field 'layer_types' must be a list of {layers} layer types, got {layer_types!r}"[:200])
    other = sorted({str(t) for t in layer_types if t not in ("full_attention", "linear_attention")})
    if other:
        raise MkportError(f"layer_types has {other}: supported for {family}: linear_attention, full_attention")
    linear = LinearAttentionSpec(
        num_key_heads=_optional_int(config, "linear_num_key_heads", 16),
        num_value_heads=_optional_int(config, "linear_num_value_heads", 32),
        key_head_dim=_optional_int(config, "linear_key_head_dim", 128),
        value_head_dim=_optional_int(config, "linear_value_head_dim", 128),
        conv_kernel=_optional_int(config, "linear_conv_kernel_dim", 4),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise MkportError(f"linear_num_key_heads={linear.num_key_heads} must divide "
                          f"linear_num_value_heads={linear.num_value_heads}")
    if linear.conv_kernel < 2:
        raise MkportError(f"linear_conv_kernel_dim={linear.conv_kernel} is not supported; supported: 2 or more")
    if not _optional_bool(config, "attn_output_gate", True):  # Qwen3_5Attention always gates: no reference without
        raise MkportError(f"attn_output_gate=false is not supported for {family} (transformers' Qwen3.5 attention "
                          "always gates its output)")
    return {"linear_layers": tuple(i for i, t in enumerate(layer_types) if t == "linear_attention"),
            "linear_attention": linear, "rotary_dim": _rotary_dim(config, head_dim, 0.25), "norm_weight_offset": 1.0,
            "attn_output_gate": True}


def _rotary_dim(config: dict, head_dim: int, default: float) -> int:
    """The dimensions of a head RoPE rotates: partial_rotary_factor (in rope_parameters or at the top) of head_dim,
    truncated as transformers' rope init does (qwen3_5: 0.25 by default; Phi-4-mini's phi3: 0.75)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", default))
    if factor is None:
        factor = default
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise MkportError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise MkportError(f"partial_rotary_factor={factor} rotates {rotary} of head_dim {head_dim}: "
                          "it must rotate an even number of dimensions, at least 2")
    return rotary


def _gemma(config: dict, family: str) -> dict:
    """Gemma's fields as ModelSpec fields, read as its transformers config classes read them: (1 + w) RMSNorms,
    embeddings times sqrt(hidden_size), the GeGLU MLP (gemma: hidden_act, where the legacy 'gelu' means the tanh
    form; gemma2/3: hidden_activation); gemma2/3 add the sandwich norms, the attention scale
    query_pre_attn_scalar^-0.5 and the soft-caps (gemma2 defaults 50 and 30, gemma3 none; null: none); gemma3 its
    q/k norms (in _decoder_spec) and the sliding layers' own RoPE."""
    if family not in GEMMA_FAMILIES:
        return {}
    key = "hidden_act" if family == "gemma" else "hidden_activation"
    act = config.get(key) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh" and (family, act) != ("gemma", "gelu"):  # GemmaConfig turns 'gelu' into the tanh form
        raise MkportError(f"{key} '{act}' is not supported for {family}; supported: gelu_pytorch_tanh")
    if _optional_bool(config, "use_bidirectional_attention", False):
        raise MkportError("use_bidirectional_attention=true is not supported; supported: causal attention")
    fields = {"norm_weight_offset": 1.0, "mlp_activation": "gelu_tanh",
              "embedding_multiplier": math.sqrt(_require_int(config, "hidden_size"))}
    if family == "gemma":
        return fields
    gemma2 = family == "gemma2"
    fields.update(
        sandwich_norms=True,
        attention_multiplier=_optional_float(config, "query_pre_attn_scalar", 256.0) ** -0.5,
        attn_logit_softcap=_softcap(config, "attn_logit_softcapping", 50.0 if gemma2 else 0.0),
        final_logit_softcap=_softcap(config, "final_logit_softcapping", 30.0 if gemma2 else 0.0),
    )
    if family == "gemma3":
        fields["rope"], fields["local_rope"] = _gemma3_ropes(config)
    return fields


def _softcap(config: dict, key: str, default: float) -> float:
    """A soft-cap: the config's value, the class default when the key is absent, none (0) when it is null."""
    return _optional_float(config, key, 0.0) if key in config else default


def _layer_type_rope(config: dict, theta: float, own: dict) -> RopeSpec:
    """One layer type's RoPE from its rope_parameters; max_position_embeddings beside them for yarn, dynamic and
    longrope (transformers' default original length and dynamic NTK's reference length)."""
    positions = {k: config[k] for k in ("max_position_embeddings",) if k in config}
    return _rope({**positions, "rope_parameters": {"rope_theta": theta, **own}})


def _gemma3_ropes(config: dict) -> tuple[RopeSpec, RopeSpec]:
    """Gemma 3's full and sliding layers' RoPE, as Gemma3TextConfig reads them: rope_parameters per layer type
    (transformers 5), or rope_theta (default 1e6) with rope_scaling for the full layers and rope_local_base_freq
    (default 1e4, unscaled) for the sliding ones."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        def of(layer_type: str, theta: float) -> RopeSpec:
            own = params.get(layer_type) or {}
            return _layer_type_rope(config, theta, own)

        return of("full_attention", 1e6), of("sliding_attention", 1e4)
    full = _rope({**config, "rope_theta": _optional_float(config, "rope_theta", 1e6)})
    return full, RopeSpec(_optional_float(config, "rope_local_base_freq", 1e4), "standard")


def _post_norm(config: dict, family: str) -> dict:
    """OLMo 2/3's and EXAONE 4's fields as ModelSpec fields: post-norm layers; olmo3's sliding layers' own RoPE."""
    if family not in POST_NORM_FAMILIES:
        return {}
    if family in ("olmo2", "exaone4"):
        return {"pre_norms": False}
    rope, local = _olmo3_ropes(config)
    return {"pre_norms": False, "rope": rope, "local_rope": None if local == rope else local}


def _olmo3_ropes(config: dict) -> tuple[RopeSpec, RopeSpec]:
    """OLMo 3's full and sliding layers' RoPE, as Olmo3Config reads them: rope_parameters per layer type (transformers
    5), each theta defaulting to rope_theta (500000); or rope_theta with rope_scaling for the full layers only."""
    theta = _optional_float(config, "rope_theta", 5e5)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        return tuple(_layer_type_rope(config, theta, params.get(t) or {})
                     for t in ("full_attention", "sliding_attention"))
    if params:  # Olmo3Config would take it for the full layers only, its keys unchecked: ambiguous
        raise MkportError("rope_parameters for olmo3 must be given per layer type (full_attention, sliding_attention)")
    return _rope({**config, "rope_theta": theta}), RopeSpec(theta, "standard")


def _granite_multipliers(config: dict, family: str) -> dict:
    """Granite's four scalars as ModelSpec fields; GraniteConfig defaults each to 1 (attention_multiplier too: 1,
    not head_dim^-0.5)."""
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    if family not in GRANITE_FAMILIES:
        present = [k for k in keys if k in config]
        if present:
            raise MkportError(f"{present[0]} is not supported for {family}: the granite multipliers are supported "
                              "for model_type granite and granitemoe")
        return {}
    return {k: _optional_float(config, k, 1.0) for k in keys}


def _moe_spec(config: dict, family: str, layers: int) -> MoeSpec | None:
    """The experts of a mixture-of-experts family, read as its transformers classes read them (MOE_FIELDS)."""
    if family not in MOE_FIELDS:
        return None
    fields = MOE_FIELDS[family]
    key, default = fields["experts"]
    experts = _optional_int(config, key, default)
    top_k = _optional_int(config, "num_experts_per_tok", fields["top_k"])
    if top_k > experts:
        raise MkportError(f"num_experts_per_tok={top_k} must be at most the {experts} experts ({key})")
    width_key, width_default = fields["width"]
    width = _require_int(config, width_key) if width_default is None else _optional_int(config, width_key, width_default)
    norm = True if fields["norm"] is None else _optional_bool(config, "norm_topk_prob", fields["norm"])
    shared = _optional_int(config, "shared_expert_intermediate_size", fields["shared"]) if "shared" in fields else 0
    for what, value in ((width_key, width), ("shared_expert_intermediate_size", shared)):
        if value % 8:
            raise MkportError(f"{what}={value} is not supported; it must be a multiple of 8 (16-byte weight rows)")
    sparse = tuple(range(layers))
    if family in ("qwen3_moe", "qwen2_moe"):  # dense layers: mlp_only_layers, and those off decoder_sparse_step
        step = _optional_int(config, "decoder_sparse_step", 1)
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
            raise MkportError(f"config field 'mlp_only_layers' must be a list of layer indices, got {dense!r}"[:200])
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    elif config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise MkportError(f"mlp_only_layers / decoder_sparse_step are not supported for {family}: every {family} "
                          "layer is sparse in transformers")
    return MoeSpec(experts, top_k, width, norm, sparse, shared)


def _decoder_spec(
    config: dict,
    name: str,
    family: str,
    role: str,
    input_mode: str,
    output_mode: str,
    num_tables: int = 1,
    num_heads_out: int = 1,
    input_dim: int | None = None,
) -> ModelSpec:
    _check_supported(config)
    hidden = _require_int(config, "hidden_size")
    layers = _require_int(config, "num_hidden_layers")
    if layers > MAX_LAYERS:
        raise MkportError(f"num_hidden_layers={layers} is not supported; supported: 1 to {MAX_LAYERS}")
    heads = _require_int(config, "num_attention_heads")
    kv_heads = _optional_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise MkportError(
            f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
        )
    if heads // kv_heads > MAX_GQA_RATIO:
        raise MkportError(
            f"GQA ratio {heads // kv_heads} (num_attention_heads/num_key_value_heads) is not supported; "
            f"supported: 1 to {MAX_GQA_RATIO}"
        )
    # Qwen3_5TextConfig's and Gemma's config classes default head_dim to 256
    head_dim = _optional_int(config, "head_dim", 256 if family in (*HYBRID_FAMILIES, *GEMMA_FAMILIES) else hidden // heads)
    # Phi-3/3.5-mini's 96 runs on the plain-torch path only (check_kernel_support refuses it for the megakernel)
    if head_dim not in HEAD_DIMS and not (family == "phi3" and head_dim == 96):
        raise MkportError(f"head_dim={head_dim} is not supported; supported: {', '.join(map(str, HEAD_DIMS))}")
    sizes = {"hidden_size": hidden}
    if family == "qwen3_5_moe" and "intermediate_size" not in config:  # no dense MLP: its configs have none
        intermediate = _optional_int(config, "moe_intermediate_size", MOE_FIELDS[family]["width"][1])
    else:
        intermediate = sizes["intermediate_size"] = _require_int(config, "intermediate_size")
    for key, value in sizes.items():
        if value % 8:
            raise MkportError(f"{key}={value} is not supported; it must be a multiple of 8 (16-byte weight rows)")
    if family == "helium" and head_dim * heads != hidden:  # HeliumAttention sizes o_proj hidden_size x hidden_size
        raise MkportError(f"head_dim={head_dim} with {heads} heads is not hidden_size={hidden}: helium's o_proj needs "
                          "heads * head_dim = hidden_size")
    if family == "olmoe":  # (olmo2/3 size their q/k norms by heads * head_dim: any head_dim works there)
        if head_dim * heads != hidden:  # OlmoeAttention sizes q_norm by hidden_size
            raise MkportError(f"head_dim={head_dim} with {heads} heads is not hidden_size={hidden}: olmoe's q/k norm "
                              "needs heads * head_dim = hidden_size")
        if config.get("clip_qkv") is not None:
            raise MkportError(f"clip_qkv={config['clip_qkv']}: clipping q/k/v is not supported")
    attention_bias = _optional_bool(config, "attention_bias", False)
    if attention_bias and family not in QKV_BIAS_FAMILIES:  # their o_proj has no bias whatever the flag
        raise MkportError(f"attention_bias=true is not supported for {family}; supported: q/k/v bias of "
                          f"{', '.join(QKV_BIAS_FAMILIES)}")
    if family == "seed_oss" and _optional_bool(config, "attention_out_bias", False):
        raise MkportError("attention_out_bias=true is not supported (a bias on o_proj); supported: o_proj without bias")
    if family == "ernie4_5" and _optional_bool(config, "use_bias", False):
        raise MkportError("use_bias=true is not supported for ernie4_5 (a bias on every linear layer); supported: "
                          "linear layers without bias")
    layer_fields = {**_gemma(config, family), **_post_norm(config, family)}
    if family == "glm4":  # Gemma 2's four norms a layer, with weights w rather than 1 + w
        layer_fields["sandwich_norms"] = True
    rope = layer_fields.pop("rope", None) or _rope(config)
    if family in ADJACENT_PAIR_FAMILIES:
        rope = dataclasses.replace(rope, adjacent_pairs=True)
    hybrid = _hybrid(config, family, layers, head_dim)
    if family in PARTIAL_ROPE_DEFAULTS:  # Phi-4-mini rotates 3/4 of each head, GLM half
        rotary = _rotary_dim(config, head_dim, PARTIAL_ROPE_DEFAULTS[family])
        if rotary != head_dim:
            hybrid["rotary_dim"] = rotary
    rotated = hybrid.get("rotary_dim", head_dim)
    if rope.variant == "mrope" and sum(rope.mrope_section) != rotated // 2:
        what = "head_dim/2" if rotated == head_dim else "the rotated dimensions/2"
        raise MkportError(
            f"mrope_section {list(rope.mrope_section)} must sum to {what} = {rotated // 2}"
        )
    if rope.variant == "longrope" and {len(rope.long_factor), len(rope.short_factor)} != {rotated // 2}:
        what = "head_dim/2" if rotated == head_dim else "the rotated dimensions/2"
        raise MkportError(f"longrope's long_factor and short_factor must have {what} = {rotated // 2} entries, got "
                          f"{len(rope.long_factor)} and {len(rope.short_factor)}")
    spec = ModelSpec(
        name=name,
        family=family,
        role=role,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_require_int(config, "vocab_size"),
        rms_eps=_optional_float(config, "rms_norm_eps", RMS_EPS_DEFAULT.get(family, 1e-6)),
        rope=rope,
        max_position=_optional_int(config, "max_position_embeddings", 4096),
        tie_embeddings=_optional_bool(config, "tie_word_embeddings", TIE_DEFAULT.get(family, False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "olmoe", *HYBRID_FAMILIES, "gemma3", *POST_NORM_FAMILIES),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and _optional_bool(config, "qkv_bias", True))
        or (family in QKV_BIAS_FAMILIES and attention_bias),
        input_mode=input_mode,
        output_mode=output_mode,
        num_embedding_tables=num_tables,
        num_output_heads=num_heads_out,
        input_dim=input_dim or hidden,
        attention_windows=_attention_windows(config, family, layers),
        nope_layers=_nope_layers(config, family, layers),
        **_granite_multipliers(config, family),
        qk_norm_span="projection" if family in ("olmoe", "olmo2", "olmo3") else "head",
        moe=_moe_spec(config, family, layers),
        **hybrid,
        **layer_fields,
    )
    if spec.input_dim % 8:
        raise MkportError(f"input width {spec.input_dim} must be a multiple of 8")
    return spec
