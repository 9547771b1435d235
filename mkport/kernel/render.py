"""Renders the decode-step sources of a (ModelSpec, LaunchPlan) into generated/<name>-<digest>/.

Jinja renders one file, the constants header (cuda/constants.cuh.j2: sizes, family flags, the plan, shared-memory
layouts, RoPE and window tables, and the layouts shared with the host from kernel/interface.py: the Params struct,
the per-layer weight table, the trace buffer). The ops and the decode step are plain CUDA (cuda/*.cuh,
cuda/decode_step.cu), copied beside it unchanged. The same inputs give byte-identical output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2
import numpy as np

from .cache import write_atomic
from ..errors import MkportError
from .interface import PARAM_FIELDS, SEQUENCE_FIELDS, TIMELINE_EVENTS, TraceLayout, layer_field_types, ring_rows
from .spec import ModelSpec, RopeSpec
from .launch_plan import (
    SAMPLE_CANDIDATES, LaunchPlan, attention_layout, mma_part_floats, moe_act_floats, moe_routing_layout, sample_layout,
    vectors_layout,
)

SAMPLE_MAX_K = 1024  # top-k the sampler serves; the rest of SAMPLE_CANDIDATES holds ties

HEADER_TEMPLATE, HEADER = "constants.cuh.j2", "constants.cuh"  # the one rendered file


def kernel_dir():
    """The kernel's source folder in the package: the header's template and the plain sources."""
    return resources.files("mkport.kernel") / "cuda"


def plain_sources() -> dict:
    """The ops and the decode step, filename -> text, as they are copied beside the rendered header."""
    return {f.name: f.read_text() for f in sorted(kernel_dir().iterdir(), key=lambda f: f.name)
            if f.name.endswith((".cuh", ".cu"))}


def rope_tables(spec: ModelSpec, seq_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """inv_freq (float32, as the reference computes it) and, for MRoPE, the position stream of each frequency; over
    the rotated dimensions of a head (all of head_dim but with partial RoPE). seq_len (the largest position + 1)
    picks dynamic NTK's base and longrope's factors as transformers' dynamic_rope_update does; 0: at load time."""
    rope, dim = spec.rope, spec.rope_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    theta = rope.theta
    if rope.variant == "dynamic":  # NTK: a larger base once the sequence passes max_position_embeddings
        length = max(seq_len, rope.original_max_position)
        theta *= (rope.factor * length / rope.original_max_position - (rope.factor - 1)) ** (dim / (dim - 2))
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if rope.variant == "longrope":  # the long factors only past the pretraining length
        factors = rope.long_factor if seq_len > rope.original_max_position else rope.short_factor
        inv_freq = (np.float32(1.0) / (np.asarray(factors, dtype=np.float32) * np.float32(theta) ** exponent))
    elif rope.variant == "yarn":
        inv_freq = _yarn_inv_freq(rope, dim, (np.float32(theta) ** exponent).astype(np.float32))
    elif rope.variant == "linear":
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


def dynamic_rope_table(spec: ModelSpec, max_seq: int) -> np.ndarray:
    """Dynamic NTK's inv_freq for every sequence length up to max_seq, [rows, rope_dim / 2] float32: row r is
    rope_tables(spec, original + r), row 0 also every shorter length (the base is raised only past the original
    length). The kernel's Params::rope_table: a step at position p reads row max(p + 1 - original, 0)."""
    original = spec.rope.original_max_position
    return np.stack([rope_tables(spec, original + r)[0] for r in range(max(max_seq - original, 0) + 1)])


def _yarn_inv_freq(rope: RopeSpec, dim: int, pos_freqs: np.ndarray) -> np.ndarray:
    """YaRN: interpolated (divided by factor) below the beta_slow correction dimension, extrapolated (unchanged) above
    beta_fast, a linear ramp between, as transformers' _compute_yarn_parameters."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = (np.float32(1) - ramp).astype(np.float32)
    interpolated = np.float32(1) / (np.float32(rope.factor) * pos_freqs)
    return (interpolated * (1 - extrapolated) + (np.float32(1) / pos_freqs) * extrapolated).astype(np.float32)


def _float_literal(value: float) -> str:
    return f"{float(np.float32(value)).hex()}f"


def _context(spec: ModelSpec, plan: LaunchPlan) -> dict:
    inv_freq, stream = rope_tables(spec)
    local_inv_freq = rope_tables(dataclasses.replace(spec, rope=spec.local_rope))[0] if spec.local_rope else []
    # longrope's long factors: what rope_tables gives every length past the original
    long_inv_freq = rope_tables(spec, spec.rope.original_max_position + 1)[0] if spec.rope.variant == "longrope" else []
    trace = TraceLayout.of(spec)
    return {
        "spec": spec,
        "plan": plan,
        "spec_digest": spec.digest(),
        "c": {
            "eps": _float_literal(spec.rms_eps),
            "attn_scale": _float_literal(spec.attention_scale),
            "residual_multiplier": _float_literal(spec.residual_multiplier),
            "embedding_multiplier": _float_literal(spec.embedding_multiplier),
            "logits_scaling": _float_literal(spec.logits_scaling),
            "attn_softcap": _float_literal(spec.attn_logit_softcap),
            "final_softcap": _float_literal(spec.final_logit_softcap),
            "rope_inv_freq": [_float_literal(f) for f in inv_freq],
            "rope_attention_factor": _float_literal(spec.rope.attention_factor),
            "rope_long_inv_freq": [_float_literal(f) for f in long_inv_freq],
            "rope_local_inv_freq": [_float_literal(f) for f in local_inv_freq],
            "rope_local_layers": [int(spec.uses_local_rope(i)) for i in range(spec.num_layers)],
            "rope_stream": [int(s) for s in stream],
            "rope_layers": [int(spec.uses_rope(i)) for i in range(spec.num_layers)],
            "attn_windows": [spec.window(i) for i in range(spec.num_layers)],
            "ring_rows": ring_rows(spec),
            "full_layers_before": [sum(not spec.window(j) for j in range(i)) for i in range(spec.num_layers)],
            "full_layers": sum(not spec.window(i) for i in range(spec.num_layers)),
            "sparse_layers": [int(spec.sparse(i)) for i in range(spec.num_layers)],
            "trace_layer0": trace.layer0,
            "trace_layer_offsets": trace.layer_offsets,
            "trace_layer_stride": trace.layer_stride,
            "trace_final_offset": trace.final,
            "layer_fields": layer_field_types(spec),
            "linear_layers": [int(spec.is_linear(i)) for i in range(spec.num_layers)],
            "linear_q_scale": _float_literal(spec.linear_attention.key_head_dim**-0.5) if spec.linear_layers else "",
            "param_fields": PARAM_FIELDS,
            "timeline_events": TIMELINE_EVENTS,
            "sequence_fields": SEQUENCE_FIELDS,
            "trace_total": trace.total,
            "attn_layout": attention_layout(spec, plan.attn_tile),
            "sample_layout": sample_layout(),
            "vectors_layout": vectors_layout(spec, plan.batch),
            "mma_part_floats": mma_part_floats(plan.batch),
            "moe_act_floats": moe_act_floats(spec, plan.batch),
            "moe_routing": moe_routing_layout(spec, plan.batch) if spec.moe else {},
            "sample_max_k": SAMPLE_MAX_K,
            "sample_candidates": SAMPLE_CANDIDATES,
        },
    }


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(kernel_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["cbool"] = lambda value: "true" if value else "false"  # a C++ bool literal
    return env


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
        files = {HEADER: env.get_template(HEADER_TEMPLATE).render(**ctx)}
    except jinja2.TemplateError as e:  # a template bug, reported as one line
        raise MkportError(f"rendering {spec.name} failed in {HEADER_TEMPLATE}: {e}") from None
    files.update(plain_sources())
    files["spec.json"] = json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n"
    files["plan.json"] = json.dumps(plan.to_dict(), indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(
        "".join(f"{k}\n{files[k]}" for k in sorted(files)).encode()
    ).hexdigest()[:12]
    return RenderedSources(spec.name, digest, files)
