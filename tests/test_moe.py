"""Mixture of experts (qwen3_moe, qwen2_moe, olmoe, mixtral, granitemoe, and Qwen3.5's hybrid qwen3_5_moe) on the CPU: specs from the published configs, the
refusals, the checkpoint mapping, routing in torch_model against transformers' own classes, ablations that must fail
where they bite, the router-flip rule, and the megakernel's plans (batch 1, and a batch: the union of its sequences' experts) and
builds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import MOE_CASES, MOE_CONFIGS, PUBLISHED_CONFIGS, assert_config_refused, moe_config, needs_nvcc, torch_path_taps
from mkport.check.diff import (TIE_FACTOR, compare, inject, reference_routing, route_flips,
                               tie_margin, tolerance)
from mkport.check.reference import Reference
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import Tap
from mkport.kernel.launch_plan import largest_batch, plan_launch
from mkport.kernel.spec import open_model, spec_from_config
from mkport.runtime import torch_model
from mkport.runtime.weights import Checkpoint, load_weights, random_checkpoint, to_kernel_layout


# -- specs from the published configs ------------------------------------------------------------------------------

def card_parameters(spec, all_experts: bool) -> float:
    """Parameters as a model card counts them, in billions: what a step reads, plus the rest of the embedding table
    (a step reads one row of it)."""
    return (spec.weight_bytes_per_step(all_experts) / 2 + (spec.vocab_size - 1) * spec.hidden_size) / 1e9


BUNDLED_MOE = {"qwen3-30b-a3b": "qwen3_moe", "qwen1.5-moe-a2.7b": "qwen2_moe", "olmoe-1b-7b": "olmoe",
               "mixtral-8x7b": "mixtral"}


@pytest.mark.parametrize("name", list(BUNDLED_MOE))
def test_bundled_spec_is_the_published_config(name):
    """The bundled file is the published config.json (MOE_CONFIGS, which leaves out transformers_version)."""
    source = open_model(name)
    assert {k: v for k, v in source.config.items() if k != "transformers_version"} == MOE_CONFIGS[BUNDLED_MOE[name]]
    assert source.spec == spec_from_config(MOE_CONFIGS[BUNDLED_MOE[name]], name)


def test_qwen3_30b_a3b():
    s = spec_from_config(MOE_CONFIGS["qwen3_moe"], "qwen3-30b-a3b")
    assert (s.family, s.qk_norm, s.qk_norm_span, s.qkv_bias) == ("qwen3_moe", True, "head", False)
    assert dataclasses.astuple(s.moe) == (128, 8, 768, True, tuple(range(48)), 0)
    # its model card: 30.5B parameters, 3.3B activated
    assert (card_parameters(s, True), card_parameters(s, False)) == (pytest.approx(30.5, rel=0.01), pytest.approx(3.3, rel=0.03))


def test_qwen1_5_moe_shared_expert_and_bias():
    s = spec_from_config(MOE_CONFIGS["qwen2_moe"], "qwen1.5-moe")
    assert (s.family, s.qkv_bias, s.qk_norm) == ("qwen2_moe", True, False)  # Qwen2MoeConfig.qkv_bias defaults true
    assert dataclasses.astuple(s.moe) == (60, 4, 1408, False, tuple(range(24)), 5632)
    assert not spec_from_config(dict(MOE_CONFIGS["qwen2_moe"], qkv_bias=False), "q").qkv_bias
    # its model card: 14.3B parameters, 2.7B activated
    assert (card_parameters(s, True), card_parameters(s, False)) == (pytest.approx(14.3, rel=0.01), pytest.approx(2.7, rel=0.01))


def test_olmoe_norms_the_whole_projection():
    s = spec_from_config(MOE_CONFIGS["olmoe"], "olmoe")
    assert (s.qk_norm, s.qk_norm_span) == (True, "projection")
    assert dataclasses.astuple(s.moe) == (64, 8, 1024, False, tuple(range(16)), 0)  # intermediate_size is the expert's
    # its model card: 6.9B parameters, 1.3B active
    assert (card_parameters(s, True), card_parameters(s, False)) == (pytest.approx(6.9, rel=0.01), pytest.approx(1.3, rel=0.03))


def test_mixtral_always_renormalises():
    s = spec_from_config(MOE_CONFIGS["mixtral"], "mixtral")
    assert dataclasses.astuple(s.moe) == (8, 2, 14336, True, tuple(range(32)), 0) and not s.sliding
    # its model card: 46.7B parameters, 12.9B active
    assert (card_parameters(s, True), card_parameters(s, False)) == (pytest.approx(46.7, rel=0.01), pytest.approx(12.9, rel=0.01))
    windowed = spec_from_config(dict(MOE_CONFIGS["mixtral"], sliding_window=4096), "m")
    assert windowed.attention_windows == (4096,) * 32  # MixtralModel: the window on every layer


def test_dense_layers_among_sparse_ones():
    """Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: sparse unless in mlp_only_layers, and only every
    decoder_sparse_step-th layer ((i + 1) % step == 0)."""
    cfg = dict(MOE_CONFIGS["qwen3_moe"], num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    s = spec_from_config(cfg, "q")
    assert s.moe.sparse_layers == (1, 5, 7) and s.sparse(1) and not s.sparse(3) and not s.sparse(0)
    all_sparse = spec_from_config(dict(cfg, decoder_sparse_step=1, mlp_only_layers=[]), "q")
    # 8 experts of 768 read as many MLP rows as the dense 6144: the 5 layers made sparse add their routers' bytes
    assert all_sparse.weight_bytes_per_step() - s.weight_bytes_per_step() == 5 * 128 * 2048 * 2
    assert spec_from_config(MOE_CONFIGS["qwen3_moe"], "q").moe.sparse_layers == tuple(range(48))


MOE_REFUSALS = {
    "deepseek": (dict(MOE_CONFIGS["qwen3_moe"], model_type="deepseek_v3", num_experts=None, n_routed_experts=256,
                      kv_lora_rank=512), "n_routed_experts=256: mixture of experts is supported for model_type"),
    "mla": (dict(MOE_CONFIGS["mixtral"], model_type="deepseek_v2", num_local_experts=None, kv_lora_rank=512),
            "kv_lora_rank=512: multi-head latent attention (MLA)"),
    "top-k": (dict(MOE_CONFIGS["mixtral"], num_experts_per_tok=9), "num_experts_per_tok=9 must be at most the 8"),
    "width": (dict(MOE_CONFIGS["qwen3_moe"], moe_intermediate_size=770), "moe_intermediate_size=770 is not supported"),
    "clip_qkv": (dict(MOE_CONFIGS["olmoe"], clip_qkv=8.0), "clip_qkv=8.0: clipping q/k/v is not supported"),
    "olmoe-window": (dict(MOE_CONFIGS["olmoe"], sliding_window=4096), "sliding_window=4096 is not supported for olmoe"),
    "olmoe-head-dim": (dict(MOE_CONFIGS["olmoe"], head_dim=64), "olmoe's q/k norm needs heads * head_dim"),
    "mixtral-dense": (dict(MOE_CONFIGS["mixtral"], mlp_only_layers=[0]), "not supported for mixtral"),
    "qwen3-moe-window": (dict(MOE_CONFIGS["qwen3_moe"], use_sliding_window=True), "use_sliding_window=true"),
    "qwen3-moe-bias": (dict(MOE_CONFIGS["qwen3_moe"], attention_bias=True), "attention_bias=true is not supported"),
}


@pytest.mark.parametrize("name", list(MOE_REFUSALS))
def test_unsupported_is_refused_by_name(name):
    assert_config_refused(*MOE_REFUSALS[name])


# -- the megakernel path: batch 1 (moe.cuh) and a batch (moe_batch.cuh: the union of the sequences' experts) ---------

def test_the_kernel_plans_moe_batches_as_shared_memory_allows():
    """largest_batch gives a mixture of experts its real largest batch on the H200: 16 (the vectors of 32 sequences
    of hidden 2048 are 256 KB), Mixtral's hidden 4096 up to 8; past it plan_launch says what fits in one line."""
    target = target_for_arch("sm_90")
    spec = spec_from_config(MOE_CONFIGS["qwen3_moe"], "qwen3-30b-a3b")
    assert plan_launch(spec, target).batch == 1 and plan_launch(spec, target, batch=8).batch == 8
    assert largest_batch(spec, target) == 16
    mixtral = spec_from_config(MOE_CONFIGS["mixtral"], "mixtral")
    assert largest_batch(mixtral, target) == 8
    with pytest.raises(MkportError) as e:
        plan_launch(mixtral, target, batch=16)
    assert "batch up to 8 fits" in str(e.value) and "\n" not in str(e.value)


WIDTH_REFUSALS = {  # config change -> the width the batch refusal names
    "qwen3_moe": ({"moe_intermediate_size": 776}, "moe_intermediate_size=776"),
    "olmoe": ({"intermediate_size": 1000}, "intermediate_size=1000"),
    "qwen2_moe": ({"shared_expert_intermediate_size": 5640}, "shared_expert_intermediate_size=5640"),
}


@pytest.mark.parametrize("case", list(WIDTH_REFUSALS))
def test_a_batch_refuses_expert_widths_not_multiples_of_32(case):
    """A batch's tensor-core down projection takes an expert's k in steps of 32 (a width like 776 read past each row):
    such widths plan at batch 1 and are refused at a batch in one line that names the width and what runs."""
    change, named = WIDTH_REFUSALS[case]
    spec = spec_from_config(dict(MOE_CONFIGS[case], **change), "m")
    target = target_for_arch("sm_90")
    assert plan_launch(spec, target).batch == 1 and largest_batch(spec, target) == 1
    with pytest.raises(MkportError) as e:
        plan_launch(spec, target, batch=2)
    message = str(e.value)
    assert named in message and "multiples of 32" in message and "batch 1 runs" in message and "\n" not in message


def test_more_experts_than_threads_are_refused():
    spec = spec_from_config(dict(MOE_CONFIGS["qwen3_moe"], num_experts=1024), "q")
    with pytest.raises(MkportError, match="routes up to 512"):
        plan_launch(spec, target_for_arch("sm_90"))


def _tiny_routing_spec(experts: int, top_k: int):
    return spec_from_config(dict(moe_config("qwen3_moe"), num_experts=experts, num_experts_per_tok=top_k), "t")


@pytest.mark.parametrize("experts,top_k,batch", [(4, 2, 2), (8, 3, 2), (60, 4, 8), (128, 8, 16), (8, 2, 32)])
def test_a_batchs_routing_layout(experts, top_k, batch):
    """moe_routing_layout, rendered as MOE_*_AT after the partial tiles: each sequence's logits and slots [batch][experts],
    its chosen experts and weights [batch][top_k], the union and its masks [experts], then the prefix sum's per-warp
    counts in an array of their own of 16 words, also where batch * experts < 16 (4 experts at batch 2: 8 slots, which
    a previous version's counts overran). The parts are in order without overlap and the plan's shared memory holds
    them."""
    from mkport.kernel.launch_plan import THREADS, mma_part_floats, moe_routing_layout, vectors_layout
    from mkport.kernel.render import render

    spec = _tiny_routing_spec(experts, top_k)
    layout = moe_routing_layout(spec, batch)
    sizes = {"logits": batch * experts, "slot": batch * experts, "experts": batch * top_k, "weights": batch * top_k,
             "union": experts, "mask": experts, "warp_counts": THREADS // 32}
    at = 0
    for part, size in sizes.items():
        assert layout[part] == at, (part, layout)
        at += size
    assert layout["words"] == at and layout["words"] - layout["warp_counts"] == 16
    plan = plan_launch(spec, target_for_arch("sm_90"), batch=batch)
    vectors = vectors_layout(spec, batch)
    assert vectors["moe"] == vectors["part"] + 16 * mma_part_floats(batch)  # after the partial tiles
    assert vectors["floats"] == vectors["moe"] + layout["words"] and 4 * vectors["floats"] <= plan.smem_bytes
    header = render(spec, plan).files["constants.cuh"]
    assert f"constexpr int MOE_SM = {vectors['moe']};" in header
    for part, offset in layout.items():
        assert f"constexpr int MOE_{part.upper()}_AT = {offset};" in header
    assert f"constexpr int MOE_ACT = {spec.moe.top_k * spec.moe.expert_intermediate_size};" in header


def test_a_batchs_act_holds_the_down_input_then_the_shared_experts_rows():
    from mkport.kernel.launch_plan import moe_act_floats

    spec = spec_from_config(MOE_CONFIGS["qwen2_moe"], "q")
    k, i, shared = 4, 1408, 5632
    assert moe_act_floats(spec) == 2 * k * i + 2 * shared + 1  # batch 1: gate and up rows, then the shared expert's
    # a batch: act(gate) * up, then the raw rows, rounded up to 4 floats: each sequence's part starts 16 bytes aligned
    # (the expert tiles read it as float4; an odd stride was a misaligned address on the H200)
    assert moe_act_floats(spec, 8) == k * i + shared + 2 * shared + 1 + 3
    assert all(moe_act_floats(spec_from_config(cfg, "q"), b) % 4 == 0 for cfg in MOE_CONFIGS.values() for b in (2, 8))


@pytest.mark.parametrize("command,message", [
    (["diff", "--random-weights", "--batch", "2"], "diffed at batch 1 only"),
    (["generate", "--batch", "4"], "intermediate_size=136: batched decode of a mixture of experts"),
])
def test_kernel_commands_refuse_what_a_moe_batch_does_not_run_in_one_line(tmp_path, command, message):
    """Before the GPU check: the message names what is missing, not a missing GPU."""
    from test_cli import run

    config = moe_config("mixtral")
    if command[0] == "generate":
        config["intermediate_size"] = 136
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run(command[0], str(tmp_path), *command[1:])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


# batch 16 where it fits (Mixtral's hidden 4096 fits 8)
BUNDLED_BATCHES = [(name, batch) for name in BUNDLED_MOE for batch in (2, 4, 8, 16) if batch < 16 or name != "mixtral-8x7b"]


@needs_nvcc
@pytest.mark.parametrize("name,batch", BUNDLED_BATCHES)
def test_a_bundled_moe_batch_compiles_without_spills(name, batch, tmp_path):
    """The bundled MoE specs at batches 2, 4, 8 and 16 (sm_90): within the plan's registers and no spills, as their batch-1
    builds. MoE batch builds read the thread index where they use it (common.cuh's thread_index): without, indices
    held across the layer loop spilled (qwen1.5-moe-a2.7b at batch 8: 52 bytes)."""
    from mkport.kernel.build import compile_check
    from mkport.kernel.render import render

    spec = open_model(name).spec
    target = target_for_arch("sm_90")
    plan = plan_launch(spec, target, batch=batch)
    result = compile_check(render(spec, plan).write(tmp_path), plan, target)
    kernel = next(k for k in result.kernels if k.kernel == "decode_step_kernel")
    assert result.ok and not kernel.spill_stores and not kernel.spill_loads, result.to_dict()
    assert kernel.registers <= plan.max_regs_per_thread


@needs_nvcc
@pytest.mark.parametrize("experts,top_k,batch,trace", [(60, 4, 8, False), (4, 2, 2, True), (8, 3, 32, False)])
def test_a_tiny_moe_batch_compiles_without_spills(experts, top_k, batch, trace, tmp_path):
    """Routing shapes the bundled specs do not have: 60 experts (two warps' prefix sum), batch * experts < 16, batch
    32 (a sequence a bit of the masks), and a trace build."""
    from mkport.kernel.build import compile_check
    from mkport.kernel.render import render

    spec = _tiny_routing_spec(experts, top_k)
    target = target_for_arch("sm_90")
    plan = plan_launch(spec, target, batch=batch)
    result = compile_check(render(spec, plan).write(tmp_path), plan, target, trace=trace)
    kernel = next(k for k in result.kernels if k.kernel == "decode_step_kernel")
    assert result.ok and not kernel.spill_stores and not kernel.spill_loads, result.to_dict()


@needs_nvcc
@pytest.mark.parametrize("name,batch,trace", [("qwen3.5-35b-a3b", 1, True), ("qwen3.5-35b-a3b", 8, False),
                                              ("granite-3.0-1b-a400m", 8, True)])
def test_a_published_moe_compiles_without_spills(name, batch, trace, tmp_path):
    """Families whose megakernel has not run on a GPU yet, at their published shapes (sm_90): Qwen3.5-35B-A3B (Gated
    DeltaNet and gated full-attention layers, each MLP 8 of 256 experts and the shared expert) and Granite's 1B-A400M
    (granite's multipliers, 8 of 32 experts); the trace build `mkport diff` runs and a batch, within the plan's
    registers and no spills (test_generate_check builds every published config's batch-1 step)."""
    from mkport.kernel.build import compile_check
    from mkport.kernel.render import render

    spec = spec_from_config(PUBLISHED_CONFIGS[name], name)
    target = target_for_arch("sm_90")
    plan = plan_launch(spec, target, batch=batch)
    result = compile_check(render(spec, plan).write(tmp_path), plan, target, trace=trace)
    kernel = next(k for k in result.kernels if k.kernel == "decode_step_kernel")
    assert result.ok and not kernel.spill_stores and not kernel.spill_loads, result.to_dict()
    assert kernel.registers <= plan.max_regs_per_thread


# -- weights -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", MOE_CASES)
def test_experts_are_stacked_by_index(tmp_path, case):
    (tmp_path / "config.json").write_text(json.dumps(moe_config(case)))
    spec = open_model(str(tmp_path)).spec
    tensors = random_checkpoint(spec, seed=3)
    w = to_kernel_layout(spec, tensors)
    layer = spec.moe.sparse_layers[-1]
    lw, p = w.layers[layer], f"model.layers.{layer}."
    names = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                         "block_sparse_moe.experts.{e}.w2", "block_sparse_moe.gate")}.get(
        case, ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj", "mlp.gate"))
    fused = {"qwen3_5_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"),
             "granitemoe": ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight",
                            "block_sparse_moe.router.layer.weight")}.get(case)
    for e in (0, 5):
        if fused:  # the checkpoint's fused tensors: expert e's gate rows, then its up rows
            gate_up, w = tensors[p + fused[0]][e], spec.moe.expert_intermediate_size
            assert torch.equal(lw.expert_gate[e], gate_up[:w]) and torch.equal(lw.expert_up[e], gate_up[w:])
            assert torch.equal(lw.expert_down[e], tensors[p + fused[1]][e])
            continue
        for got, name in zip((lw.expert_gate, lw.expert_up, lw.expert_down), names):
            assert torch.equal(got[e], tensors[p + name.format(e=e) + ".weight"])
    assert torch.equal(lw.router, tensors[p + fused[2]] if fused else tensors[p + names[3] + ".weight"])
    if case in ("qwen2_moe", "qwen3_5_moe"):  # the shared expert sits where the dense MLP does
        assert torch.equal(lw.w_up, tensors[p + "mlp.shared_expert.up_proj.weight"])
        assert torch.equal(lw.shared_gate, tensors[p + "mlp.shared_expert_gate.weight"])
    else:
        assert lw.w_gate is None and lw.shared_gate is None
    if case == "qwen3_moe":  # layer 1 is dense
        assert w.layers[1].router is None and w.layers[1].w_gate.shape == (spec.intermediate_size, spec.hidden_size)


def test_reference_fuses_gate_then_up(moe_models):
    """transformers 5's experts.gate_up_proj[e] is expert e's gate rows, then its up rows."""
    source, checkpoint = open_model(moe_models["mixtral"]), Checkpoint.open(moe_models["mixtral"])
    ref = Reference(source, checkpoint)
    w = load_weights(source.spec, checkpoint)
    experts = ref.base.layers[2].mlp.experts
    assert torch.equal(experts.gate_up_proj[3], torch.cat([w.layers[2].expert_gate[3], w.layers[2].expert_up[3]]).float())
    assert torch.equal(experts.down_proj[6], w.layers[2].expert_down[6].float())


# -- routing against transformers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [False, True])
def test_route_is_transformers_router(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    spec = spec_from_config(dict(moe_config("qwen3_moe"), num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm), "q")
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(2))
    logits, weights, ids = router(x)
    chosen, applied, ours = torch_model.route(spec, logits)
    order = ids.sort(dim=-1)
    assert torch.equal(chosen, order.values) and torch.equal(applied, chosen)
    assert torch.allclose(ours, weights.gather(-1, order.indices), rtol=1e-6, atol=0)
    assert torch.allclose(ours.sum(-1), torch.ones(20)) == norm


def _setup(models, case, n=16, seed=5):
    source, checkpoint = open_model(models[case]), Checkpoint.open(models[case])
    spec = source.spec
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (n,), generator=gen)
    positions = torch.arange(7, 7 + n).expand(3, n)
    out = Reference(source, checkpoint).run(tokens=tokens, positions=positions)
    return spec, load_weights(spec, checkpoint), tokens, positions, dict(out.taps, logits=out.logits)


def _ours(spec, w, tokens, positions, routing=None, decode=False) -> dict:
    return torch_path_taps(spec, w, tokens, positions, decode, routing)


_CACHE: dict = {}


def _cached(models, case):
    if case not in _CACHE:
        _CACHE[case] = _setup(models, case)
    return _CACHE[case]


@pytest.mark.parametrize("case", MOE_CASES)
def test_torch_path_is_transformers(moe_models, case):
    """One pass of torch_model against transformers' float32 model: the same experts on every row, every state
    within float32 rounding, every sparse layer's router, experts, weights and block output compared."""
    spec, w, tokens, positions, reference = _cached(moe_models, case)
    ours = _ours(spec, w, tokens, positions)
    report = compare(ours, reference, spec)
    assert report.passed, report.to_text()
    names = {r.name for r in report.rows}
    for i in spec.moe.sparse_layers:
        assert {Tap.layer(i, op) for op in Tap.MOE_LAYER} <= names
        assert torch.equal(ours[Tap.layer(i, Tap.EXPERTS)], reference[Tap.layer(i, Tap.EXPERTS)])
    assert max(r.rel_l2 for r in report.rows if r.op != Tap.EXPERTS) < 1e-5
    decoded = compare(_ours(spec, w, tokens, positions, reference_routing(spec, reference), decode=True), reference, spec)
    assert decoded.passed, decoded.to_text()  # token by token with a bf16 KV cache, routing forced


@pytest.mark.parametrize("case", MOE_CASES)
def test_the_baselines_experts_compute_what_the_references_do(moe_models, case):
    """bench's transformers baseline (HFStep) decodes experts with 'batched_mm', as transformers' generate does on a GPU;
    the reference keeps 'eager'. Both give the same logits and experts, and a decode step with 'batched_mm' reads
    nothing back to the host (what a CUDA graph capture needs: hf_graph), where the eager loop over experts does."""
    from mkport.bench.decode import decoding_experts
    from test_hf_graph_rope import NoHostReads

    source, checkpoint = open_model(moe_models[case]), Checkpoint.open(moe_models[case])
    spec = source.spec
    tokens = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(9).expand(3, 9)
    ref = Reference(source, checkpoint)
    assert ref.causal_lm.get_experts_implementation()[""] == "eager"
    eager = ref.run(tokens=tokens, positions=positions)

    def step():  # hf_graph's step: one row, its mask prepared outside
        x = torch.randn(1, 1, spec.hidden_size)
        with torch.no_grad(), NoHostReads():
            ref.base(inputs_embeds=x, attention_mask=torch.zeros(1, 1, 1, 1), position_ids=torch.tensor([[4]]),
                     use_cache=False)

    with pytest.raises(RuntimeError, match="host read"):
        step()
    decoding_experts(ref.causal_lm)
    step()
    assert ref.base.config._experts_implementation == "batched_mm"  # the module the steps call reads it
    batched = ref.run(tokens=tokens, positions=positions)
    assert torch.allclose(batched.logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(batched.taps[Tap.layer(spec.moe.sparse_layers[0], Tap.EXPERTS)],
                       eager.taps[Tap.layer(spec.moe.sparse_layers[0], Tap.EXPERTS)])


# -- ablations: each routing rule mis-set fails where it bites -------------------------------------------------------

def _without_shared_expert(w):
    return dataclasses.replace(w, layers=[dataclasses.replace(lw, shared_gate=None) for lw in w.layers])


def _experts_reversed(w):
    """Expert e's weights put at index E-1-e: a stacking that does not follow the checkpoint's expert index."""
    def flip(lw):
        if lw.router is None:
            return lw
        return dataclasses.replace(lw, expert_gate=lw.expert_gate.flip(0), expert_up=lw.expert_up.flip(0),
                                   expert_down=lw.expert_down.flip(0))
    return dataclasses.replace(w, layers=[flip(lw) for lw in w.layers])


ABLATIONS = {
    "qwen3_moe-no-renormalise": ("qwen3_moe", lambda s: {"norm_topk_prob": False}, None, "layers.0.expert_weights"),
    "mixtral-no-renormalise": ("mixtral", lambda s: {"norm_topk_prob": False}, None, "layers.0.expert_weights"),
    "qwen2_moe-renormalised": ("qwen2_moe", lambda s: {"norm_topk_prob": True}, None, "layers.1.expert_weights"),
    "qwen3_moe-layer-1-sparse": ("qwen3_moe", None, None, "layers.1.mlp_residual"),
    "qwen2_moe-no-shared-expert": ("qwen2_moe", None, _without_shared_expert, "layers.1.moe"),
    "olmoe-experts-reversed": ("olmoe", None, _experts_reversed, "layers.0.moe"),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablation_fails_where_it_bites(moe_models, name):
    case, moe_changes, weights_change, first = ABLATIONS[name]
    spec, w, tokens, positions, reference = _cached(moe_models, case)
    wrong = spec
    if moe_changes is not None:
        wrong = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, **moe_changes(spec)))
    if name == "qwen3_moe-layer-1-sparse":  # layer 1 run through the experts: its dense MLP is not applied
        wrong = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, sparse_layers=(0, 1, 2)))
        w = dataclasses.replace(w, layers=[w.layers[0], dataclasses.replace(w.layers[0], **{
            k: getattr(w.layers[1], k) for k in ("attn_norm", "wqkv", "q_norm", "k_norm", "wo", "mlp_norm")}), w.layers[2]])
    if weights_change is not None:
        w = weights_change(w)
    report = compare(_ours(wrong, w, tokens, positions), reference, spec)
    assert not report.passed and report.first_failure.name == first, report.to_text()


# -- router flips: ties and divergences ------------------------------------------------------------------------------

def test_flip_rule_on_synthetic_rows():
    """Three rows of 6 router logits, top-2: an agreeing row, a flip across a margin well inside the tie margin, a
    flip across one far outside it. The rule must call them agreement, tie and divergence."""
    ref_logits = torch.tensor([[3.0, 2.0, 0.0, -1.0, 0.5, -2.0],
                               [3.0, 1.0, 0.999, -1.0, 0.5, -2.0],   # 2nd and 3rd 0.001 apart
                               [3.0, 2.0, -1.0, -1.0, 0.5, -2.0]])   # 2nd and 3rd 1.5 apart
    ref_ids = torch.tensor([[0, 1], [0, 1], [0, 1]]).float()
    kernel_ids = torch.tensor([[0, 1], [0, 2], [0, 4]]).float()
    flipped, margin = route_flips(kernel_ids, ref_ids, ref_logits)
    assert flipped.tolist() == [False, True, True]
    assert torch.allclose(margin, torch.tensor([1.5, 0.001, 1.5], dtype=torch.float64), atol=1e-6)
    limits = tie_margin(4, ref_logits)
    assert 0.001 < limits[1] < 1.5  # the rule's margin sits between the two flips' margins
    spec = dataclasses.replace(spec_from_config(moe_config("mixtral"), "m"), num_layers=5)
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, num_experts=6, sparse_layers=(4,)))
    name, router = Tap.layer(4, Tap.EXPERTS), Tap.layer(4, Tap.ROUTER)
    tie_only = compare({name: kernel_ids[:2], router: ref_logits[:2]}, {name: ref_ids[:2], router: ref_logits[:2]}, spec)
    assert tie_only.passed and tie_only.rows[1].ties == 1 and "1 router flips within the tie margin" in tie_only.verdict()
    both = compare({name: kernel_ids, router: ref_logits}, {name: ref_ids, router: ref_logits}, spec)
    assert not both.passed and both.first_failure.name == name and both.first_failure.divergences == 1
    assert "router flips with a reference margin above the tie margin" in both.verdict()
    assert tolerance(4) * TIE_FACTOR * ref_logits[1].pow(2).mean().sqrt() == pytest.approx(float(limits[1]))


def test_a_faulty_router_is_a_divergence(moe_models):
    """A real flip: the router of layer 2 perturbed (its weights' RMS in noise) on mkport's side, routing forced to
    the reference's: the router logits fail first, and its own choice flips rows by margins far above the tie
    margin."""
    spec, w, tokens, positions, reference = _cached(moe_models, "mixtral")
    gen = torch.Generator().manual_seed(9)
    lw = w.layers[2]
    noisy = lw.router.float() + lw.router.float().pow(2).mean().sqrt() * torch.randn(lw.router.shape, generator=gen)
    faulty = dataclasses.replace(w, layers=[*w.layers[:2], dataclasses.replace(lw, router=noisy.to(lw.router.dtype))])
    report = compare(_ours(spec, faulty, tokens, positions, reference_routing(spec, reference)), reference, spec)
    assert report.first_failure.name == "layers.2.router_logits", report.to_text()
    experts = next(r for r in report.rows if r.name == "layers.2.experts")
    assert experts.divergences >= 1 and not experts.ok
    clean = compare(_ours(spec, w, tokens, positions, reference_routing(spec, reference)), reference, spec)
    assert clean.passed and all(r.divergences == 0 for r in clean.rows)


def test_injected_down_fault_is_caught_in_the_expert_block(moe_models):
    """mlp_residual faults perturb w_down; in a sparse layer that is the shared expert (qwen2_moe)."""
    spec, w, tokens, positions, reference = _cached(moe_models, "qwen2_moe")
    report = compare(_ours(spec, inject(w, spec, 3, Tap.MLP_RESIDUAL, seed=1), tokens, positions), reference, spec)
    assert report.first_failure.name == "layers.3.moe", report.to_text()


@pytest.mark.parametrize("layer,op,first", [(0, Tap.MLP_RESIDUAL, "layers.0.moe"), (1, Tap.GATES, "layers.1.gates"),
                                            (2, Tap.K, "layers.2.k")])
def test_a_fault_in_qwen3_5_moe_is_found_at_its_layer_and_op(moe_models, layer, op, first):
    """Qwen3.5's mixture of experts: a linear layer's shared expert (in the expert block's output), its gates, and the
    full layer's k rows, each found first where it was injected."""
    spec, w, tokens, positions, reference = _cached(moe_models, "qwen3_5_moe")
    report = compare(_ours(spec, inject(w, spec, layer, op, seed=1), tokens, positions), reference, spec)
    assert report.first_failure.name == first, report.to_text()



def test_the_reference_reads_a_router_that_returns_its_ids_first():
    """transformers 5.17's GraniteMoeTopKRouter returns (ids, weights, logits), 5.2x's (logits, weights, ids): the
    reference reads both alike (on the H200's 5.17 the old reading took the ids for logits: a device-side assert)."""
    from mkport.check.reference import router_outputs

    logits = torch.randn(5, 32)
    weights, ids = logits.topk(8, dim=-1)
    for out in ((logits, weights.softmax(-1), ids), (ids, weights.softmax(-1), logits)):
        got = router_outputs(out)
        assert torch.equal(got[0], logits) and torch.equal(got[1], weights.softmax(-1)) and torch.equal(got[2], ids)
