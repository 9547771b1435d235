"""Rendering (deterministic, strict, readable artifacts), the RoPE tables against transformers, and the launch plan."""

from __future__ import annotations

import json
import re
from importlib import resources

import jinja2
import numpy as np
import pytest
import torch

from conftest import LLAMA3_SCALING, bundled_kernel_params
from mkport.errors import MkportError
from mkport.kernel import render as render_mod
from mkport.kernel.gpu import KNOWN_TARGETS, target_for_arch
from mkport.kernel.interface import TraceLayout
from mkport.kernel.render import HEADER, HEADER_TEMPLATE, kernel_dir, plain_sources, render, rope_tables
from mkport.kernel.spec import load_spec, safe_name, spec_from_config
from mkport.kernel.launch_plan import ATTN_MAX_SPLITS, BATCH_SIZES, BATCHES, largest_batch, plan_launch

OPS = ("rmsnorm", "matvec", "rope", "attention", "mlp", "lm_head", "sample", "grid_sync", "decode_step")
ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")


def _rendered(name: str = "qwen3-tts-0.6b-talker", arch: str = "sm_90"):
    spec = load_spec(name)
    return spec, plan_launch(spec, target_for_arch(arch))


# ---------------------------------------------------------------------------------------------------
# Sources


HOSTILE_NAMES = {  # each holds Qz9, which the sources do not, so that its sanitized form can be replaced
    "newline_code": 'Qz9\n#include <cstdlib>\nstatic int pwn = system("id > pwned");\n#if 0',
    "comment_end": "Qz9 */ int x; /* ",  # '/' cannot be in a folder's name: this one goes in through safe_name
    "quotes": "Qz9'\"`$(id)`",
    "dots": "..Qz9..",
    "long": "Qz9" + "L" * 247,  # a file system allows 255 bytes a name; safe_name's own test has 300 characters
}


@pytest.mark.parametrize("case", list(HOSTILE_NAMES))
def test_a_hostile_folder_name_cannot_change_the_rendered_code(tmp_path, case):
    """The spec name comes from the folder's name and is written into the sources' first-line comments and
    the output folder's name: the sources are those of a plain folder name but for the sanitized name."""
    raw = HOSTILE_NAMES[case]
    config = json.loads((resources.files("mkport.kernel") / "model_specs" / "qwen3-0.6b.json").read_text())
    rendered = []
    for folder in (tmp_path / "Qz9plain", tmp_path / raw):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
        spec = load_spec(str(folder))
        if "/" in raw:  # the path above named the spec after its last part; give it the whole name
            assert spec.name == safe_name(folder.name)
            spec = spec.with_name(safe_name(raw))
        plan = plan_launch(spec, target_for_arch("sm_90"))
        rendered.append((spec, render(spec, plan)))
    (plain_spec, plain), (spec, hostile) = rendered

    def neutral(sources, s):
        return {f: t.replace(s.name, "NAME").replace(s.digest(), "DIGEST") for f, t in sources.files.items()}

    assert neutral(hostile, spec) == neutral(plain, plain_spec)
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,64}", spec.name) and ".." not in spec.name
    out = hostile.write(tmp_path / "generated")
    assert out.parent == tmp_path / "generated" and out.name == f"{spec.name}-{hostile.digest}"
    for text in hostile.files.values():
        assert "system(" not in text and "*/ int x" not in text and "$(id)" not in text


@pytest.mark.parametrize("name", bundled_kernel_params())
def test_render_is_deterministic(tmp_path, name):
    spec, plan = _rendered(name)
    a, b = render(spec, plan), render(load_spec(name), plan_launch(load_spec(name), target_for_arch("sm_90")))
    assert a.files == b.files and a.digest == b.digest
    assert a.dirname == f"{name}-{a.digest}"
    out1 = a.write(tmp_path)
    snapshot = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out1.iterdir()}
    out2 = b.write(tmp_path)
    assert out1 == out2
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out2.iterdir()} == snapshot
    assert set(snapshot) == set(a.files)


def test_digest_follows_the_content():
    spec, plan = _rendered("qwen3-0.6b")
    other = plan_launch(spec, target_for_arch("sm_80"))
    assert render(spec, plan).digest != render(spec, other).digest
    assert render(spec, plan).digest != render(spec.with_name("x"), plan).digest


def test_rewrite_repairs_an_edited_file(tmp_path):
    spec, plan = _rendered("qwen3-0.6b")
    src = render(spec, plan)
    out = src.write(tmp_path)
    (out / "matvec.cuh").write_text("// edited\n")
    src.write(tmp_path)
    assert (out / "matvec.cuh").read_text() == src.files["matvec.cuh"]


def test_strict_undefined():
    env = render_mod._environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ not_a_variable }}").render()
    spec, plan = _rendered()
    ctx = render_mod._context(spec, plan)
    env.get_template(HEADER_TEMPLATE).render(**ctx)  # the full context renders
    del ctx["plan"]
    with pytest.raises(jinja2.UndefinedError):
        env.get_template(HEADER_TEMPLATE).render(**ctx)
    ctx = render_mod._context(spec, plan)
    del ctx["c"]["rope_inv_freq"]
    with pytest.raises(jinja2.UndefinedError):
        env.get_template(HEADER_TEMPLATE).render(**ctx)


def test_output_has_spec_and_plan(tmp_path):
    spec, plan = _rendered("qwen3-tts-1.7b-code-predictor", "sm_89")
    out = render(spec, plan).write(tmp_path)
    assert json.loads((out / "spec.json").read_text()) == json.loads(json.dumps(spec.to_dict()))
    assert json.loads((out / "plan.json").read_text()) == plan.to_dict()
    src = (out / HEADER).read_text()
    assert spec.digest() in src and plan.arch in src


def test_one_rendered_header_and_one_plain_file_per_op(tmp_path):
    """Jinja renders only the constants header; every op is a plain file of the package, copied beside it unchanged,
    that includes nothing rendered but the header (through common.cuh)."""
    folder = kernel_dir()
    assert [f.name for f in folder.iterdir() if f.name.endswith(".j2")] == [HEADER_TEMPLATE]
    spec, plan = _rendered()
    files = render(spec, plan).files
    out = render(spec, plan).write(tmp_path)
    plain = plain_sources()
    for op in OPS:
        name = f"{op}.cu" if op == "decode_step" else f"{op}.cuh"
        assert name in plain and (out / name).read_text() == plain[name] == (folder / name).read_text()
    assert set(files) == {HEADER, "spec.json", "plan.json", *plain}
    for name, text in plain.items():  # no Jinja left in a plain file (the asm operand lists hold "{%0")
        assert "{{" not in text and "{#" not in text and not re.search(r"\{%[-+]?\s*[a-z]", text), name
    assert '#include "constants.cuh"' in plain["common.cuh"]
    # the decode step composes the ops: it includes each op's header
    for op in OPS[:-1]:
        assert f'#include "{op}.cuh"' in plain["decode_step.cu"]


def test_the_build_key_covers_the_plain_sources(tmp_path):
    """A library is named by every source of its folder, the copied op files as well as the rendered header."""
    from mkport.kernel.build import build_key

    spec, plan = _rendered("qwen3-0.6b")
    out = render(spec, plan).write(tmp_path)
    key = build_key(out, "nvcc", ["-O3"])
    (out / "attention.cuh").write_text((out / "attention.cuh").read_text() + "// edited\n")
    assert build_key(out, "nvcc", ["-O3"]) != key


def test_constants_reach_the_source():
    spec, plan = _rendered("tinyllama-1.1b")
    files = render(spec, plan).files
    text = "".join(files.values())
    for value in (spec.hidden_size, spec.intermediate_size, spec.vocab_size, plan.grid, plan.smem_bytes):
        assert str(value) in text
    trace = TraceLayout.of(spec)
    assert trace.total == spec.hidden_size * 2 + spec.num_layers * trace.layer_stride


# ---------------------------------------------------------------------------------------------------
# RoPE tables against transformers' own computation


def _hf_inv_freq(rope_parameters: dict, head_dim: int = 64) -> np.ndarray:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 32,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_parameters),
    )
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":  # transformers 5 keeps the default init on the model's rotary class
        inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config, device=torch.device("cpu"))
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float().numpy()


def _llama_spec(rope_parameters: dict):
    cfg = {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 131072,
        "rope_parameters": rope_parameters,
    }
    return spec_from_config(cfg, "rope-test")


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default_1e6": {"rope_type": "default", "rope_theta": 1000000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {**LLAMA3_SCALING, "rope_theta": 500000.0},
    "llama3_32": {**LLAMA3_SCALING, "rope_theta": 500000.0, "factor": 32.0},
}


@pytest.mark.parametrize("case", list(ROPES))
def test_rope_inv_freq_matches_transformers(case):
    spec = _llama_spec(ROPES[case])
    ours, stream = rope_tables(spec)
    theirs = _hf_inv_freq(ROPES[case], spec.head_dim)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (spec.head_dim // 2,)
    np.testing.assert_allclose(ours, theirs, rtol=2e-7, atol=0)
    assert not stream.any()
    if case.startswith("llama3"):  # the scaling really changed something: low frequencies divided by factor
        plain = _hf_inv_freq({"rope_type": "default", "rope_theta": 500000.0}, spec.head_dim)
        assert np.isclose(ours[-1], plain[-1] / ROPES[case]["factor"], rtol=1e-6)
        assert ours[0] == plain[0]


def test_mrope_interleaved_streams():
    spec = load_spec("qwen3-tts-0.6b-talker")
    inv_freq, stream = rope_tables(spec)
    assert stream.shape == (64,)
    expected = np.zeros(64, dtype=np.int64)
    expected[1:60:3] = 1  # 1, 4, ..., 58
    expected[2:60:3] = 2  # 2, 5, ..., 59
    np.testing.assert_array_equal(stream, expected)
    assert list(stream[1:59:3]) == [1] * 20 and list(stream[2:60:3]) == [2] * 20
    assert (stream == 0).sum() == 24
    # frequencies themselves are the default ones
    np.testing.assert_allclose(inv_freq, _hf_inv_freq({"rope_type": "default", "rope_theta": 1e6}, 128), rtol=2e-7)


def test_mrope_contiguous_streams():
    cfg = json.loads((resources.files("mkport.kernel") / "model_specs" / "qwen3-0.6b.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "default", "mrope_section": [16, 24, 24]}
    _, stream = rope_tables(spec_from_config(cfg, "m"))
    np.testing.assert_array_equal(stream, [0] * 16 + [1] * 24 + [2] * 24)


# ---------------------------------------------------------------------------------------------------
# Launch plan


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", bundled_kernel_params())
def test_plan(name, arch):
    spec = load_spec(name)
    target = KNOWN_TARGETS[arch]
    if name == "mixtral-8x7b" and target.smem_per_block < 122960:  # its two experts' down input: refused there
        with pytest.raises(MkportError, match="mixtral-8x7b at batch 1 needs 122960 bytes of shared memory"):
            plan_launch(spec, target)
        return
    plan = plan_launch(spec, target)
    assert plan.arch == arch
    assert plan.grid == target.sm_count
    assert plan.threads % 32 == 0 and plan.warps == plan.threads // 32
    assert plan.threads <= target.max_threads_per_sm
    assert 0 < plan.smem_bytes <= target.smem_per_block
    assert plan.smem_bytes >= 4 * max(spec.hidden_size, spec.intermediate_size)
    assert plan.attn_max_splits == min(ATTN_MAX_SPLITS, plan.grid // spec.num_kv_heads,
                                       plan.attn_tile // spec.gqa_ratio)
    assert plan.max_regs_per_thread == min(255, target.regs_per_sm // plan.threads)
    total_warps = plan.grid * plan.warps
    assert plan.rows_per_warp["gate_up"] * total_warps >= spec.intermediate_size
    assert plan.rows_per_warp["lm_head"] * total_warps >= spec.vocab_size
    assert ("input_proj" in plan.rows_per_warp) == spec.input_projection


def test_batch_plan():
    """A batch plan: vectors of every sequence in shared memory, attention splits shared out, sizes refused with
    the largest that fits."""

    target = KNOWN_TARGETS["sm_90"]
    talker = load_spec("qwen3-tts-0.6b-talker")
    one, eight = plan_launch(talker, target), plan_launch(talker, target, batch=8)
    assert eight.batch == 8 and eight.smem_bytes >= 8 * 4 * talker.hidden_size
    assert one.attention_splits(128) == 8 and eight.attention_splits(128) == one.attn_max_splits // 8
    assert eight.attention_splits(2048) * 8 * talker.num_kv_heads <= eight.grid  # one pass over the grid
    with pytest.raises(MkportError, match="batch up to 24 fits"):
        plan_launch(load_spec("qwen3-tts-1.7b-talker"), target, batch=32)
    # 24 is made only when asked: the sizes offered unasked (BATCHES) still stop at 16 for the 1.7B
    assert largest_batch(load_spec("qwen3-tts-1.7b-talker"), target) == 16 and largest_batch(talker, target) == 32
    assert largest_batch(load_spec("qwen3-tts-1.7b-talker"), target, BATCH_SIZES) == 24
    plan_launch(load_spec("qwen3-tts-1.7b-talker"), target, batch=16)  # what largest_batch says fits, does
    twenty_four = plan_launch(load_spec("qwen3-tts-1.7b-talker"), target, batch=24)
    # one split a KV head, and 24 x 8 items: two passes over the 132 blocks (the docstring's bound)
    assert twenty_four.attention_splits(128) == 1 and 24 * 8 > twenty_four.grid
    assert "constexpr int BATCH = 24;" in render(load_spec("qwen3-tts-1.7b-talker"), twenty_four).files["constants.cuh"]
    with pytest.raises(MkportError, match="supported batch sizes are 1, 2, 4, 8, 16, 24, 32"):
        plan_launch(talker, target, batch=3)
    source = render(talker, eight).files["constants.cuh"]
    assert "constexpr int BATCH = 8;" in source and "long long cache_pos[BATCH];" in source


@pytest.mark.parametrize("name", bundled_kernel_params())
def test_shared_memory_layouts_are_defined_once_and_fit_the_plan(name):
    """The attention, sampler and batch-vector regions come from launch_plan's layouts, rendered as constants; their
    parts are in order without overlap, and the plan's shared memory holds each one."""
    from mkport.kernel.launch_plan import (attention_layout, linear_floats, mma_part_floats, moe_routing_layout,
                                           sample_layout, vectors_layout)

    spec = load_spec(name)
    for batch in (1,) if spec.linear_layers else (1, 4):  # hybrids: test_qwen35_kernel.py has their batches
        plan = plan_launch(spec, KNOWN_TARGETS["sm_90"], batch=batch)
        files = render(spec, plan).files
        attn = attention_layout(spec, plan.attn_tile)
        for part in ("q", "score", "state", "pv", "kv"):
            assert f"constexpr int ATTN_SM_{part.upper()} = {attn[part]};" in files["constants.cuh"]
        starts = [attn[p] for p in ("q", "score", "state", "pv", "kv", "floats")]
        assert starts == sorted(set(starts)) and attn["kv"] % 4 == 0
        vectors = vectors_layout(spec, batch)
        assert f"constexpr int MMA_PART_AT = {vectors['part']};" in files["constants.cuh"]
        # a mixture of experts' routing: batch 1's after the vectors (logits and ranks of its experts, its choices and
        # weights), a batch's after the partial tiles (moe_routing_layout: test_moe.py has its parts)
        tiles = 16 * mma_part_floats(batch) if batch > 1 else 0
        routing = 0
        if spec.moe:
            routing = 2 * (spec.moe.num_experts + spec.moe.top_k) if batch == 1 else moe_routing_layout(spec, batch)["words"]
            assert f"constexpr int MOE_SM = {vectors['moe']};" in files["constants.cuh"]
            assert vectors["moe"] == vectors["part"] + tiles
        assert vectors["floats"] == vectors["widest"] * batch + routing + tiles
        needed = [attn["floats"], vectors["floats"]]
        if spec.linear_layers:  # the delta rule's scratch (linear_attention.cuh)
            needed.append(linear_floats(spec))
        if spec.output_mode == "logits":
            sample = sample_layout()
            assert f"constexpr int SAMPLE_SM_CAND_ID = {sample['cand_id']};" in files["constants.cuh"]
            needed.append(sample["floats"])
        if batch == 1:  # then the next RMSNorm's weights, staged after what the phases share, 16-byte aligned
            assert plan.norm_weights_at == -(-4 * max(needed) // 16) * 16 >= 4 * max(needed)
            assert plan.smem_bytes == plan.norm_weights_at + 2 * spec.hidden_size
            assert f"constexpr int NORM_WEIGHTS_AT = {plan.norm_weights_at};" in files["constants.cuh"]
        else:
            assert plan.norm_weights_at == 0 and plan.smem_bytes == 4 * max(needed)


def test_kernel_designs_other_than_v20_are_refused():
    """v2, v5 and v6 with the reason each is gone (and where its log and code are); an unknown design with the list."""

    spec, target = load_spec("qwen3-0.6b"), target_for_arch("sm_90")
    with pytest.raises(MkportError, match=r"kernel v2 was removed \(slower than v5 in every measurement; "
                                          r"docs/benchmarks.md has its log"):
        plan_launch(spec, target, "v2")
    with pytest.raises(MkportError, match=r"kernel v5 was removed \(v7 replaced it, faster on every spec"):
        plan_launch(spec, target, "v5")
    with pytest.raises(MkportError, match=r"kernel v6 was removed \(its streamed MLP was slower than v5"):
        plan_launch(spec, target, "v6")
    with pytest.raises(MkportError, match="kernel 'v9' is not one of v20"):
        plan_launch(spec, target, "v9")


def test_every_timeline_event_is_a_constant_and_stamped_once_a_layer():
    """The profile timeline's events (interface.TIMELINE_EVENTS, which Decoder.timeline names) are rendered as
    TL_ constants in that order, and each is stamped exactly once in the batch-1 step's sources; a stamp of an
    event that is not in the list would not compile. A sparse layer's MLP (moe.cuh) stamps the MLP's events that
    its phases pass through, each once, in place of the dense MLP's; a Gated DeltaNet layer (linear_attention.cuh) its
    attention half's inputs, in place of qkv's and o_proj's."""
    from mkport.kernel.interface import TIMELINE_EVENTS

    spec = load_spec("qwen3-0.6b")
    files = render(spec, plan_launch(spec, KNOWN_TARGETS["sm_90"])).files
    for i, name in enumerate(TIMELINE_EVENTS):
        assert f"constexpr int TL_{name.upper()} = {i};" in files["constants.cuh"]
    stamps = {f: re.findall(r"STAMP\(p, layer, ([A-Z_]+)\)", text) for f, text in files.items()}
    sparse = stamps.pop("moe.cuh")
    linear = stamps.pop("linear_attention.cuh")
    assert sorted(sum(stamps.values(), [])) == sorted(name.upper() for name in TIMELINE_EVENTS)
    assert sorted(sparse) == ["DOWN_INPUT", "GATE_UP_END", "MLP_INPUT"]
    assert sorted(linear) == ["O_PROJ_INPUT", "QKV_INPUT"]


@pytest.mark.parametrize("batch", [b for b in BATCHES if b > 1])
def test_a_warps_partial_tile_gives_every_sequence_its_own_column(batch):
    """mma_matvec.cuh's partial tile, [16 rows][MMA_PART_COLS]: lane (g, t) stores n8 tile j's accumulators at rows g
    and g + 8, columns 8j + 2t and 8j + 2t + 1, and the sums read row r, column seq. Every store lands in its own
    place inside the tile, and each (row, sequence) is read where it was stored (at batch 32 a 16-column row put
    tiles 2 and 3 into the next row)."""
    from mkport.kernel.launch_plan import mma_part_floats

    floats = mma_part_floats(batch)
    cols, ntiles = floats // 16, -(-batch // 8)
    stored = {}
    for g in range(8):
        for t in range(4):
            for j in range(ntiles):
                for row, col in ((g, 8 * j + 2 * t), (g, 8 * j + 2 * t + 1), (g + 8, 8 * j + 2 * t),
                                 (g + 8, 8 * j + 2 * t + 1)):
                    at = row * cols + col
                    assert 0 <= at < floats and at not in stored
                    stored[at] = (row, col)
    assert all(stored[r * cols + seq] == (r, seq) for r in range(16) for seq in range(batch))
    assert floats == (256 if batch <= 16 else 512)
