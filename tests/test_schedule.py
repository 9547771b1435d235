"""Kernel v2's schedule (mkport/schedule.py) on CPU: every row computed once, every counter reachable, no block
waiting forever in a simulated step, the numbers rendered into the kernel and schedule.json, and the v2 sources
(and those of its producer-warp variant) compiled with nvcc without spills (skipped, visibly, without nvcc)."""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import V2_FAMILIES, needs_nvcc

from mkport.build import compile_check
from mkport.errors import MkportError
from mkport.gpu import KNOWN_TARGETS, target_for_arch
from mkport.render import render
from mkport.schedule import check_schedule, make_schedule, simulate_step, split_evenly
from mkport.spec import bundled_names, load_spec, spec_from_config
from mkport.tiling import plan_launch



TINY = {  # fewer rows than blocks: most blocks have nothing to do in some tasks
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 100,
}
ODD = {  # 15 heads, 5 kv heads, an intermediate size that does not split evenly
    "model_type": "llama", "hidden_size": 960, "intermediate_size": 2568, "num_hidden_layers": 3,
    "num_attention_heads": 15, "num_key_value_heads": 5, "vocab_size": 49152,
}


def _specs():
    bundled = [spec for spec in map(load_spec, bundled_names()) if spec.family in V2_FAMILIES]
    return bundled + [spec_from_config(TINY, "tiny"), spec_from_config(ODD, "odd")]


def test_split_evenly():
    assert split_evenly(10, 4) == [0, 2, 5, 7, 10]
    assert split_evenly(3, 5) == [0, 0, 1, 1, 2, 3]


@pytest.mark.parametrize("arch", sorted(KNOWN_TARGETS))
def test_every_spec_schedules_and_simulates(arch):
    for spec in _specs():
        plan = plan_launch(spec, KNOWN_TARGETS[arch], "v2")
        assert plan.kernel == "v2" and plan.ring_slots >= 2 and plan.smem_bytes <= KNOWN_TARGETS[arch].smem_per_block
        sched = make_schedule(spec, plan.grid, plan.mlp_groups)
        check_schedule(spec, sched)
        for splits in {1, plan.attention_splits(128), plan.attn_max_splits}:
            counters = simulate_step(spec, sched, splits)
            assert counters["head_done"] == plan.grid
            assert all(counters[f"attn_done[{layer}]"] == spec.num_kv_heads for layer in range(spec.num_layers))
            assert counters[f"mlp_done[{spec.num_layers}]"] == sched.mlp_target


def test_check_schedule_catches_a_gap():
    spec = load_spec("qwen3-tts-0.6b-talker")
    sched = make_schedule(spec, 132, 4)
    gate = list(sched.gate_rows)
    gate[1] = gate[0]  # block 1 computes block 0's gate/up rows again, and its own rows nobody does
    with pytest.raises(MkportError, match="gate/up rows"):
        check_schedule(spec, dataclasses.replace(sched, gate_rows=gate))


def test_simulation_catches_a_wrong_target():
    spec = load_spec("qwen3-tts-0.6b-code-predictor")
    sched = make_schedule(spec, 132, 4)
    wrong = dataclasses.replace(sched, qkv_target=[t + 1 for t in sched.qkv_target])
    with pytest.raises(MkportError, match="wait forever"):
        simulate_step(spec, wrong, 8)


def test_schedule_is_rendered(tmp_path):
    spec = load_spec("qwen3-tts-0.6b-talker")
    plan = plan_launch(spec, target_for_arch("sm_90"), "v2")
    src = render(spec, plan)
    sched = make_schedule(spec, plan.grid, plan.mlp_groups)
    assert src.schedule == sched  # what the Decoder sizes its counters by
    assert json.loads(src.files["schedule.json"]) == json.loads(json.dumps(sched.to_dict()))
    header = src.files["schedule.cuh"]
    assert f"QKV_TARGET[NKV] = {{ {', '.join(map(str, sched.qkv_target))} }}" in header
    assert f"MLP_K[NG + 1] = {{ {', '.join(map(str, sched.mlp_k))} }}" in header
    assert f"COUNTER_WORDS = {sched.counter_words};" in header
    masks = re.search(r"QKV_KV_HEADS\[GRID\] = \{ (.*) \};", header).group(1).split(", ")
    assert [int(m.rstrip("ul")) for m in masks] == [sum(1 << h for h in hs) for hs in sched.qkv_kv_heads]
    assert "grid.sync" not in src.files["decode_step.cu"]  # dataflow: no grid barrier on the way
    out = src.write(tmp_path)
    assert (out / "schedule.json").is_file() and json.loads((out / "plan.json").read_text())["kernel"] == "v2"


def test_v5_has_no_schedule():
    spec = load_spec("qwen3-0.6b")
    src = render(spec, plan_launch(spec, target_for_arch("sm_90")))
    assert "schedule.json" not in src.files and src.schedule is None and "grid.sync" in src.files["grid_sync.cuh"]


def test_unknown_kernel_is_refused():
    with pytest.raises(MkportError, match="kernel 'v9'"):
        plan_launch(load_spec("qwen3-0.6b"), target_for_arch("sm_90"), "v9")


@needs_nvcc
def test_v2_compiles_without_spills(tmp_path):
    """Every bundled spec and the odd shape on sm_90, fast and trace builds; the other archs' fast builds."""
    jobs = [(spec, "sm_90", trace) for spec in _specs() for trace in (False, True)]
    jobs += [(load_spec("qwen3-tts-1.7b-talker"), arch, False) for arch in ("sm_80", "sm_89", "sm_120")]

    def one(job):
        spec, arch, trace = job
        target = target_for_arch(arch)
        plan = plan_launch(spec, target, "v2")
        return f"{spec.name} {arch}{' trace' if trace else ''}", compile_check(
            render(spec, plan).write(tmp_path), plan, target, trace=trace)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, jobs))
    bad = [f"{name}: {res.problems}" for name, res in results if not res.ok]
    assert not bad, bad


def _producer_plan(spec, arch="sm_90"):
    """The `v2-producer` variant of scripts/plan_variants.py: 48 KB slots and a producer warp."""
    return plan_launch(spec, target_for_arch(arch), "v2", v2_slot_bytes=48 << 10, v2_producer_warp=True)


def _functions_calling(text: str, call: str) -> set[str]:
    """Names of the functions (definitions at column 0) whose bodies contain `call`."""
    names, current = set(), None
    for line in text.splitlines():
        if re.match(r"(template <.*> )?(extern \"C\" )?__(device|global)__ ", line):
            current = next(n for n in re.findall(r"(\w+)\(", line) if n != "__launch_bounds__")
        if call in line and current and not line.lstrip().startswith("//"):
            names.add(current)
    return names


def test_producer_warp_joins_no_barrier_of_the_computing_warps():
    """The producer warp leaves right after ring_init: a block-wide barrier (__syncthreads) anywhere after would
    wait for it forever, so the kernel's code has none but those two, and the computing warps meet at named
    barrier 1 over their own THREADS."""
    spec = load_spec("qwen3-tts-0.6b-talker")
    plan = _producer_plan(spec)
    assert plan.producer_warp and plan.block_threads == plan.threads + 32
    files = render(spec, plan).files
    kernel_code = "\n".join(text for name, text in files.items() if name.endswith((".cu", ".cuh")) and name != "prefill.cuh")
    assert _functions_calling(kernel_code, "__syncthreads()") == {"block_work", "ring_init"}
    assert 'bar.sync 1, %0;" ::"n"(THREADS)' in files["common.cuh"]
    assert f"BLOCK_THREADS = {plan.threads + 32};" in files["common.cuh"]
    main = files["decode_step.cu"]
    split = main.index("stream_weights(p, w, ring);\n    return;")
    assert main.index("ring_init(ring_bars);") < split < main.index("qkv_task(")
    assert "dim3(BLOCK_THREADS)" in main and "__launch_bounds__(BLOCK_THREADS, 1)" in main
    # each slot's "empty" barrier counts one arrival per computing warp, released in every chunk
    assert "threadIdx.x < RING_SLOTS ? RING_ARRIVALS : WARPS" in files["weight_ring.cuh"]
    assert "ring_release(ring.bars + RING_SLOTS + slot);" in files["block_work.cuh"]
    assert "ring_top_up" not in kernel_code and "chunk_dots" not in kernel_code  # the other variant's


def test_plain_v2_has_no_producer_warp():
    """The plain v2 sources keep one barrier kind and launch THREADS: block_sync() is __syncthreads()."""
    spec = load_spec("qwen3-tts-0.6b-talker")
    plan = plan_launch(spec, target_for_arch("sm_90"), "v2")
    files = render(spec, plan).files
    assert not plan.producer_warp and plan.block_threads == plan.threads
    assert "bar.sync" not in files["common.cuh"] and "stream_weights" not in files["block_work.cuh"]
    assert _functions_calling(files["decode_step.cu"], "ring_top_up(") == {"decode_step_kernel"}


def test_producer_warp_needs_bulk_copies_and_v2():
    spec = load_spec("qwen3-tts-0.6b-talker")
    with pytest.raises(MkportError, match="bulk copies"):
        _producer_plan(spec, "sm_80")
    with pytest.raises(MkportError, match="kernel v2 variant"):
        plan_launch(spec, target_for_arch("sm_90"), "v5", v2_producer_warp=True)


@needs_nvcc
def test_v2_producer_compiles_without_spills(tmp_path):
    """The v2-producer variant of every bundled spec and the odd shapes on sm_90, fast and trace builds, and a
    fast build on sm_120 (its default slots: 48 KB ones do not fit): no spill, registers within the budget of
    its 17 warps."""
    jobs = [(spec, "sm_90", trace) for spec in _specs() for trace in (False, True)]
    jobs.append((load_spec("qwen3-tts-1.7b-talker"), "sm_120", False))

    def one(job):
        spec, arch, trace = job
        plan = _producer_plan(spec) if arch == "sm_90" else plan_launch(spec, target_for_arch(arch), "v2",
                                                                         v2_producer_warp=True)
        return f"{spec.name} {arch}{' trace' if trace else ''}", compile_check(
            render(spec, plan).write(tmp_path), plan, target_for_arch(arch), trace=trace)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, jobs))
    bad = [f"{name}: {res.problems}" for name, res in results if not res.ok]
    assert not bad, bad
    registers = {k.registers for _, res in results for k in res.kernels if k.kernel == "decode_step_kernel"}
    assert max(registers) <= 65536 // (32 * 20)  # 17 warps, allotted in groups of 4: 96 registers a thread
