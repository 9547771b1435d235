"""LaunchPlan: how the decode step is laid out on a GPU, chosen by one rule from the target's resources.

The rule (also written to plan.json next to the sources):
- one persistent block per SM, so every block is co-resident and a grid barrier is safe;
- 512 threads (16 warps) a block: enough 16-byte loads in flight to stream weights, while the register
  budget (regs_per_sm / threads) stays at 128 a thread;
- matvecs give one output row to one warp at a time, rows strided over every warp of the grid;
- attention splits the KV sequence of each KV head over up to grid / kv_heads blocks (flash-decoding),
  at least `attn_min_chunk` positions a split, and the last block of a head combines the splits;
- shared memory holds the widest activation vector in fp32, the attention tiles or the sampler's
  candidates, whichever is largest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import MkportError
from .gpu import GpuTarget
from .spec import ModelSpec

THREADS = 512
SAMPLE_CANDIDATES = 2048  # top-k sampler slots (top-k plus ties), a power of two
ATTN_TILE = 64  # positions scored per shared-memory tile
ATTN_MIN_CHUNK = 64  # fewest positions a split gets before another split is added


@dataclass(frozen=True)
class LaunchPlan:
    arch: str
    grid: int
    threads: int
    warps: int
    max_regs_per_thread: int
    attn_max_splits: int
    attn_min_chunk: int
    attn_tile: int
    attn_outputs_per_thread: int
    smem_bytes: int
    rows_per_warp: dict

    def to_dict(self) -> dict:
        return asdict(self)


def plan_launch(spec: ModelSpec, target: GpuTarget) -> LaunchPlan:
    grid = target.sm_count
    warps = THREADS // 32
    total_warps = grid * warps
    max_regs = min(255, target.regs_per_sm // THREADS)
    g = spec.gqa_ratio
    attn_floats = g * spec.head_dim + g * ATTN_TILE + 3 * g
    sample_floats = 256 + 2 * SAMPLE_CANDIDATES if spec.output_mode == "logits" else 0
    widest = max(spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim, spec.input_dim)
    smem = 4 * max(attn_floats, widest, sample_floats)
    if smem > target.smem_per_block:
        raise MkportError(
            f"{spec.name} needs {smem} bytes of shared memory a block; {target.arch} allows "
            f"{target.smem_per_block} (widest activation {widest})"
        )
    matvecs = {
        "qkv": spec.qkv_rows,
        "o_proj": spec.hidden_size,
        "gate_up": spec.intermediate_size,
        "down": spec.hidden_size,
    }
    if spec.output_mode == "logits":
        matvecs["lm_head"] = spec.vocab_size
    if spec.input_projection:
        matvecs["input_proj"] = spec.hidden_size
    return LaunchPlan(
        arch=target.arch,
        grid=grid,
        threads=THREADS,
        warps=warps,
        max_regs_per_thread=max_regs,
        attn_max_splits=max(1, grid // spec.num_kv_heads),
        attn_min_chunk=ATTN_MIN_CHUNK,
        attn_tile=ATTN_TILE,
        attn_outputs_per_thread=-(-g * spec.head_dim // THREADS),
        smem_bytes=smem,
        rows_per_warp={k: -(-rows // total_warps) for k, rows in matvecs.items()},
    )
