"""Batch-invariant plans and `mkport serve --batch-invariant`, on the CPU (issue 29: a stream's samples the same alone
and under load with frames sized to the live streams).

What is checked here: a plan for batch b made invariant to N has every choice that decides how one sequence's rows are
summed equal to the plan for N (launch_plan.LaunchPlan.reduction_choices and the plan's own fields), while a plain
plan for b does not (so the comparison can fail); batch 1 cannot be invariant to a batch and says so; an invariant
build is a build of its own (the cache key) whose code is the plain one's (the constants header differs in the
INVARIANT_TO lines only, and nvcc gives the same cubin); the server's sizes and decoders under --batch-invariant, and
its refusals. What the GPU shows (bits equal alone and in slot 3 of a busy batch) is tests/test_gpu_batch_invariant.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import BATCHES, largest_batch, plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec

SPECS = ("qwen3-tts-0.6b-talker", "qwen3-tts-0.6b-code-predictor", "qwen3-tts-1.7b-talker",
         "qwen3-tts-1.7b-code-predictor", "qwen3-0.6b", "qwen3.5-0.8b")
# what may differ between an invariant plan for b and the plan for N: the batch itself, what follows from holding b
# vectors (shared memory), and the invariance's own field
SIZED_BY_THE_BATCH = {"batch", "invariant_to", "smem_bytes"}


def _plans(name: str, arch: str = "sm_90"):
    spec, target = load_spec(name), target_for_arch(arch)
    return spec, target, [n for n in BATCHES if 2 < n <= largest_batch(spec, target)]


def _fields(plan) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k not in SIZED_BY_THE_BATCH}


@pytest.mark.parametrize("name", SPECS)
def test_an_invariant_plan_sums_a_row_as_the_batch_it_follows(name):
    """Every b from 2 below N, invariant to N: the reduction choices and the plan's fields are N's; the plain plan for
    b differs from N's in its attention splits (the comparison can fail)."""
    spec, target, tops = _plans(name)
    assert tops, f"{name}: no batch above 2 fits sm_90"
    for n in tops:
        top = plan_launch(spec, target, batch=n)
        differs = []
        for b in (b for b in BATCHES if 2 <= b < n):
            inv = plan_launch(spec, target, batch=b, invariant_to=n)
            assert inv.batch == b and inv.invariant_to == n and inv.reduction_batch == n
            assert inv.reduction_choices(spec) == top.reduction_choices(spec), (name, b, n)
            assert _fields(inv) == _fields(top), (name, b, n)
            plain = plan_launch(spec, target, batch=b)
            differs.append(plain.reduction_choices(spec) != top.reduction_choices(spec))
            # where the grid gives a sequence of b more splits than one of N (b = 16 and N = 32 both take one)
            assert differs[-1] == (plain.attention_splits(4096) != top.attention_splits(4096)), (name, b, n)
            # the matvecs already sum alike at every batch (their tiles' k slices follow the matrix and the grid)
            assert plain.reduction_choices(spec)["mma_slices"] == top.reduction_choices(spec)["mma_slices"]
        assert differs[0], f"{name}: the plain plan for 2 sums a row as the plan for {n}: the test shows nothing"


def test_batch_1_is_not_a_batchs_sums_and_says_so():
    """Batch 1 runs fp32 CUDA-core matvecs (split k), a batch tensor-core tiles: the choices differ, and a batch-1 plan
    invariant to a batch is refused in one line that says what to do instead; invariant_to must be a batch size at
    least the plan's; invariant_to equal to the batch is the plain plan."""
    spec, target = load_spec("qwen3-tts-0.6b-talker"), target_for_arch("sm_90")
    one, two = plan_launch(spec, target), plan_launch(spec, target, batch=2, invariant_to=16)
    assert one.reduction_choices(spec)["tensor_cores"] is False and two.reduction_choices(spec)["tensor_cores"] is True
    with pytest.raises(MkportError, match=r"^batch 1 invariant to batch 16: .* run the sequence as batch 2 with its "
                                          r"second row idle \(mkport serve --batch-invariant does\)$"):
        plan_launch(spec, target, batch=1, invariant_to=16)
    for batch, n in ((8, 4), (2, 12), (2, 64)):
        with pytest.raises(MkportError, match=rf"^invariant_to {n} at batch {batch}: a batch size of 1, 2, 4, 8, 16, 24, "
                                              "32 at least the plan's batch$"):
            plan_launch(spec, target, batch=batch, invariant_to=n)
    assert plan_launch(spec, target, batch=8, invariant_to=8) == plan_launch(spec, target, batch=8)
    assert plan_launch(spec, target, batch=1, invariant_to=1) == one


def test_attention_splits_follow_the_batch_an_invariant_plan_follows():
    """The one batch-dependent choice of a batch's kernel: a sequence's splits shrink as the batch grows (the grid's
    blocks shared), and an invariant plan takes N's at every context."""
    spec, target = load_spec("qwen3-tts-0.6b-talker"), target_for_arch("sm_90")
    assert [plan_launch(spec, target, batch=b).attention_splits(1024) for b in (2, 4, 8, 16)] == [8, 4, 2, 1]
    assert [plan_launch(spec, target, batch=b, invariant_to=16).attention_splits(1024) for b in (2, 4, 8)] == [1, 1, 1]
    assert [plan_launch(spec, target, batch=b, invariant_to=4).attention_splits(1024) for b in (2, 4)] == [4, 4]


def test_an_invariant_build_has_its_own_key_and_the_plain_builds_keep_theirs():
    """plan.json (in the build's digest) names invariant_to only when set, so plain builds keep their digests; the
    invariant build's constants differ from the plain one's only in the INVARIANT_TO lines (the same kernel code)."""
    spec, target = load_spec("qwen3-tts-0.6b-talker"), target_for_arch("sm_90")
    plain, inv = plan_launch(spec, target, batch=8), plan_launch(spec, target, batch=8, invariant_to=16)
    assert "invariant_to" not in plain.to_dict() and inv.to_dict()["invariant_to"] == 16
    a, b = render(spec, plain), render(spec, inv)
    assert a.digest != b.digest and a.digest != render(spec, plan_launch(spec, target, batch=8, invariant_to=32)).digest
    assert render(spec, dataclasses.replace(plain)).digest == a.digest
    only_a = [line for line in a.files["constants.cuh"].splitlines() if line not in b.files["constants.cuh"].splitlines()]
    only_b = [line for line in b.files["constants.cuh"].splitlines() if line not in a.files["constants.cuh"].splitlines()]
    assert only_a == [] and any("constexpr int INVARIANT_TO = 16;" == line for line in only_b), only_b
    assert all("INVARIANT_TO" in line or line.startswith("//") for line in only_b), only_b
    assert {k: v for k, v in a.files.items() if k not in ("constants.cuh", "plan.json")} == \
        {k: v for k, v in b.files.items() if k not in ("constants.cuh", "plan.json")}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_an_invariant_build_compiles_to_the_plain_builds_cubin(tmp_path):
    """nvcc: the talker's batch-8 kernel invariant to 16 is the plain batch-8 cubin, byte for byte (the invariance is
    the host's attention splits); a batch-4 build is not (the comparison can fail)."""
    from mkport.kernel.build import KERNEL_SOURCE, NVCC_FLAGS

    spec, target = load_spec("qwen3-tts-0.6b-code-predictor"), target_for_arch("sm_90")

    def cubin(plan) -> bytes:
        src = render(spec, plan).write(tmp_path / "src")
        out = tmp_path / f"{src.name}.cubin"
        subprocess.run(["nvcc", "-cubin", *NVCC_FLAGS, "-arch=sm_90", "-I", str(src), str(src / KERNEL_SOURCE), "-o",
                        str(out)], check=True, capture_output=True)
        return out.read_bytes()

    plain = cubin(plan_launch(spec, target, batch=8))
    assert cubin(plan_launch(spec, target, batch=8, invariant_to=16)) == plain
    assert cubin(plan_launch(spec, target, batch=4)) != plain


# -- the server ---------------------------------------------------------------------------------------------------
def _config(streams: int, **kw):
    from mkport.serve.config import ServeConfig

    return ServeConfig(folder=Path("."), model_id="m", backend="megakernel", max_streams=streams, batched=True, **kw)


def test_frame_sizes_of_an_invariant_server():
    """--batch-invariant on the megakernel: a batch's sizes from 2 (a lone stream runs as batch 2), each invariant to the
    batch's size; one stream a batch keeps the plain batch-1 kernel (nothing to be invariant to, no tensor cores paid
    for); the reference backend's rows never depend on the batch, so its sizes stay; without the flag, as before."""
    from mkport.serve.batched import invariant_to, smaller_sizes
    from mkport.tts.planner import Composition

    mk, ref = Composition("megakernel", "megakernel"), Composition("reference", "reference")
    mixed = Composition("megakernel", "reference")
    on = dict(batch_invariant=True)
    assert smaller_sizes(_config(16, **on), mk, 16) == [2, 4, 8] and invariant_to(_config(16, **on), mk, 16) == 16
    assert smaller_sizes(_config(3, **on), mk, 4) == [2] and invariant_to(_config(3, **on), mk, 4) == 4
    assert smaller_sizes(_config(2, **on), mixed, 2) == [] and invariant_to(_config(2, **on), mixed, 2) == 2
    assert smaller_sizes(_config(1, **on), mk, 1) == [] and invariant_to(_config(1, **on), mk, 1) == 0
    assert smaller_sizes(_config(8, **on), ref, 8) == [1, 2, 4] and invariant_to(_config(8, **on), ref, 8) == 0
    assert smaller_sizes(_config(16), mk, 16) == [1, 2, 4, 8] and invariant_to(_config(16), mk, 16) == 0


def test_codec_calls_are_sized_only_where_frames_already_follow_the_load():
    """sized_codec: the default megakernel server (sized frames) gives a codec call only the rows its streams need;
    --fixed-batch and --batch-invariant, which promise a stream's samples the same alone and under load, and the other
    backends, which keep that promise, keep every call at the batch's full rows."""
    from mkport.serve.batched import sized_codec
    from mkport.tts.planner import Composition

    mk, ref = Composition("megakernel", "megakernel"), Composition("reference", "reference")
    assert sized_codec(_config(16), mk) and sized_codec(_config(16), Composition("megakernel", "graphs"))
    assert not sized_codec(_config(16, sized_batches=False), mk)
    assert not sized_codec(_config(16, batch_invariant=True), mk)
    assert not sized_codec(_config(8), ref) and not sized_codec(_config(8), Composition("graphs", "graphs"))


def test_the_invariant_servers_decoders_and_builds_follow_the_batch_size(monkeypatch, tmp_path):
    """frame_batch and prebuild under --batch-invariant: the talker and predictor of every size made invariant to the
    batch's size (decoders stood in for by records, builds rendered, not compiled)."""
    from types import SimpleNamespace

    import mkport.kernel.build
    import mkport.runtime.decoder
    from mkport.serve import batched
    from mkport.tts.planner import Composition

    made = []

    def record(kind):
        def make(*args, **kw):
            made.append((kind, kw["batch"], kw.get("invariant_to", 0)))
            return SimpleNamespace(batch=kw.get("batch"), max_seq=17)
        return make

    monkeypatch.setattr(batched, "make_decoders",
                        lambda model, backend, max_seq, batch, **kw: (record("talker")(batch=batch, **kw),
                                                                      record("predictor")(batch=batch, **kw)))
    monkeypatch.setattr(batched, "make_decoder", record("predictor"))
    monkeypatch.setattr(batched, "first_sequences",
                        lambda talker, b, inv=0: record("talker")(batch=b, **({"invariant_to": inv} if inv else {})))
    monkeypatch.setattr(batched, "FrameBatch", lambda model, talker, predictor, smaller, invariant, wide: invariant)
    model = SimpleNamespace(talker_spec=load_spec("qwen3-tts-0.6b-talker"),
                            predictor_spec=load_spec("qwen3-tts-0.6b-code-predictor"), predictor_weights=None,
                            graphs=True)
    mk = Composition("megakernel", "megakernel")
    assert batched.frame_batch(model, mk, _config(16, batch_invariant=True), 16, 512, None) is True
    assert sorted(made) == sorted([(part, b, 16) for part in ("talker", "predictor") for b in (2, 4, 8, 16)]), made
    made.clear()
    assert batched.frame_batch(model, mk, _config(16), 16, 512, None) is False
    assert sorted(made) == sorted([(part, b, 0) for part in ("talker", "predictor") for b in (1, 2, 4, 8, 16)]), made

    rendered = []
    monkeypatch.setenv("MKPORT_CACHE", str(tmp_path))
    monkeypatch.setattr(mkport.runtime.decoder, "current_device_target", lambda: target_for_arch("sm_90"))
    monkeypatch.setattr(mkport.kernel.build, "build_libraries", lambda jobs, *a: rendered.extend(src for src, _ in jobs))
    batched.prebuild(model, mk, [2, 4, 8, 16], [None], 16)
    import json

    plans = sorted((json.loads((src / "plan.json").read_text())["batch"],
                    json.loads((src / "plan.json").read_text()).get("invariant_to", 0)) for src in rendered)
    assert plans == sorted([(b, 16 if b < 16 else 0) for b in (2, 4, 8, 16)] * 2), plans


def test_the_engine_refuses_what_batch_invariance_cannot_be():
    """By turns (nothing to size), with --fixed-batch (already invariant), and a plan whose code predictor runs on the
    graphs backend (torch's matmuls round a row by the batch's shape): each one line before anything loads."""
    from mkport.serve.engine import Engine, check_invariant_composition
    from mkport.tts.planner import Composition

    with pytest.raises(MkportError, match=r"^--batch-invariant sizes the frames of --batched .*: give --batched too$"):
        Engine(dataclasses.replace(_config(4, batch_invariant=True), batched=False, backend="reference"))
    with pytest.raises(MkportError, match=r"^--batch-invariant and --fixed-batch: .*: give one$"):
        Engine(dataclasses.replace(_config(4, batch_invariant=True), sized_batches=False, backend="reference"))
    with pytest.raises(MkportError, match=r"^--batch-invariant: this composition .* runs the code predictor on the "
                                          r"graphs backend"):
        check_invariant_composition(Composition("megakernel", "graphs"))
    check_invariant_composition(Composition("graphs", "graphs"))  # every frame at the full size: invariant
    check_invariant_composition(Composition("megakernel", "megakernel"))
    assert Engine(dataclasses.replace(_config(4, batch_invariant=True), backend="reference")).config.batch_invariant


def test_a_frames_next_inputs_sum_alike_at_every_number_of_rows():
    """FrameRecipe.next_inputs with ordered_sum (a batch-invariant FrameBatch): each row's 15 embeddings added one after
    another, so a row's input is the same bits whatever the rows beside it; on the CPU the same bits as the one
    reduction of the default recipe (torch sums that dimension in order here)."""
    from types import SimpleNamespace

    from mkport.tts.frames import FrameRecipe

    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 64, 48
    config = SimpleNamespace(codec_eos=5, codec_vocab=2048, num_code_groups=16)
    tables = (torch.randn(15, vocab, hidden, generator=gen) * 3).bfloat16()
    talker = SimpleNamespace(device="cpu", weights=SimpleNamespace(embed=[torch.randn(vocab, hidden).bfloat16()]))
    predictor = SimpleNamespace(weights=SimpleNamespace(embed=tables))
    codes = torch.randint(0, vocab, (16, 16), generator=gen)
    e0, text = torch.randn(16, hidden, generator=gen), torch.randn(16, hidden, generator=gen)
    out = {}
    for ordered in (False, True):
        for rows in (1, 2, 3, 16):
            recipe = FrameRecipe(SimpleNamespace(config=config), talker, predictor, rows)
            recipe.ordered_sum = ordered
            recipe.codes[:] = codes[:rows]
            out[ordered, rows] = recipe.next_inputs(e0[:rows], text[:rows])
    for rows in (1, 2, 3):
        assert torch.equal(out[True, rows], out[True, 16][:rows])
    for rows in (1, 2, 3, 16):
        assert torch.equal(out[True, rows], out[False, rows])


def test_an_invariant_frame_batch_runs_a_lone_stream_as_batch_2(tmp_path):
    """A FrameBatch of 4 with only size 2 below it (an invariant server's rungs, here on the reference backend): a
    request alone in slot 0 runs frames of 2 (its second row idle), frames of 4 once slot 2 is taken, 2 again when it
    has left; each request makes the frames it makes alone, and every size's recipe sums in order."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    from test_tts_batch import MAX_SEQ, TEXTS, _alone, _prompt

    from mkport.runtime.backends import first_sequences
    from mkport.tts.batch import FrameBatch
    from mkport.tts.model import TtsModel, write_random_tts_model
    from mkport.tts.pipeline import TtsSampling, make_decoders

    tiny = TtsModel.load(write_random_tts_model(tmp_path / "tiny", "tiny", seed=0))
    talker, predictor = make_decoders(tiny, "reference", MAX_SEQ, batch=4, device="cpu")
    smaller = [(first_sequences(talker, 2), make_decoders(tiny, "reference", MAX_SEQ, batch=2, device="cpu")[1])]
    frames = FrameBatch(tiny, talker, predictor, smaller, invariant=True)
    assert frames.sizes == [2, 4] and all(rung.recipe.ordered_sum for rung in frames.rungs)
    prompts = [_prompt(tiny, TEXTS[0]), _prompt(tiny, TEXTS[1])]
    samplings = [TtsSampling.from_generation_config(tiny.generation, seed=s) for s in (3, 4)]
    max_frames = [6, 2]
    got, sizes = {0: [], 2: []}, []
    frames.add(0, prompts[0], samplings[0], max_frames[0])
    while frames.requests:
        if len(sizes) == 1:
            frames.add(2, prompts[1], samplings[1], max_frames[1])
        step = frames.step()
        sizes.append(frames.last_size)
        for slot, codes in step.items():
            got[slot].append(codes)
    assert sizes == [2, 4, 4, 2, 2, 2], sizes
    for slot, b in ((0, 0), (2, 1)):
        alone = _alone(tiny, prompts[b], samplings[b], max_frames[b])
        assert len(got[slot]) == len(alone) and all(torch.equal(x, y) for x, y in zip(got[slot], alone)), slot
