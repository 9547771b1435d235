"""LaunchPlan: how the decode step is laid out on a GPU, chosen by one rule from the target's resources.

The rule (also written to plan.json next to the sources):
- one persistent block per SM, so every block is co-resident and a grid barrier is safe;
- 512 threads (16 warps) a block: enough 16-byte loads in flight to stream weights, while the register
  budget (regs_per_sm / threads) stays at 128 a thread (measured on the H200: 384 threads with more
  loads in flight per warp streamed slower);
- matvecs give one output row to one warp at a time, rows strided over every warp of the grid;
  when there are fewer rows than warps (o_proj, down of small models), `split_k` warps of one block
  share a row;
- attention splits the KV sequence of each KV head over up to grid / kv_heads blocks (flash-decoding), at most 32
  and at most attn_tile / gqa_ratio (the combine holds every split's partials in the tiles' shared memory), at least
  `attn_split_positions` (16) positions a split: at short contexts the work is a chain of latencies, so more, shorter
  chains in parallel finish sooner. K and V tiles are copied into shared memory asynchronously, the next while one is
  computed, and the last block of a head combines the splits. `attn_tile` is the largest
  power of two up to 128 whose tiles fit the target's shared memory;
- shared memory holds the widest activation vector in fp32 (one per sequence of the batch), the
  attention tiles or the sampler's candidates, whichever is largest.

Batched decode (`batch` > 1, kernel v5): one step advances `batch` sequences, each with its own KV cache,
position and sampler. A warp applies a tile of 16 weight rows to every sequence's vector on tensor cores
(mma_matvec.cuh), the tile's k split over up to 16 warps of a block while the tiles fit the grid's warps; the
vectors are in shared memory in fp32, so the batch is bounded by that memory (BATCH_SIZES lists the sizes, tiles
of 8 sequences; batch 1 keeps the fp32 warp-per-row matvec). Attention items are (sequence, kv head, split); the
splits of each sequence shrink as the batch grows, to one, so that the items fit one pass over the grid up to
grid / kv heads sequences (the 1.7B talker's 8 KV heads on 132 SMs: 16; 24 take two passes). A hybrid's (Qwen3.5)
Gated DeltaNet layers batch too: each sequence has its own conv and delta-rule state, the delta rule's items are
(sequence, value head, columns), and every batch size that fits shared memory compiles without spills at sm_90
(tests/test_qwen35_kernel.py).

Batch-invariant plans (`invariant_to` N, `mkport serve --batch-invariant`): a plan for batch b <= N whose rows are
summed as the plan for N sums them, so that a sequence's bits are the same whether it runs among b rows or N. What decides a
row's sums (`LaunchPlan.reduction_choices`, the tests compare it): the matvec path (batch 1: fp32 warp-per-row on CUDA
cores with `split_k`; a batch: tensor-core tiles whose k slices, mma_matvec.cuh's mma_slices, follow the matrix and the
grid, not the batch; each sequence's column of a tile is computed alone, and the slices are added in a fixed order),
RMSNorm's block sums (a sequence's alone, in a fixed order at any batch), and the attention splits of a sequence,
which shrink as the batch grows (`attention_splits`): the one batch-dependent choice of a batch's kernel, so an
invariant plan takes them for N. Batch 1's matvecs sum another way entirely, so batch 1 cannot be invariant to a batch:
a lone sequence of an invariant server runs as batch 2, its second row idle (plan_launch refuses batch 1 with
invariant_to > 1). The kernel is the same code (the constants header only names N): the plan's difference is on the
host, in the splits each step asks for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import MkportError
from .gpu import GpuTarget
from .spec import HEAD_DIMS, LENGTH_DEPENDENT_ROPE, MOE_FIELDS, ModelSpec

THREADS = 512
SAMPLE_CANDIDATES = 2048  # top-k sampler slots (top-k plus ties), a power of two
MAX_ATTN_TILE = 128  # positions of K and V a block holds in shared memory at once
MIN_ATTN_TILE = 16
ATTN_SPLIT_POSITIONS = 16  # fewest positions a flash-decoding split takes
STATIC_SMEM_RESERVE = 1024  # bytes of static shared memory the kernel declares besides the plan's
# most flash-decoding splits a KV head takes: the last split's combine reads every partial, and past ~32 that costs
# more than the shorter walks save (gemma-3-1b, one KV head, context 2048: 128 splits 2029 us, 32 1498, 8 1501; with
# the combine staged in shared memory, 32 against 16: qwen3.5-0.8b at 8192 991 against 1072 us, docs/benchmarks.md)
ATTN_MAX_SPLITS = 32
KERNELS = ("v20",)
BATCHES = (1, 2, 4, 8, 16, 32)  # batch sizes offered unless asked (a server's rungs, the largest that fits)
# every batch size a plan is made for (shared memory permitting): 24 only where asked (mkport serve --batch-size 24,
# --batch 24), for a model whose 32 does not fit a block (the 1.7B talker on sm_90); a default once measured faster
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32)
DEFAULT_KERNEL = "v20"  # what a Decoder and the commands use unless told
# Designs measured slower than the one kept (docs/benchmarks.md has their logs): removed. v20 is v16 with a post-norm
# layer's norms made by the phase after each sublayer (two grid barriers a layer fewer on gemma2/3 and olmo2/3, the
# same bits); v16 is v7 (v5 with the state loads at a phase's start in flight together and the next RMSNorm's weights
# staged before its grid barrier) with attention's split counter one acquire-release atomic and the last split's
# combine loading its partials in waves.
REMOVED_KERNELS = {"v2": "slower than v5 in every measurement; docs/benchmarks.md has its log, and "
                         "`git log -- mkport/kernel/templates/decode_step_v2.cu.j2` finds its code",
                   "v5": "v7 replaced it, faster on every spec measured with the same results; docs/benchmarks.md has "
                         "the comparison",
                   "v6": "its streamed MLP was slower than v5 (docs/benchmarks.md); commit 4daf830 has its code",
                   "v7": "v16 replaced it, faster on every spec measured at context 128 with bit-identical results; "
                         "docs/benchmarks.md has the comparison",
                   "v16": "v20 replaced it: the same bits, faster on every post-norm spec (gemma-3-1b 1334 -> 1255 us "
                          "at context 128) and the same kernel on the others (docs/benchmarks.md); commit 5b5f84b has "
                          "both",
                   "v15": "v16 is v15 with the combine in waves, faster at context 128 (docs/benchmarks.md)",
                   "v17": "its paired gate/up rows were slower than v7 on every spec measured (docs/benchmarks.md); "
                          "commit 0a0c8a6 has its code",
                   "v18": "its K/V tile copied before the grid barrier was no faster than v16 (slower on the talker, "
                          "docs/benchmarks.md); commit 0569b1b has its code"}
# head dims the attention builds: HEAD_DIMS and Phi-3/3.5-mini's 96 (a lane's second rotate-half pair padded in half
# the lanes, attention.cuh)
KERNEL_HEAD_DIMS = tuple(sorted((*HEAD_DIMS, 96)))


def mma_part_floats(batch: int) -> int:
    """A warp's partial tile of a batched matvec (mma_matvec.cuh): 16 rows of at least 16 sequences' columns, so that
    batch 32's n8 tiles 2 and 3 have columns of their own (they overwrote the next row's with 16)."""
    return 16 * max(16, 8 * -(-batch // 8))


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
    kernel: str = DEFAULT_KERNEL
    batch: int = 1  # sequences a step advances
    norm_weights_at: int = 0  # batch 1: byte offset in shared memory of the next RMSNorm's staged weights
    linear_columns: int = 0  # a hybrid's Gated DeltaNet: value columns of a head's state one block updates (0: none)
    invariant_to: int = 0  # a batch-invariant plan: its rows summed as batch invariant_to's plan sums them (0: none)
    tail_split: bool = False  # batch 1: a matvec's short last round split in k over warp pairs (matvec.cuh)
    vector_act: bool = False  # batch 1: down's input act(gate) * up read with 16-byte loads (mlp.cuh)

    def to_dict(self) -> dict:
        """The plan's fields; `invariant_to`, `tail_split` and `vector_act` only when set, so that a plain plan's
        plan.json (part of its build's digest) is what it was before them, and its cached builds stay valid."""
        out = asdict(self)
        for name in ("invariant_to", "tail_split", "vector_act"):
            if not out[name]:
                del out[name]
        return out

    @property
    def reduction_batch(self) -> int:
        """The batch whose reduction order this plan's rows follow: invariant_to where set, else its own."""
        return max(self.batch, self.invariant_to)

    def attention_splits(self, context: int) -> int:
        """Flash-decoding splits of each KV head for a step that attends over `context` positions (per sequence:
        a batch shares the grid's blocks between its sequences; an invariant plan shares them as its
        invariant_to's batch would, so a sequence's attention sums the same positions together at any batch)."""
        return max(1, min(self.attn_max_splits // self.reduction_batch, -(-context // self.attn_split_positions)))

    def reduction_choices(self, spec: ModelSpec, contexts=(1, 16, 17, 64, 128, 256, 1024, 4096)) -> dict:
        """Everything that decides how one row of one sequence is summed, whatever the batch: two plans with equal
        choices give a sequence the same bits (module docstring). Compared by the tests; not the kernel's input."""
        tensor_cores = self.batch > 1
        k_of = matvec_inputs(spec)
        return {
            "tensor_cores": tensor_cores,
            "grid": self.grid, "warps": self.warps, "arch": self.arch, "kernel": self.kernel,
            # batch 1's fp32 matvec: warps sharing a row; a batch's tensor-core tiles: warps sharing a tile's k
            "split_k": None if tensor_cores else dict(self.split_k),
            "mma_slices": ({name: mma_slices(rows, k_of[name], self.warps, self.grid * self.warps)
                            for name, rows in matvec_rows(spec).items()} if tensor_cores else None),
            "attn_tile": self.attn_tile, "attn_split_positions": self.attn_split_positions,
            "attn_max_splits": self.attn_max_splits,
            "attention_splits": {c: self.attention_splits(c) for c in contexts},
            "linear_columns": self.linear_columns,
        }


def attention_layout(spec: ModelSpec, tile: int) -> dict:
    """Shared memory of the attention phase, in floats from its start (rendered into attention.cuh): q
    [group][head_dim], scores [group][tile], the softmax state (3 a head, rounded up to 4 floats), the PV
    partial sums [THREADS], then the bf16 K and V tiles [tile][head_dim] each; `floats` is the whole."""
    g, hd = spec.gqa_ratio, spec.head_dim
    layout = {"q": 0}
    layout["score"] = layout["q"] + g * hd
    layout["state"] = layout["score"] + g * tile
    layout["pv"] = layout["state"] + 4 * ((3 * g + 3) // 4)
    layout["kv"] = layout["pv"] + THREADS  # a multiple of 4 floats: the tiles are 16-byte aligned
    layout["floats"] = layout["kv"] + tile * hd  # two bf16 tiles: tile * head_dim floats
    return layout


def attention_floats(spec: ModelSpec, tile: int) -> int:
    return attention_layout(spec, tile)["floats"]


def sample_layout() -> dict:
    """The sampler's shared memory, in floats (rendered into sample.cuh): the radix select's histogram (256 bins,
    a byte of the key a pass), then the candidates' values and ids."""
    return {"cand_val": 256, "cand_id": 256 + SAMPLE_CANDIDATES, "floats": 256 + 2 * SAMPLE_CANDIDATES}


def moe_down_floats(spec: ModelSpec) -> int:
    """A sparse layer's down input, in floats: act(gate) * up of each chosen expert, then of qwen2_moe's shared expert."""
    moe = spec.moe
    return 0 if moe is None else moe.top_k * moe.expert_intermediate_size + moe.shared_expert_intermediate_size


def moe_act_floats(spec: ModelSpec, batch: int = 1) -> int:
    """A sparse layer's act buffer a sequence. Batch 1: the chosen experts' gate then up rows, slot by slot; the shared
    expert's gate then up rows and its gate's logit (moe.cuh). A batch: the down projection's input first (each chosen
    expert's weight * act(gate) * up, slot by slot, then the shared expert's sigmoid(gate) * act(gate) * up:
    moe_down_floats), then the shared expert's gate and up rows and its gate's logit."""
    moe = spec.moe
    if moe is None:
        return 0
    shared = moe.shared_expert_intermediate_size
    raw = 2 * shared + 1 if shared else 0
    if batch > 1:  # a sequence's part starts 16 bytes aligned: the expert tiles read their inputs as float4
        return -(-(moe_down_floats(spec) + raw) // 4) * 4
    return 2 * moe.top_k * moe.expert_intermediate_size + raw


MOE_BATCH_WIDTH = 32  # a batch's tensor-core expert tiles take an expert's k (down) in steps of 32


def moe_routing_layout(spec: ModelSpec, batch: int) -> dict:
    """A batch's routing in shared memory (moe.cuh), in 4-byte words from its start: each sequence's router logits
    [batch][experts] and each expert's slot among the sequence's chosen ones (-1: not chosen) [batch][experts]
    (first its rank), each sequence's chosen experts (ascending) and their weights [batch][top_k], then the union of
    the batch's experts in ascending index [experts], which sequences chose each (a bit mask) [experts], and the
    prefix sum's per-warp counts, an array of its own of one int a warp (THREADS / 32 = 16, whatever the batch and
    the expert count: written into the slot array they raced the sequences' slots where batch * experts < 16)."""
    moe, b = spec.moe, batch
    e, k = moe.num_experts, moe.top_k
    layout = {"logits": 0}
    layout["slot"] = layout["logits"] + b * e
    layout["experts"] = layout["slot"] + b * e
    layout["weights"] = layout["experts"] + b * k
    layout["union"] = layout["weights"] + b * k
    layout["mask"] = layout["union"] + e
    layout["warp_counts"] = layout["mask"] + e
    layout["words"] = layout["warp_counts"] + THREADS // 32
    return layout


def vectors_layout(spec: ModelSpec, batch: int) -> dict:
    """The v5 kernel's activation vectors in shared memory, in floats (rendered into mma_matvec.cuh): `batch` of
    the widest, then, for a batch, the partial tiles of its matvecs (a warp's mma_part_floats each). A batch's
    o_proj and down read their inputs from global memory, so only the normed residual and the input row stay. A
    mixture of experts adds its routing (`moe`, kept from the gate/up phase to down): at batch 1 after the vectors,
    the router logits and each expert's rank, then the experts applied and their weights; a batch's after the partial
    tiles (moe_routing_layout)."""
    widest = max(spec.hidden_size, spec.input_dim)
    if batch == 1:
        widest = max(widest, spec.intermediate_size, spec.num_heads * spec.head_dim, moe_down_floats(spec))
    if spec.linear_layers:  # a Gated DeltaNet's read-outs, normed in shared memory for out_proj (a batch's too)
        widest = max(widest, spec.linear_attention.value_dim)
    part = widest * batch
    tiles = THREADS // 32 * mma_part_floats(batch) if batch > 1 else 0
    if spec.moe is None:
        moe_at, routing = part, 0
    elif batch == 1:
        moe_at, routing = part, 2 * (spec.moe.num_experts + spec.moe.top_k)
    else:
        moe_at, routing = part + tiles, moe_routing_layout(spec, batch)["words"]
    return {"widest": widest, "part": part, "moe": moe_at, "floats": part + tiles + routing}


def linear_columns(spec: ModelSpec, grid: int) -> int:
    """Columns of a value head's [dk, dv] state that one block of the delta-rule phase updates (the columns are
    independent): from 8, doubled up to 16 while the heads' column slices outnumber the grid's blocks (32 give a
    thread 8 rows of a 128-row state: Qwen3.5-4B's decode step spilled at sm_90)."""
    la, cols = spec.linear_attention, 8
    while cols < 16 and la.value_head_dim % (2 * cols) == 0 and la.num_value_heads * la.value_head_dim // cols > grid:
        cols *= 2
    return cols


def linear_floats(spec: ModelSpec) -> int:
    """The delta-rule phase's shared memory, in floats (linear_attention.cuh): a q/k head's q and k, the block's value
    columns, then two [warps][columns] partial sums, for at most 32 columns, and the L2 norms' block sums."""
    warps = THREADS // 32
    return 0 if not spec.linear_layers else 2 * spec.linear_attention.key_head_dim + 32 + 2 * warps * 32 + 2 * warps


def batch_static_smem(batch: int) -> int:
    """Static shared memory of the v5 kernel at a batch size: a fixed part and per-sequence reduction slots
    (block sums, and the head's best value and id per warp)."""
    return STATIC_SMEM_RESERVE + 3 * 4 * (THREADS // 32) * batch


def split_k(rows: int, k: int, total_warps: int, warps: int) -> int:
    """Warps sharing one output row: doubled (up to 4) while the rows still fit the grid's warps."""
    split = 1
    while split < 4 and rows * split * 2 <= total_warps and (k // (split * 2)) % 8 == 0 and warps % (split * 2) == 0:
        split *= 2
    return split


def matvec_rows(spec: ModelSpec) -> dict:
    """Output rows of each matvec of a decode step."""
    rows = {"qkv": spec.qkv_rows, "o_proj": spec.hidden_size, "gate_up": spec.intermediate_size,
            "down": spec.hidden_size}
    if spec.output_mode == "logits":
        rows["lm_head"] = spec.vocab_size
    if spec.input_projection:
        rows["input_proj"] = spec.hidden_size
    if spec.linear_layers:
        rows["linear_in"] = spec.linear_attention.in_rows
        rows["linear_out"] = spec.hidden_size
    return rows


def matvec_inputs(spec: ModelSpec) -> dict:
    """The k (input width) of each matvec of matvec_rows."""
    hidden = spec.hidden_size
    ks = {"qkv": hidden, "o_proj": spec.num_heads * spec.head_dim, "gate_up": hidden,
          "down": spec.intermediate_size, "lm_head": hidden, "input_proj": spec.input_dim}
    if spec.linear_layers:
        ks.update(linear_in=hidden, linear_out=spec.linear_attention.value_dim)
    return ks


def mma_slices(rows: int, k: int, warps: int, total_warps: int) -> int:
    """mma_matvec.cuh's mma_slices: warps of a block splitting a 16-row tile's k (32 a step), doubled while the tiles
    still fit the grid's warps. Rows, k and the grid decide it; the batch does not (a batch's kernel sums a row's
    tile the same way at any batch)."""
    s, tiles = 1, -(-rows // 16)
    while s * 2 <= warps and tiles * s * 2 <= total_warps and k % (s * 2 * 32) == 0:
        s *= 2
    return s


def check_invariant_to(batch: int, invariant_to: int) -> None:
    """An invariant_to a plan of `batch` can take (0: none), or one line saying why not."""
    if not invariant_to:
        return
    if invariant_to not in BATCH_SIZES or invariant_to < batch:
        raise MkportError(f"invariant_to {invariant_to} at batch {batch}: a batch size of "
                          f"{', '.join(map(str, BATCH_SIZES))} at least the plan's batch")
    if batch == 1 and invariant_to > 1:
        raise MkportError(f"batch 1 invariant to batch {invariant_to}: batch 1 sums a row on CUDA cores (fp32, split "
                          "k), a batch on tensor cores, so no batch-1 kernel gives a batch's bits; run the sequence as "
                          "batch 2 with its second row idle (mkport serve --batch-invariant does)")


def refuse_removed_kernel(kernel: str, name: str = "kernel") -> None:
    """One line saying why a removed kernel design is gone; `name` as the user gave it."""
    if kernel in REMOVED_KERNELS:
        raise MkportError(f"{name} {kernel}: kernel {kernel} was removed ({REMOVED_KERNELS[kernel]})")


def check_batch(batch: int, name: str = "batch") -> None:
    """A batch size a plan is made for (BATCH_SIZES), or one line naming the sizes; `name` as the user gave it."""
    if batch not in BATCH_SIZES:
        raise MkportError(f"{name} {batch}: supported batch sizes are {', '.join(map(str, BATCH_SIZES))}")


def attention_max_splits(spec: ModelSpec, grid: int, tile: int, limit: int = ATTN_MAX_SPLITS) -> int:
    """Most flash-decoding splits of a KV head: `limit`, the grid's blocks a KV head, and what the combine holds (the
    last block copies every split's partials of the group's heads into the K/V tiles' shared memory)."""
    return max(1, min(limit, grid // spec.num_kv_heads, tile // spec.gqa_ratio))


def _pv_width(spec: ModelSpec) -> int:
    """Adjacent dims of an attention output a thread computes together (attention.cuh's PV_WIDTH): two where every
    thread has two outputs or more anyway."""
    return 2 if spec.gqa_ratio * spec.head_dim > THREADS else 1


def _attention_tile(spec: ModelSpec, target: GpuTarget) -> int:
    """The largest attention tile (positions a block holds at once) whose shared memory fits a block."""
    tile = MAX_ATTN_TILE
    while tile > MIN_ATTN_TILE and 4 * attention_floats(spec, tile) + STATIC_SMEM_RESERVE > target.smem_per_block:
        tile //= 2
    return tile


def _smem_bytes(spec: ModelSpec, target: GpuTarget, batch: int) -> int:
    """A v5 block's dynamic shared memory at a batch size: the phases take turns with the same memory."""
    sample_floats = sample_layout()["floats"] if spec.output_mode == "logits" else 0
    return 4 * max(attention_floats(spec, _attention_tile(spec, target)), vectors_layout(spec, batch)["floats"],
                   sample_floats, linear_floats(spec))


def fitting_batches(spec: ModelSpec, target: GpuTarget, sizes: tuple = BATCHES) -> list[int]:
    """The `sizes` (BATCHES, or BATCH_SIZES with those only asked) whose plans fit a block's shared memory on `target`
    (a mixture of experts whose expert widths a batch does not take: batch 1 at most). Not always from 1: a batch reads
    a mixture of experts' down input from global memory, where batch 1 holds it in shared memory (Mixtral on sm_89 fits
    batches 2 to 4, not 1)."""
    batches = (1,) if moe_batch_problem(spec) else sizes
    return [b for b in batches if _smem_bytes(spec, target, b) + batch_static_smem(b) <= target.smem_per_block]


def largest_batch(spec: ModelSpec, target: GpuTarget, sizes: tuple = BATCHES) -> int:
    """The largest of `sizes` whose plan fits a block's shared memory on `target` (0 when none does)."""
    fits = fitting_batches(spec, target, sizes)
    return fits[-1] if fits else 0


def moe_batch_problem(spec: ModelSpec) -> str:
    """Why a batch cannot run this mixture of experts on the megakernel ('' when it can): a batch's expert tiles
    (moe.cuh) take an expert's down rows in k steps of MOE_BATCH_WIDTH, so its widths must be multiples of it (a
    tensor-core down projection over other widths read past each row)."""
    moe = spec.moe
    if moe is None:
        return ""
    width_key = MOE_FIELDS[spec.family]["width"][0] if spec.family in MOE_FIELDS else "moe_intermediate_size"
    for key, width in ((width_key, moe.expert_intermediate_size),
                       ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size)):
        if width % MOE_BATCH_WIDTH:
            return (f"{key}={width}: batched decode of a mixture of experts takes expert widths that are multiples of "
                    f"{MOE_BATCH_WIDTH} (batch 1 runs this one)")
    if spec.hidden_size % MOE_BATCH_WIDTH:
        return f"hidden_size={spec.hidden_size}: batched decode of a mixture of experts takes multiples of {MOE_BATCH_WIDTH}"
    return ""


def check_kernel_support(spec: ModelSpec, batch: int = 1) -> None:
    """Refuses a spec whose features the megakernel does not build yet, though the plain-torch path runs them
    (TorchDecoder, the reference backend, and the CPU validation): Qwen3.5's hybrid layers with shapes its ops do not
    take (value heads not a multiple of 8 wide), partial RoPE on head_dim 96 or over an
    odd number of dimensions, sliding layers' own RoPE when its frequencies follow the sequence length (dynamic,
    longrope) or it has an attention factor (the kernel picks the spec's own RoPE by the length, rope.cuh's
    RopeLength, not theirs), a head_dim outside
    KERNEL_HEAD_DIMS, a mixture of experts with more experts than a block has threads, or at a batch above 1 with
    expert widths that are not multiples of 32 (moe_batch_problem)."""
    if spec.head_dim not in KERNEL_HEAD_DIMS:
        raise MkportError(f"{spec.name} ({spec.family}): the megakernel is not built yet for head_dim={spec.head_dim} "
                          f"(it builds {', '.join(map(str, KERNEL_HEAD_DIMS))}); the plain-torch path runs it: mkport run "
                          "--backend reference")
    # rope.cuh's partial rotation finds element i of a head in lane i % 32, slot i / 32: head_dim 96's padded pairs
    # (attention.cuh) lay it out otherwise
    if spec.rope_dim != spec.head_dim and (spec.head_dim % 64 or spec.rope_dim % 2):
        raise MkportError(f"{spec.name} ({spec.family}): the megakernel is not built yet for partial rotary embeddings "
                          f"(RoPE on {spec.rope_dim} of head_dim {spec.head_dim}; it rotates an even number of "
                          "dimensions of a head_dim that is a multiple of 64); the plain-torch path runs it: mkport run "
                          "--backend reference")
    la = spec.linear_attention
    if spec.linear_layers and (la.value_head_dim % 8 or la.key_head_dim % 8):
        raise MkportError(f"{spec.name}: linear_key_head_dim={la.key_head_dim}, linear_value_head_dim="
                          f"{la.value_head_dim}; the megakernel needs multiples of 8; the plain-torch path runs it: "
                          "mkport run --backend reference")
    local = spec.local_rope
    if local is not None and (local.variant in LENGTH_DEPENDENT_ROPE or local.attention_factor != 1.0):
        raise MkportError(f"{spec.name} ({spec.family}): the megakernel is not built yet for {local.variant} RoPE on the "
                          "sliding layers (it builds their own theta, unscaled or linear or llama3); the plain-torch "
                          "path runs it: mkport run --backend reference")
    if spec.moe is not None and batch > 1 and moe_batch_problem(spec):
        raise MkportError(f"{spec.name} at batch {batch}: {moe_batch_problem(spec)}")
    if spec.moe is not None and spec.moe.num_experts > THREADS:
        raise MkportError(f"{spec.name}: {spec.moe.num_experts} experts; the megakernel routes up to {THREADS} (a "
                          "thread an expert)")


def plan_launch(spec: ModelSpec, target: GpuTarget, kernel: str = DEFAULT_KERNEL, batch: int = 1,
                invariant_to: int = 0) -> LaunchPlan:
    """The launch plan by the rule above. `invariant_to` N (a batch size at least `batch`): the plan sums each row as
    batch N's does (module docstring); N equal to `batch` is the plain plan (nothing to be invariant to beyond it)."""
    check_kernel_support(spec, batch)
    refuse_removed_kernel(kernel)
    if kernel not in KERNELS:
        raise MkportError(f"kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    check_batch(batch)
    check_invariant_to(batch, invariant_to)
    invariant_to = invariant_to if invariant_to > batch else 0
    grid = target.sm_count
    warps = THREADS // 32
    total_warps = grid * warps
    max_regs = min(255, target.regs_per_sm // THREADS)
    pv_width = _pv_width(spec)
    g = spec.gqa_ratio
    tile = _attention_tile(spec, target)
    smem = _smem_bytes(spec, target, batch)
    norm_weights_at = 0
    if batch == 1:  # the next norm's weights, after what the phases share (16-byte copies)
        norm_weights_at = -(-smem // 16) * 16
        smem = norm_weights_at + 2 * spec.hidden_size
    if smem + batch_static_smem(batch) > target.smem_per_block:
        fits = fitting_batches(spec, target, BATCH_SIZES)
        raise MkportError(
            f"{spec.name} at batch {batch} needs {smem} bytes of shared memory a block; {target.arch} allows "
            f"{target.smem_per_block} (widest activation {vectors_layout(spec, 1)['widest']} floats a sequence)"
            + (f": batch {'up' if fits[0] == 1 else fits[0]} to {fits[-1]} fits" if fits else "")
        )
    matvecs = {name: rows for name, rows in matvec_rows(spec).items() if name != "linear_out"}
    splits = {
        "o_proj": split_k(spec.hidden_size, spec.num_heads * spec.head_dim, total_warps, warps),
        "down": split_k(spec.hidden_size, spec.intermediate_size, total_warps, warps),
    }
    if spec.linear_layers:
        splits["linear_out"] = split_k(spec.hidden_size, spec.linear_attention.value_dim, total_warps, warps)
    return LaunchPlan(
        arch=target.arch,
        grid=grid,
        threads=THREADS,
        warps=warps,
        max_regs_per_thread=max_regs,
        attn_max_splits=attention_max_splits(spec, grid, tile),
        attn_tile=tile,
        attn_split_positions=ATTN_SPLIT_POSITIONS,
        attn_outputs_per_thread=pv_width * -(-g * spec.head_dim // (pv_width * THREADS)),
        smem_bytes=smem,
        split_k=splits,
        rows_per_warp={k: -(-rows // total_warps) for k, rows in matvecs.items()},
        kernel=kernel,
        batch=batch,
        norm_weights_at=norm_weights_at,
        linear_columns=linear_columns(spec, grid) if spec.linear_layers else 0,
        invariant_to=invariant_to,
    )
