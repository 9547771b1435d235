"""Kernel-vs-reference comparison, the tolerance policy, and fault injection.

Both sides give traced states name -> [S, width] (S steps/positions), named by mkport.kernel.interface.Tap (as
mkport.runtime.torch_model.forward and mkport.check.reference name them), optionally with the logits. The verdict names
the first row, in schedule order, outside tolerance. docs/validation.md explains the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..errors import MkportError
from ..kernel.interface import Tap
from ..kernel.launch_plan import DEFAULT_KERNEL
from ..kernel.spec import LENGTH_DEPENDENT_ROPE, ModelSource, ModelSpec
from ..runtime.weights import Checkpoint, DecoderWeights, LayerWeights

LAYER_OPS = Tap.LAYER

# Tolerance policy (see docs/validation.md). The kernel runs the same bf16 weights as the float32
# reference and accumulates in fp32; the one systematic difference is the bf16 KV cache (relative
# rounding 2^-9 per element). On random weights that gives rel_l2 ~2e-3 to 3e-3 on every tap after the
# first attention, nearly flat with depth (measured on 28 layers). The bound leaves ~4x head-room at
# layer 0 and grows linearly with depth, for trained models whose peaky attention amplifies K rounding.
REL_L2_BASE = 1e-2
DEPTH_GROWTH = 0.05  # per layer: 1e-2 at layer 0, 2.35e-2 at layer 27
COSINE_FACTOR = 2.0  # a row may be off by up to 2x tol: 1 - cos <= (2 tol)^2 / 2

# Fault injection: Gaussian noise of this size relative to the perturbed weight's RMS. Large enough that a
# perturbed o_proj / down_proj still moves a deep residual stream (whose norm dwarfs one sublayer's
# output) by several times the tolerance.
INJECT_SCALE = 1.0

# Past this many bytes of bf16 weights (no bundled spec: mistral-7b's are 14.5 GB) kernel_diff's reference runs a layer
# at a time (Reference(layered=True), the same taps bit for bit): a whole float32 copy beside the kernel's weights, and
# the host memory to build it, no longer fit.
LAYERED_REFERENCE_BYTES = 16e9


# Router flips (docs/validation.md). A flip is a row whose set of top-k experts differs from the reference's; it is a
# tie when the reference's margin, the gap between its k-th and (k+1)-th router logit, is one that the error the
# tolerance allows on those two logits can close: TIE_FACTOR x tol(depth) x the RMS of the row's reference logits.
# Calibrated on CPU (cpu_decode_taps: bf16 KV cache, routing forced to the reference's; tiny configs of the four
# families, 2 seeds, 32 steps): router logits within 0.3-0.43 of tol in rel_l2, a row's largest logit error up to
# 1.36 x tol x RMS, so up to ~3.4x its RMS error. At the tolerance each of the two logits may move ~4 x tol x RMS:
# margins up to 8 x tol x RMS can flip without a fault. Those runs saw 2 such flips (qwen2_moe, seed 1).
TIE_FACTOR = 8.0


def tie_margin(depth: int, reference_logits: torch.Tensor) -> torch.Tensor:
    """Per row of reference router logits [S, experts]: the largest margin at which a flip is still a tie."""
    rms = reference_logits.double().pow(2).mean(dim=-1).sqrt()
    return TIE_FACTOR * tolerance(depth) * rms


def tolerance(depth: int) -> float:
    """rel_l2 bound for a tap `depth` layers deep (embed: 0, layer i: i, final_norm / logits: num_layers)."""
    return REL_L2_BASE * (1.0 + DEPTH_GROWTH * depth)


def cosine_bound(tol: float) -> float:
    """Lowest allowed per-row cosine for a rel_l2 bound."""
    return 1.0 - (COSINE_FACTOR * tol) ** 2 / 2.0


def schedule(spec: ModelSpec, logits: bool = True) -> list[tuple[int | None, str, str]]:
    """(layer, op, tap name) in the kernel's order."""
    rows: list[tuple[int | None, str, str]] = [(None, Tap.EMBED, Tap.EMBED)]
    for i in range(spec.num_layers):
        ops = Tap.layer_ops(spec, i)
        ops = ops[:-1] + (Tap.MOE_LAYER if spec.sparse(i) else ()) + ops[-1:]
        rows += [(i, op, Tap.layer(i, op)) for op in ops]
    rows.append((None, Tap.FINAL_NORM, Tap.FINAL_NORM))
    if logits:
        rows.append((None, Tap.LOGITS, Tap.LOGITS))
    return rows


@dataclass
class DiffRow:
    layer: int | None
    op: str
    max_abs: float
    rel_l2: float
    cosine: float  # the lowest over rows (steps)
    tol: float  # rel_l2 bound; the cosine bound follows from it (cosine_bound)
    ok: bool
    # the experts row (router flips): rows whose top-k set differs from the reference's, split by the tie margin
    ties: int = 0
    divergences: int = 0

    @property
    def name(self) -> str:
        return self.op if self.layer is None else Tap.layer(self.layer, self.op)

    @property
    def status(self) -> str:
        return "ok" if self.ok else "FAIL"


@dataclass
class DiffReport:
    rows: list[DiffRow] = field(default_factory=list)
    steps: int = 0

    @property
    def first_failure(self) -> DiffRow | None:
        return next((r for r in self.rows if not r.ok), None)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and self.first_failure is None

    def verdict(self) -> str:
        bad = self.first_failure
        ties = sum(r.ties for r in self.rows)
        tie_note = f" ({ties} router flips within the tie margin)" if ties else ""
        if bad is None:
            return f"PASS: {len(self.rows)} traced states over {self.steps} steps within tolerance{tie_note}"
        where = "" if bad.layer is None else f"layer {bad.layer} "
        if bad.op == Tap.EXPERTS:
            return (f"FAIL: first divergence at {where}experts: {bad.divergences} router flips with a reference margin "
                    f"above the tie margin (largest {bad.max_abs:.3g} logits){tie_note}")
        return (
            f"FAIL: first divergence at {where}{bad.op}: rel_l2 {bad.rel_l2:.3g} (tol {bad.tol:.3g}), "
            f"min cosine {bad.cosine:.6f}, max abs {bad.max_abs:.3g}"
        )

    def to_dict(self) -> dict:
        def clean(x):
            return x if not isinstance(x, float) or math.isfinite(x) else str(x)

        bad = self.first_failure
        return {
            "passed": self.passed,
            "steps": self.steps,
            "verdict": self.verdict(),
            "first_failure": None if bad is None else {"layer": bad.layer, "op": bad.op},
            "policy": {
                "rel_l2_base": REL_L2_BASE,
                "depth_growth": DEPTH_GROWTH,
                "cosine_factor": COSINE_FACTOR,
                "tie_factor": TIE_FACTOR,
            },
            "router_ties": sum(r.ties for r in self.rows),
            "rows": [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in self.rows],
        }

    def to_text(self) -> str:
        lines = [f"{'layer':>5}  {'op':<14} {'max_abs':>10} {'rel_l2':>10} {'min_cos':>10} {'tol':>9}  status"]
        for r in self.rows:
            layer = "-" if r.layer is None else str(r.layer)
            lines.append(
                f"{layer:>5}  {r.op:<14} {r.max_abs:10.3e} {r.rel_l2:10.3e} {r.cosine:10.6f} {r.tol:9.2e}  {r.status}"
            )
        lines.append(self.verdict())
        return "\n".join(lines)


def _metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """max_abs, rel_l2 over all rows, lowest per-row cosine; a = kernel, b = reference."""
    a, b = a.double(), b.double()
    d = a - b
    max_abs = d.abs().max().item() if d.numel() else 0.0
    nb = b.norm().item()
    nd = d.norm().item()
    rel = (0.0 if nd == 0 else math.inf) if nb == 0 else nd / nb
    na, nbr = a.norm(dim=1), b.norm(dim=1)
    dot = (a * b).sum(dim=1)
    both_zero = (na == 0) & (nbr == 0)
    cos = torch.where(both_zero, torch.ones_like(dot), dot / (na * nbr).clamp_min(1e-300))
    cos = torch.where(((na == 0) | (nbr == 0)) & ~both_zero, torch.zeros_like(dot), cos)
    if not torch.isfinite(a).all():
        return math.nan, math.nan, math.nan
    return max_abs, rel, cos.min().item() if cos.numel() else 1.0


def route_flips(kernel_experts: torch.Tensor, reference_experts: torch.Tensor, reference_logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [S] whose top-k expert set (ids [S, k], ascending) differs from the reference's, and the reference's
    margin on each row (its k-th minus its (k+1)-th router logit; k = all experts: no margin, infinite)."""
    k = reference_experts.shape[1]
    flipped = (kernel_experts.long() != reference_experts.long()).any(dim=1)
    ranked = reference_logits.double().sort(dim=-1, descending=True).values
    margin = ranked[:, k - 1] - ranked[:, k] if k < ranked.shape[1] else torch.full_like(ranked[:, 0], math.inf)
    return flipped, margin


def _routing_row(layer: int, kernel: torch.Tensor, reference: torch.Tensor, logits: torch.Tensor, depth: int) -> DiffRow:
    """The experts row: a flip within tie_margin is a tie, one above it a divergence. max_abs is the largest
    divergent margin, rel_l2 the fraction of rows flipped, tol the largest tie margin over the rows."""
    flipped, margin = route_flips(kernel, reference, logits)
    ties_allowed = tie_margin(depth, logits)
    tie = flipped & (margin <= ties_allowed)
    diverged = flipped & ~tie
    worst = margin[diverged].max().item() if bool(diverged.any()) else 0.0
    return DiffRow(layer, Tap.EXPERTS, worst, flipped.double().mean().item(), 1.0, ties_allowed.max().item(),
                   not bool(diverged.any()), ties=int(tie.sum()), divergences=int(diverged.sum()))


def compare(kernel: dict, reference: dict, spec: ModelSpec) -> DiffReport:
    """Compares every traced state both sides share a name for, in schedule order. A sparse layer's experts are
    compared as router flips (_routing_row), the rest by rel_l2 and cosine; its expert weights and block output
    compare only when the kernel side applied the reference's experts (forced routing, as cpu_decode_taps does
    with `routing`), while its experts tap holds its own router's choice."""
    report = DiffReport()
    for layer, op, name in schedule(spec):
        if name not in reference and name not in kernel:
            continue
        if name not in reference or name not in kernel:
            side = "reference" if name not in reference else "kernel"
            raise MkportError(f"traced state '{name}' is missing on the {side} side")
        a, b = kernel[name].detach().cpu(), reference[name].detach().cpu()
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        if a.shape != b.shape:
            raise MkportError(f"traced state '{name}': kernel shape {list(a.shape)} != reference {list(b.shape)}")
        report.steps = max(report.steps, a.shape[0])
        depth = layer if layer is not None else (0 if op == Tap.EMBED else spec.num_layers)
        if op == Tap.EXPERTS:
            report.rows.append(_routing_row(layer, a, b, reference[Tap.layer(layer, Tap.ROUTER)].detach().cpu(), depth))
            continue
        tol = tolerance(depth)
        max_abs, rel, cos = _metrics(a, b)
        ok = rel <= tol and cos >= cosine_bound(tol)  # NaN compares False: a NaN is a failure
        report.rows.append(DiffRow(layer, op, max_abs, rel, cos, tol, ok))
    if not report.rows:
        raise MkportError("nothing to compare: no traced state names in common")
    return report


# ----------------------------------------------------------------------------------------------------
# Fault injection


# A linear-attention layer's ops that own weights to perturb, and the fields and rows (None: all) that carry them.
# state_out has none of its own (it reads q, k, v and the gates): a fault there is a fault in the recurrence itself.
def _linear_inject_targets(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, int] | None]]:
    la = spec.linear_attention
    gates = la.conv_dim + la.value_dim
    return {Tap.ATTN_NORM: ("attn_norm", None), Tap.CONV: ("lin_conv", None),
            Tap.GATES: ("lin_in", (gates, la.in_rows)), Tap.GATED_NORM: ("lin_norm", None),
            Tap.ATTN_RESIDUAL: ("lin_out", None), Tap.MLP_RESIDUAL: ("w_down", None)}


def injectable_ops(spec: ModelSpec | None, layer: int | None = None) -> tuple[str, ...]:
    if spec is not None and not spec.pre_norms:  # olmo2/3: no input norm to perturb
        return tuple(op for op in LAYER_OPS if op != Tap.ATTN_NORM)
    if spec is None or layer is None or not spec.is_linear(layer):
        return LAYER_OPS
    return tuple(_linear_inject_targets(spec))


def parse_inject(text: str, spec: ModelSpec | None = None) -> tuple[int, str]:
    """'3:q' -> (3, 'q'); the layer range, and the op for that layer's kind, are checked when the spec is given."""
    layers = f"0..{spec.num_layers - 1}" if spec is not None else "0..num_layers-1"
    ops = LAYER_OPS + (tuple(op for op in Tap.LINEAR_LAYER if op not in LAYER_OPS) if spec and spec.linear_layers else ())
    usage = f"--inject must be LAYER:OP with LAYER in {layers} and OP one of {', '.join(ops)}; got '{text}'"
    parts = str(text).strip().split(":")
    if len(parts) != 2 or parts[1] not in ops:
        raise MkportError(usage)
    try:
        layer = int(parts[0])
    except ValueError:
        raise MkportError(usage) from None
    if layer < 0 or (spec is not None and layer >= spec.num_layers):
        raise MkportError(usage)
    allowed = injectable_ops(spec, layer)
    if parts[1] not in allowed:
        kind = "a linear-attention" if spec.is_linear(layer) else "an attention"
        raise MkportError(f"--inject {text}: layer {layer} is {kind} layer; its ops with weights to perturb are "
                          f"{', '.join(allowed)}")
    return layer, parts[1]


def inject(weights: DecoderWeights, spec: ModelSpec, layer: int, op: str, seed: int, scale: float = INJECT_SCALE) -> DecoderWeights:
    """A copy of the kernel weights with one op's weights perturbed by Gaussian noise of `scale` times
    their RMS. The first traced state this changes is exactly (layer, op):
    attn_norm: input_layernorm; q / k: the q / k rows of wqkv; attn: the v rows; attn_residual: wo;
    mlp_residual: w_down (a sparse layer's: the shared expert's, else every expert's down; it shows first in the
    expert block's output, fault_tap). A linear-attention layer (qwen3_5): conv: the conv's taps; gates: the b and a rows of
    lin_in; gated_norm: lin_norm; attn_residual: lin_out."""
    if not 0 <= layer < len(weights.layers) or op not in injectable_ops(spec, layer):
        raise MkportError(
            f"cannot inject at {layer}:{op}: layers 0..{len(weights.layers) - 1}, ops "
            f"{', '.join(injectable_ops(spec, layer if 0 <= layer < len(weights.layers) else None))}"
        )
    lw = weights.layers[layer]
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    # a sparse layer's down: its shared expert's (qwen2_moe), else every expert's (whichever the router picks)
    down = "expert_down" if spec.sparse(layer) and lw.w_down is None else "w_down"
    field_name, rows = _linear_inject_targets(spec)[op] if spec.is_linear(layer) else {
        Tap.ATTN_NORM: ("attn_norm", None),
        Tap.Q: ("wqkv", (0, q_rows)),
        Tap.K: ("wqkv", (q_rows, q_rows + kv_rows)),
        Tap.ATTN: ("wqkv", (q_rows + kv_rows, q_rows + 2 * kv_rows)),
        Tap.ATTN_RESIDUAL: ("wo", None),
        Tap.MLP_RESIDUAL: (down, None),
    }[op]
    original = getattr(lw, field_name)
    w = original.float().clone()
    part = w if rows is None else w[rows[0] : rows[1]]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(part.shape, generator=gen).to(part.device)
    part += scale * part.pow(2).mean().sqrt() * noise
    new_layer = LayerWeights(**{**vars(lw), field_name: w.to(original.dtype).contiguous()})
    layers = list(weights.layers)
    layers[layer] = new_layer
    return dataclasses.replace(weights, layers=layers)


def fault_tap(spec: ModelSpec, layer: int, op: str) -> str:
    """The op whose traced state a fault injected at (layer, op) changes first: a sparse layer's down shows in the
    expert block's output (moe) before the residual."""
    return Tap.MOE if op == Tap.MLP_RESIDUAL and spec.sparse(layer) else op


# ----------------------------------------------------------------------------------------------------
# The kernel's numerics on CPU


def reference_routing(spec: ModelSpec, reference_taps: dict) -> dict:
    """{layer: expert ids [N, top_k]} that the reference chose in each sparse layer, to force on the other side."""
    return {i: reference_taps[Tap.layer(i, Tap.EXPERTS)].long() for i in range(spec.num_layers) if spec.sparse(i)}


def cpu_decode_taps(spec: ModelSpec, weights: DecoderWeights, x: torch.Tensor, positions: torch.Tensor,
                    routing: dict | None = None) -> dict:
    """Runs x [N, hidden] one token at a time through mkport.runtime.torch_model.forward with a bf16 KV cache,
    as the kernel's decode steps do, and returns the stacked taps name -> [N, width]. This is the CPU
    stand-in for a kernel trace (used to calibrate the tolerance and in the CPU tests). `routing`
    (reference_routing) forces each sparse layer's experts, row by row."""
    from ..runtime import torch_model

    n = x.shape[0]
    shape = (spec.num_layers, spec.num_kv_heads, n, spec.head_dim)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=x.device)
    v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=x.device)
    state = torch_model.LinearState.zeros(spec, x.device) if spec.linear_layers else None  # fp32, as the kernel's
    rows: dict[str, list] = {}
    for t in range(n):
        taps: dict = {}
        forced = None if routing is None else {i: ids[t : t + 1] for i, ids in routing.items()}
        torch_model.forward(spec, weights, x[t : t + 1], positions[:, t : t + 1], k_cache, v_cache, start=t, taps=taps,
                            routing=forced, state=state)
        for name, value in taps.items():
            rows.setdefault(name, []).append(value)
    return {name: torch.cat(values) for name, values in rows.items()}


def calibrate(source: ModelSource, checkpoint: Checkpoint, steps: int = 32, seed: int = 0,
              fault_layers: tuple[int, ...] | None = None) -> dict:
    """The numbers behind the tolerance policy, for one model: the CPU stand-in for the kernel
    (cpu_decode_taps, bf16 KV cache) against the float32 reference on fresh random tokens, and, for each
    op at the first, middle and last layer, how far above its tolerance an injected fault lands."""
    from ..runtime import torch_model
    from .reference import Reference
    from ..runtime.weights import load_weights

    ref = Reference(source, checkpoint)
    spec = source.spec
    weights = load_weights(spec, checkpoint)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (steps,), generator=gen)
    positions = torch.arange(steps).expand(3, steps)
    # every row a step of its own, as cpu_decode_taps runs them (kernel_diff says why it matters for longrope, dynamic)
    out = ref.run(tokens=tokens, positions=positions, steps_from=1 if spec.rope.variant in LENGTH_DEPENDENT_ROPE else None)
    reference = dict(out.taps, logits=out.logits)
    x = torch_model.embed_inputs(spec, weights, tokens=tokens)
    kernel = cpu_decode_taps(spec, weights, x, positions)
    kernel[Tap.LOGITS] = torch_model.logits(spec, weights, kernel[Tap.FINAL_NORM])
    clean = compare(kernel, reference, spec)
    faults = []
    layers = fault_layers if fault_layers is not None else sorted({0, spec.num_layers // 2, spec.num_layers - 1})
    for layer in layers:
        for op in injectable_ops(spec, layer):
            faulty = inject(weights, spec, layer, op, seed=seed + 1)
            taps: dict = {}
            hidden = torch_model.forward(spec, faulty, x, positions, taps=taps)
            taps[Tap.LOGITS] = torch_model.logits(spec, faulty, hidden)
            report = compare(taps, reference, spec)
            row = next(r for r in report.rows if r.layer == layer and r.op == op)
            first = report.first_failure
            faults.append(
                {"layer": layer, "op": op, "rel_l2": row.rel_l2, "tol": row.tol, "ratio": row.rel_l2 / row.tol,
                 "first_failure": None if first is None else first.name}
            )
    worst = max(clean.rows, key=lambda r: r.rel_l2 / r.tol)
    return {
        "model": spec.name,
        "steps": steps,
        "clean": clean,
        "clean_max_rel_l2": max(r.rel_l2 for r in clean.rows),
        "clean_worst_ratio": worst.rel_l2 / worst.tol,
        "clean_min_cosine": min(r.cosine for r in clean.rows),
        "faults": faults,
    }


def _main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    from ..kernel.spec import open_model
    from ..runtime.weights import Checkpoint, write_random_weights

    parser = argparse.ArgumentParser(prog="python -m mkport.check.diff", description="Calibrate the tolerance policy on CPU.")
    parser.add_argument("model", help="bundled spec name, config.json, folder, or folder:talker / :code_predictor")
    parser.add_argument("weights_dir", type=Path)
    parser.add_argument("--random", action="store_true", help="write seeded random weights first if the folder has none")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source = open_model(args.model)
    if args.random and not (args.weights_dir / "model.safetensors").exists():
        write_random_weights(source.spec, args.weights_dir, seed=args.seed)
    result = calibrate(source, Checkpoint.open(args.weights_dir), args.steps, args.seed)
    clean = result.pop("clean")
    print(clean.to_text())
    faults = result.pop("faults")
    print(json.dumps(result))
    for f in faults:
        print(
            f"fault {f['layer']}:{f['op']:<13} rel_l2 {f['rel_l2']:.3e}  tol {f['tol']:.2e}  "
            f"ratio {f['ratio']:6.1f}  first failure {f['first_failure']}"
        )
    caught = all(f["first_failure"] == Tap.layer(f["layer"], f["op"]) for f in faults)
    return 0 if clean.passed and caught else 1


if __name__ == "__main__":
    raise SystemExit(_main())


# ----------------------------------------------------------------------------------------------------
# The megakernel against the reference (GPU)


@dataclass
class KernelDiff:
    report: DiffReport
    steps: int
    prompt_len: int
    token_agreement: int  # steps where the kernel's argmax equals the reference's
    positions: str  # "equal" or "distinct" (MRoPE triplets)
    injected: tuple[int, str] | None = None
    batch: int = 1  # sequences run at once; token_agreement counts over all of them
    shows_at: str | None = None  # the op where the injected fault shows first (fault_tap)
    forced_routing: bool = False  # a mixture of experts: the kernel applied the reference's experts

    @property
    def caught_injection(self) -> bool:
        bad = self.report.first_failure
        return (self.injected is not None and bad is not None
                and (bad.layer, bad.op) == (self.injected[0], self.shows_at or self.injected[1]))

    def to_dict(self) -> dict:
        return {
            **self.report.to_dict(),
            "steps": self.steps,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "token_agreement": self.token_agreement,
            "positions": self.positions,
            "injected": None if self.injected is None else {"layer": self.injected[0], "op": self.injected[1]},
            "caught_injection": self.caught_injection if self.injected else None,
            "forced_routing": self.forced_routing,
        }


def reference_layered(source: ModelSource) -> bool:
    """kernel_diff's default: a layer at a time past LAYERED_REFERENCE_BYTES, where the family has that reference."""
    from .reference import can_layer
    from ..runtime.weights import checkpoint_bytes

    return checkpoint_bytes(source.spec) > LAYERED_REFERENCE_BYTES and can_layer(source)


def check_reference_fits(source: ModelSource) -> None:
    """A whole float32 reference (twice the bf16 checkpoint) beside the kernel's bf16 weights must fit the GPU's free
    memory: refused in one line before any weight is read, where the family has no layer-at-a-time reference."""
    from .reference import can_layer
    from ..runtime.weights import checkpoint_bytes

    if can_layer(source) or not torch.cuda.is_available():  # without a GPU, require_gpu has said so
        return
    weights, (free, _) = checkpoint_bytes(source.spec), torch.cuda.mem_get_info()
    if 3 * weights > free:
        raise MkportError(f"{source.spec.name}: its whole float32 reference ({2 * weights / 1e9:.1f} GB) beside its bf16 "
                          f"weights ({weights / 1e9:.1f} GB) needs more than the {free / 1e9:.1f} GB free on the GPU, "
                          f"and its model_type '{source.config.get('model_type')}' has no layer-at-a-time reference")


def check_positions(spec: ModelSpec, n: int, gen: torch.Generator) -> tuple[torch.Tensor, str]:
    """[3, n] rope positions for a check: for MRoPE, distinct t/h/w streams (as Qwen3-VL feeds them),
    so that a kernel that ignored the sections could not pass; otherwise 0..n-1 on every stream."""
    t = torch.arange(n)
    if spec.rope.variant != "mrope":
        return t.expand(3, n).clone(), "equal"
    h = t + torch.randint(0, 7, (n,), generator=gen)
    w = torch.randint(0, 2 * n, (n,), generator=gen)
    return torch.stack([t, h, w]), "distinct"


def check_diff_lengths(spec, prompt_len: int, steps: int, batch: int = 1) -> None:
    """--prompt-len and --steps, before anything is built or loaded: at least 1 each, and the positions they need
    (the batch's last sequence prefills batch - 1 more) within the model's context (ModelSpec.max_context). A
    mixture of experts is diffed at batch 1: its layers are compared on the reference's experts, which the kernel is
    forced to apply at batch 1 only (a batch's sequences are compared with each alone: tests/test_gpu_moe.py)."""
    if spec.moe is not None and batch > 1:
        raise MkportError(f"{spec.name}: --batch {batch}: a mixture of experts is diffed at batch 1 only (the forced "
                          "routing that compares every layer on the reference's experts runs at batch 1)")
    if prompt_len < 1 or steps < 1:
        raise MkportError(f"--prompt-len {prompt_len} and --steps {steps} must both be at least 1")
    positions = prompt_len + batch - 1 + steps
    if positions > spec.max_context:
        raise MkportError(f"--prompt-len {prompt_len} and --steps {steps} need {positions} positions, past "
                          f"{spec.max_context_text}; lower them")


def kernel_diff(
    source: ModelSource,
    checkpoint: Checkpoint,
    prompt_len: int = 16,
    steps: int = 8,
    seed: int = 0,
    layer_by_layer: bool = True,
    inject_at: tuple[int, str] | None = None,
    log=None,
    kernel: str = DEFAULT_KERNEL,
    batch: int = 1,
    layered: bool | None = None,
) -> KernelDiff:
    """Prefills fresh random tokens, runs `steps` megakernel decode steps with the trace build, and
    compares every traced state (or, without layer_by_layer, the final hidden state and logits) with the
    float32 reference over the same sequence, teacher-forced on the same tokens. With `batch` > 1 the batch
    decoder runs `batch` such sequences at once, sequence b with a prompt of prompt_len + b tokens (so they sit
    at different positions), and every sequence's states are compared with its own reference run, pooled. `layered`
    runs the reference a decoder layer at a time (None: reference_layered). A mixture of experts runs the reference
    first and forces its experts on the kernel (force_experts, and the prompt's in the prefill), so that every layer
    is compared on the same experts; each layer's own choice is still compared as router flips."""
    from .reference import Reference
    from ..runtime.backends import make_decoder
    from ..runtime.weights import load_weights

    spec = source.spec
    check_diff_lengths(spec, prompt_len, steps, batch)
    weights = load_weights(spec, checkpoint)
    if inject_at is not None:
        weights = inject(weights, spec, *inject_at, seed=seed)
    dec = make_decoder(spec, weights, "megakernel", prompt_len + batch - 1 + steps, batch, trace=True, log=log,
                       kernel=kernel)
    gen = torch.Generator().manual_seed(seed)
    prompts = [prompt_len + b for b in range(batch)]
    tokens = [torch.randint(0, spec.vocab_size, (p + steps,), generator=gen) for p in prompts]
    drawn = [check_positions(spec, p + steps, gen) for p in prompts]
    positions, kind = [d[0] for d in drawn], drawn[0][1]
    rows: list[dict[str, list]] = [{} for _ in range(batch)]
    model = Reference(source, checkpoint, device="cuda", layered=reference_layered(source) if layered is None else layered)
    # longrope and dynamic RoPE pick a forward's frequencies by its length (the largest position + 1): the prompt's
    # rows by the prompt's, a step's row by its own position + 1. A one-pass reference would rotate every row by the
    # whole sequence's, so the reference prefills and steps as the decoder does (transformers' own generate), Phi-3's
    # recompute of the cache at its longrope switch included (runtime.rope_switch)
    stepped = spec.rope.variant in LENGTH_DEPENDENT_ROPE

    def reference(b: int):
        return model.run(tokens=tokens[b], positions=positions[b], steps_from=prompts[b] if stepped else None,
                         switch_recompute=True)

    refs = [reference(b) for b in range(batch)] if spec.moe else None
    routing = reference_routing(spec, refs[0].taps) if spec.moe else None
    if batch == 1:
        prompt_routing = None if routing is None else {i: ids[:prompt_len] for i, ids in routing.items()}
        dec.prefill(tokens[0][:prompt_len], positions=positions[0][:, :prompt_len], routing=prompt_routing)
    else:
        for b, p in enumerate(prompts):
            dec.prefill_slot(b, tokens=tokens[b][:p], positions=positions[b][:, :p])
    vocab = spec.vocab_size
    for s in range(steps):
        if routing is not None:
            forced = torch.zeros(spec.num_layers, spec.moe.top_k, dtype=torch.int32)  # a dense layer's row: unread
            for i, ids in routing.items():
                forced[i] = ids[prompt_len + s]
            dec.force_experts(forced)
        if batch == 1:
            dec.step(int(tokens[0][prompt_len + s]), position=positions[0][:, prompt_len + s].tolist())
        else:
            dec.step_batch(tokens=[int(tokens[b][p + s]) for b, p in enumerate(prompts)],
                           positions=[positions[b][:, p + s].tolist() for b, p in enumerate(prompts)])
        for b in range(batch):
            taps = dec.trace_taps(b)
            taps[Tap.LOGITS] = dec.logits[b * vocab : (b + 1) * vocab].clone()
            for name, value in taps.items():
                rows[b].setdefault(name, []).append(value.float().cpu())
    kernel = {name: torch.cat([torch.stack(r[name]) for r in rows]) for name in rows[0]}
    refs = refs or [reference(b) for b in range(batch)]
    reference = {name: torch.cat([r.taps[name][p:].float().cpu() for r, p in zip(refs, prompts)]) for name in refs[0].taps}
    reference[Tap.LOGITS] = torch.cat([r.logits[p:].float().cpu() for r, p in zip(refs, prompts)])
    if not layer_by_layer:
        kernel = {k: kernel[k] for k in (Tap.FINAL_NORM, Tap.LOGITS)}
        reference = {k: reference[k] for k in (Tap.FINAL_NORM, Tap.LOGITS)}
    report = compare(kernel, reference, spec)
    agree = int((kernel[Tap.LOGITS].argmax(-1) == reference[Tap.LOGITS].argmax(-1)).sum())
    shows_at = None if inject_at is None else fault_tap(spec, *inject_at)
    return KernelDiff(report, steps, prompt_len, agree, kind, inject_at, batch, shows_at, routing is not None)
