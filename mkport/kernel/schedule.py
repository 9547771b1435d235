"""The v2 kernel's schedule: which block does what, and what each task waits for.

Computed once in Python from the spec and the launch plan, rendered into the kernel as constant tables and
written beside the sources as schedule.json, so a person can read who does what.

Every block runs the same program, layer after layer, over its own slices of the work:

    qkv rows -> attention items (kv head, split) -> o_proj rows -> gate and up rows -> down rows (K-slice)

and, after the last layer, its rows of the output head. A task waits only for the data it reads, through
counters in global memory (release/acquire), never for the whole grid:

- qkv of layer l reads the residual stream x_l = x_mid_{l-1} + the MLP's partial sums of layer l-1, so it waits
  for `mlp_done[l-1]` (every block that wrote down rows). Layer 0 reads the input row itself and waits for
  nothing, unless an input projection runs first (then `mlp_done[-1]` counts its row blocks).
- an attention item of kv head h waits for `qkv_done[l][h]`: only the blocks whose qkv rows touch head h.
- o_proj waits for `attn_done[l]` (one count per kv head, from the block that combines its splits).
- gate/up waits for `o_done[l]` (every block that wrote o_proj rows: it needs all of x_mid_l for the norm).
- the MLP is cut into `mlp_groups` groups of blocks. Group g owns intermediate columns K_g: its blocks compute
  the gate/up rows of K_g, then each block applies the down projection's columns K_g to its share of the output
  rows, leaving partial sums P_g. So down waits only for its own group (`act_done[l][g]`), and the next layer
  sums the groups' partials in a fixed order (deterministic, no float atomics).

Weights do not depend on activations: each block streams its next tasks' weights into a ring of shared-memory
slots (`cp.async`, completion on an mbarrier per slot) while it waits for their inputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import MkportError
from .spec import ModelSpec


def split_evenly(n: int, parts: int) -> list[int]:
    """Boundaries b[0..parts] of n items in `parts` contiguous ranges whose sizes differ by at most one."""
    return [i * n // parts for i in range(parts + 1)]


@dataclass(frozen=True)
class Schedule:
    grid: int
    mlp_groups: int
    qkv_rows: list[int]  # block b computes qkv rows [qkv_rows[b], qkv_rows[b+1])
    o_rows: list[int]  # o_proj rows, likewise
    head_rows: list[int]  # output-head rows (empty ranges when there is no head)
    in_rows: list[int]  # input-projection rows (all empty without one)
    mlp_group_of: list[int]  # block -> MLP group
    mlp_k: list[int]  # group g owns intermediate columns [mlp_k[g], mlp_k[g+1]), multiples of 8
    gate_rows: list[tuple[int, int]]  # block -> intermediate rows of gate and up it computes
    down_rows: list[tuple[int, int]]  # block -> down rows it applies its group's columns to
    qkv_kv_heads: list[list[int]]  # block -> kv heads its qkv rows touch (it signals each)
    # counter targets
    qkv_target: list[int]  # per kv head: blocks whose qkv rows touch it
    o_target: int
    act_target: list[int]  # per group: blocks with gate/up rows
    mlp_target: int  # blocks with down rows
    in_target: int
    head_target: int
    counters: dict  # name -> (offset, count) in the one counter array

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def counter_words(self) -> int:
        return sum(n for _, n in self.counters.values())


def _kv_head_of_row(spec: ModelSpec, row: int) -> int:
    """The kv head whose attention reads qkv row `row` (q rows of its G query heads, then its k and v rows)."""
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if row < q_rows:
        return row // (spec.gqa_ratio * spec.head_dim)
    return ((row - q_rows) % kv_rows) // spec.head_dim


def make_schedule(spec: ModelSpec, grid: int, mlp_groups: int) -> Schedule:
    if spec.num_kv_heads > 64:
        raise MkportError(f"{spec.name}: {spec.num_kv_heads} kv heads; the v2 kernel serves up to 64")
    groups = max(1, min(mlp_groups, grid, spec.intermediate_size // 8))
    qkv = split_evenly(spec.qkv_rows, grid)
    heads_of = []
    for b in range(grid):
        heads_of.append(sorted({_kv_head_of_row(spec, r) for r in range(qkv[b], qkv[b + 1])}))
    qkv_target = [sum(h in hs for hs in heads_of) for h in range(spec.num_kv_heads)]
    o_rows = split_evenly(spec.hidden_size, grid)
    head_rows = split_evenly(spec.vocab_size if spec.output_mode == "logits" else 0, grid)
    in_rows = split_evenly(spec.hidden_size if spec.input_projection else 0, grid)
    group_blocks = split_evenly(grid, groups)
    k_units = split_evenly(spec.intermediate_size // 8, groups)
    mlp_k = [8 * u for u in k_units]
    group_of, gate_rows, down_rows = [], [], []
    for g in range(groups):
        members = range(group_blocks[g], group_blocks[g + 1])
        gate_split = split_evenly(mlp_k[g + 1] - mlp_k[g], len(members))
        down_split = split_evenly(spec.hidden_size, len(members))
        for j, _ in enumerate(members):
            group_of.append(g)
            gate_rows.append((mlp_k[g] + gate_split[j], mlp_k[g] + gate_split[j + 1]))
            down_rows.append((down_split[j], down_split[j + 1]))
    act_target = [sum(1 for b in range(grid) if group_of[b] == g and gate_rows[b][1] > gate_rows[b][0])
                  for g in range(groups)]
    nonempty = lambda bounds: sum(1 for b in range(grid) if bounds[b + 1] > bounds[b])  # noqa: E731
    L, nkv = spec.num_layers, spec.num_kv_heads
    sizes = {"mlp_done": L + 1, "qkv_done": L * nkv, "attn_split": nkv, "attn_done": L, "o_done": L,
             "act_done": L * groups, "head_done": 1}
    counters, at = {}, 0
    for name, n in sizes.items():
        counters[name] = (at, n)
        at += n
    return Schedule(
        grid=grid,
        mlp_groups=groups,
        qkv_rows=qkv,
        o_rows=o_rows,
        head_rows=head_rows,
        in_rows=in_rows,
        mlp_group_of=group_of,
        mlp_k=mlp_k,
        gate_rows=gate_rows,
        down_rows=down_rows,
        qkv_kv_heads=heads_of,
        qkv_target=qkv_target,
        o_target=nonempty(o_rows),
        act_target=act_target,
        mlp_target=sum(1 for r in down_rows if r[1] > r[0]),
        in_target=nonempty(in_rows),
        head_target=grid,  # every block reports its best logit, an empty range too
        counters=counters,
    )


def check_schedule(spec: ModelSpec, s: Schedule) -> None:
    """Every output row is computed by exactly one block and every counter target is reachable; raises
    MkportError naming the first problem (a schedule bug, never the user's)."""
    def covers(ranges: list[tuple[int, int]], n: int, what: str) -> None:
        seen = [0] * n
        for a, b in ranges:
            for r in range(a, b):
                seen[r] += 1
        if any(c != 1 for c in seen):
            raise MkportError(f"v2 schedule: {what} rows are not covered exactly once")

    pairs = lambda bounds: [(bounds[b], bounds[b + 1]) for b in range(s.grid)]  # noqa: E731
    covers(pairs(s.qkv_rows), spec.qkv_rows, "qkv")
    covers(pairs(s.o_rows), spec.hidden_size, "o_proj")
    covers(s.gate_rows, spec.intermediate_size, "gate/up")
    for g in range(s.mlp_groups):
        members = [b for b in range(s.grid) if s.mlp_group_of[b] == g]
        covers([s.down_rows[b] for b in members], spec.hidden_size, f"down (group {g})")
        if any(not (s.mlp_k[g] <= s.gate_rows[b][0] and s.gate_rows[b][1] <= s.mlp_k[g + 1]) for b in members):
            raise MkportError(f"v2 schedule: a block of group {g} has gate/up rows outside the group's columns")
    if any(k % 8 for k in s.mlp_k):
        raise MkportError("v2 schedule: MLP group columns must start at multiples of 8 (16-byte rows)")
    if any(t == 0 for t in s.qkv_target) or any(t == 0 for t in s.act_target) or s.o_target == 0:
        raise MkportError("v2 schedule: a counter nobody signals would hang its waiters")


def block_program(spec: ModelSpec, s: Schedule, block: int, splits: int) -> list[tuple[str, str, int]]:
    """What block `block` waits for and signals during one step, in order: ("wait", counter, target) and
    ("signal", counter, 0), counters named "kind[index]". The same sequence as the v2 kernel's tasks
    (decode_step_v2.cu), so the CPU can check that every wait is reached (simulate_step)."""
    L, nkv, b = spec.num_layers, spec.num_kv_heads, block
    has = lambda bounds: bounds[b + 1] > bounds[b]  # noqa: E731
    prog: list[tuple[str, str, int]] = []
    if has(s.in_rows):
        prog.append(("signal", "mlp_done[0]", 0))
    gate, down, g = s.gate_rows[b], s.down_rows[b], s.mlp_group_of[b]
    for layer in range(L):
        if has(s.qkv_rows) or has(s.o_rows):
            if layer > 0 or spec.input_projection:
                prog.append(("wait", f"mlp_done[{layer}]", s.in_target if layer == 0 else s.mlp_target))
            prog += [("signal", f"qkv_done[{layer}][{h}]", 0) for h in s.qkv_kv_heads[b]]
        items = range(b, nkv * splits, s.grid)
        for item in items:
            kvh = item // splits
            prog.append(("wait", f"qkv_done[{layer}][{kvh}]", s.qkv_target[kvh]))
            prog.append(("split", f"attn_split[{layer}][{kvh}]", splits))  # the last of the splits signals
        if has(s.o_rows):
            prog.append(("wait", f"attn_done[{layer}]", nkv))
            prog.append(("signal", f"o_done[{layer}]", 0))
        if gate[1] > gate[0]:
            prog.append(("wait", f"o_done[{layer}]", s.o_target))
            prog.append(("signal", f"act_done[{layer}][{g}]", 0))
        if down[1] > down[0]:
            prog.append(("wait", f"act_done[{layer}][{g}]", s.act_target[g]))
            prog.append(("signal", f"mlp_done[{layer + 1}]", 0))
    if b == 0 or has(s.head_rows):
        prog.append(("wait", f"mlp_done[{L}]", s.mlp_target))
    prog.append(("signal", "head_done", 0))
    if b == 0:
        prog.append(("wait", "head_done", s.head_target))
    return prog


def simulate_step(spec: ModelSpec, s: Schedule, splits: int) -> dict[str, int]:
    """Runs every block's program (block_program) with counters, any block that can move moving, until all
    are done; raises MkportError naming a waiting block when none can move (the kernel would hang). Returns
    the final counter values."""
    progs = [block_program(spec, s, b, splits) for b in range(s.grid)]
    at = [0] * s.grid
    counters: dict[str, int] = {}
    moved = True
    while moved:
        moved = False
        for b, prog in enumerate(progs):
            while at[b] < len(prog):
                kind, name, target = prog[at[b]]
                if kind == "wait" and counters.get(name, 0) < target:
                    break
                if kind == "signal":
                    counters[name] = counters.get(name, 0) + 1
                elif kind == "split":  # attention: the last split of a kv head signals attn_done
                    counters[name] = counters.get(name, 0) + 1
                    if counters[name] == target:
                        layer = name[len("attn_split["):].split("]")[0]
                        counters[f"attn_done[{layer}]"] = counters.get(f"attn_done[{layer}]", 0) + 1
                at[b] += 1
                moved = True
    stuck = [b for b in range(s.grid) if at[b] < len(progs[b])]
    if stuck:
        b = stuck[0]
        raise MkportError(f"v2 schedule: block {b} would wait forever at {progs[b][at[b]]}")
    return counters
