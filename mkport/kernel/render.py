"""Renders the decode-step sources of a (ModelSpec, LaunchPlan) into generated/<name>-<digest>/.

The same inputs give byte-identical output. The layouts shared with the host (the Params struct, the
per-layer weight table, the trace buffer) are defined once here and rendered into the sources.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2
import numpy as np

from .cache import write_atomic
from ..errors import MkportError
from .spec import ModelSpec
from .launch_plan import (
    MMA_PART_FLOATS, SAMPLE_CANDIDATES, LaunchPlan, attention_layout, sample_layout, vectors_layout,
)

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
)

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
    ("trace", "float*"),
    ("profile", "long long*"),  # clock64 at each grid barrier of block 0, with -DMK_PROFILE=1
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
)
# Fields with one value per sequence of a batch (arrays of plan.batch in the kernel's Params).
SEQUENCE_FIELDS = ("input_kind", "table", "head", "cache_pos", "pos_t", "pos_h", "pos_w", "attn_splits", "top_k", "seed",
                   "rng_step", "temperature", "top_p", "rep_penalty")


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

    @staticmethod
    def layer(index: int, op: str) -> str:
        return f"layers.{index}.{op}"


SAMPLE_MAX_K = 1024  # top-k the sampler serves; the rest of SAMPLE_CANDIDATES holds ties

TEMPLATES = (
    ("common.cuh.j2", "common.cuh"),
    ("grid_sync.cuh.j2", "grid_sync.cuh"),
    ("rmsnorm.cuh.j2", "rmsnorm.cuh"),
    ("mma_matvec.cuh.j2", "mma_matvec.cuh"),
    ("matvec.cuh.j2", "matvec.cuh"),
    ("rope.cuh.j2", "rope.cuh"),
    ("embed.cuh.j2", "embed.cuh"),
    ("qkv.cuh.j2", "qkv.cuh"),
    ("attention.cuh.j2", "attention.cuh"),
    ("prefill.cuh.j2", "prefill.cuh"),
    ("mlp.cuh.j2", "mlp.cuh"),
    ("lm_head.cuh.j2", "lm_head.cuh"),
    ("sample.cuh.j2", "sample.cuh"),
    ("decode_step.cu.j2", "decode_step.cu"),
)


def trace_layer_fields(spec: ModelSpec) -> dict[str, int]:
    """Per-layer trace slots (Tap.LAYER) and their widths, in buffer order."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    widths = {Tap.ATTN_NORM: h, Tap.Q: q, Tap.K: kv, Tap.ATTN: q, Tap.ATTN_RESIDUAL: h, Tap.MLP_RESIDUAL: h}
    return {op: widths[op] for op in Tap.LAYER}


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


def rope_tables(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """inv_freq (float32, as the reference computes it) and, for MRoPE, the position stream of each frequency."""
    rope, dim = spec.rope, spec.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.variant == "linear":
        inv_freq = (inv_freq / np.float32(rope.factor)).astype(np.float32)
    elif rope.variant == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    stream = np.zeros(dim // 2, dtype=np.int64)
    if rope.variant == "mrope":
        section = rope.mrope_section
        if rope.mrope_interleaved:
            for s in (1, 2):
                stream[s : section[s] * 3 : 3] = s
        else:
            bounds = np.cumsum(section)
            for s in range(len(section)):
                stream[(bounds[s - 1] if s else 0) : bounds[s]] = s
    return inv_freq, stream


def _float_literal(value: float) -> str:
    return f"{float(np.float32(value)).hex()}f"


def _context(spec: ModelSpec, plan: LaunchPlan) -> dict:
    inv_freq, stream = rope_tables(spec)
    trace = TraceLayout.of(spec)
    return {
        "spec": spec,
        "plan": plan,
        "spec_digest": spec.digest(),
        "c": {
            "eps": _float_literal(spec.rms_eps),
            "attn_scale": _float_literal(spec.head_dim**-0.5),
            "rope_inv_freq": [_float_literal(f) for f in inv_freq],
            "rope_stream": [int(s) for s in stream],
            "trace_layer0": trace.layer0,
            "trace_layer_offsets": trace.layer_offsets,
            "trace_layer_stride": trace.layer_stride,
            "trace_final_offset": trace.final,
            "layer_fields": LAYER_FIELDS,
            "param_fields": PARAM_FIELDS,
            "sequence_fields": SEQUENCE_FIELDS,
            "trace_total": trace.total,
            "attn_layout": attention_layout(spec, plan.attn_tile),
            "sample_layout": sample_layout(),
            "vectors_layout": vectors_layout(spec, plan.batch),
            "mma_part_floats": MMA_PART_FLOATS,
            "sample_max_k": SAMPLE_MAX_K,
            "sample_candidates": SAMPLE_CANDIDATES,
        },
    }


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.files("mkport.kernel") / "templates")),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


@dataclass(frozen=True)
class RenderedSources:
    name: str
    digest: str
    files: dict  # filename -> text

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.digest}"

    def write(self, root: Path) -> Path:
        """Writes into root/<name>-<digest>/; the digest names the content, so rewriting changes nothing.
        Each file is replaced whole (written beside it, then renamed): a concurrent reader, a compiler
        included, sees the old file or the new one, never part of one."""
        out = Path(root) / self.dirname
        out.mkdir(parents=True, exist_ok=True)
        for filename, text in self.files.items():
            path = out / filename
            data = text.encode()
            if not path.exists() or path.read_bytes() != data:
                write_atomic(path, data)
        return out


def render(spec: ModelSpec, plan: LaunchPlan) -> RenderedSources:
    env = _environment()
    ctx = _context(spec, plan)
    try:
        files = {out: env.get_template(tpl).render(**ctx) for tpl, out in TEMPLATES}
    except jinja2.TemplateError as e:  # a template bug, reported as one line naming the template
        raise MkportError(f"rendering {spec.name} failed in {getattr(e, 'name', None) or 'a template'}: {e}") from None
    files["spec.json"] = json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n"
    files["plan.json"] = json.dumps(plan.to_dict(), indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(
        "".join(f"{k}\n{files[k]}" for k in sorted(files)).encode()
    ).hexdigest()[:12]
    return RenderedSources(spec.name, digest, files)
