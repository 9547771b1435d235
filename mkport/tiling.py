"""LaunchPlan: how the decode step is laid out on a GPU, chosen by one rule from the target's resources.

The rule (also written to plan.json next to the sources):
- one persistent block per SM, so every block is co-resident and a grid barrier is safe;
- 512 threads (16 warps) a block: enough 16-byte loads in flight to stream weights, while the register
  budget (regs_per_sm / threads) stays at 128 a thread (measured on the H200: 384 threads with more
  loads in flight per warp streamed slower);
- matvecs give one output row to one warp at a time, rows strided over every warp of the grid;
  when there are fewer rows than warps (o_proj, down of small models), `split_k` warps of one block
  share a row;
- attention splits the KV sequence of each KV head over up to grid / kv_heads blocks (flash-decoding),
  at least `attn_split_positions` (16) positions a split: at short contexts the work is a chain of
  latencies, so more, shorter chains in parallel finish sooner. K and V tiles are copied into shared
  memory asynchronously, and the last block of a head combines the splits. `attn_tile` is the largest
  power of two up to 128 whose tiles fit the target's shared memory;
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
MAX_ATTN_TILE = 128  # positions of K and V a block holds in shared memory at once
MIN_ATTN_TILE = 16
ATTN_SPLIT_POSITIONS = 16  # fewest positions a flash-decoding split takes
STATIC_SMEM_RESERVE = 1024  # bytes of static shared memory the kernel declares besides the plan's


@dataclass(frozen=True)
class LaunchPlan:
    arch: str
    grid: int
    threads: int
    warps: int
    max_regs_per_thread: int
    attn_max_splits: int
    attn_tile: int
    attn_split_positions: int
    attn_outputs_per_thread: int
    smem_bytes: int
    split_k: dict
    rows_per_warp: dict

    def to_dict(self) -> dict:
        return asdict(self)

    def attention_splits(self, context: int) -> int:
        """Flash-decoding splits of each KV head for a step that attends over `context` positions."""
        return max(1, min(self.attn_max_splits, -(-context // self.attn_split_positions)))


def attention_floats(spec: ModelSpec, tile: int) -> int:
    """Shared memory of the attention phase (fp32 words): q, scores, softmax state, PV partial sums,
    and the bf16 K and V tiles; the layout is the one in attention.cuh."""
    g, hd = spec.gqa_ratio, spec.head_dim
    return g * hd + g * tile + 4 * ((3 * g + 3) // 4) + THREADS + tile * hd


def split_k(rows: int, k: int, total_warps: int, warps: int) -> int:
    """Warps sharing one output row: doubled (up to 4) while the rows still fit the grid's warps."""
    split = 1
    while split < 4 and rows * split * 2 <= total_warps and (k // (split * 2)) % 8 == 0 and warps % (split * 2) == 0:
        split *= 2
    return split


def plan_launch(spec: ModelSpec, target: GpuTarget) -> LaunchPlan:
    grid = target.sm_count
    warps = THREADS // 32
    total_warps = grid * warps
    max_regs = min(255, target.regs_per_sm // THREADS)
    g = spec.gqa_ratio
    tile = MAX_ATTN_TILE
    while tile > MIN_ATTN_TILE and 4 * attention_floats(spec, tile) + STATIC_SMEM_RESERVE > target.smem_per_block:
        tile //= 2
    attn_floats = attention_floats(spec, tile)
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
        attn_tile=tile,
        attn_split_positions=ATTN_SPLIT_POSITIONS,
        attn_outputs_per_thread=-(-g * spec.head_dim // THREADS),
        smem_bytes=smem,
        split_k={
            "o_proj": split_k(spec.hidden_size, spec.num_heads * spec.head_dim, total_warps, warps),
            "down": split_k(spec.hidden_size, spec.intermediate_size, total_warps, warps),
        },
        rows_per_warp={k: -(-rows // total_warps) for k, rows in matvecs.items()},
    )
