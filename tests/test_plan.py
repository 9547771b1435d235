"""The planner (mkport.tts.planner) on CPU: candidate compositions, the schedule model on synthetic group times (split
against serial, graphs against the megakernel), the choice, plan files, validation's regret; and
mkport.tts.compose end to end on the tiny model with the reference backend standing in for a GPU backend."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from mkport.errors import MkportError
from mkport.tts.planner import (FRAME_AUDIO_MS, Composition, Estimate, GroupTimes, Measured, Plan, Validation,
                         choose, enumerate_compositions, key, plan_rows, read_plan, score, split_sms, validation_rows,
                         write_plan)

warnings.filterwarnings("ignore", category=FutureWarning)

MK, GR = "megakernel", "graphs"
S = 100  # SMs of the synthetic GPU: the splits tried give the codec 12, 25 and 50 of them


def synthetic(scale_with_sms: bool = False, codec: float = 2.0, batch: int = 8) -> GroupTimes:
    """Group times at one batch size: the megakernels take 1 ms (T) and 3 ms (L) on every SM, and on fewer SMs
    either the same plus 5-50% (bound by memory bandwidth, which a part of the GPU still mostly has) or in inverse
    proportion to their SMs (`scale_with_sms`); graphs take 2 + 5 ms. The codec's call for a frame of every stream:
    `codec` ms; the host's turn 0.5 ms."""
    t = GroupTimes("synthetic GPU", S)
    slower = {100: 1.0, 88: 1.05, 75: 1.1, 50: 1.5}
    for sms, factor in slower.items():
        factor = S / sms if scale_with_sms else factor
        t.talker[key(MK, batch, sms)] = 1.0 * factor
        t.predictor[key(MK, batch, sms)] = 3.0 * factor
    t.talker[key(GR, batch, S)], t.predictor[key(GR, batch, S)] = 2.0, 5.0
    t.prefill[key(MK, batch)], t.prefill[key(GR, batch)] = 3.0, 4.0
    t.overhead[key(batch)] = 0.5
    t.codec[key(batch)] = codec
    return t


def test_enumeration_pairs_every_backend_and_splits_only_megakernels():
    comps = enumerate_compositions(132)
    serial = {(c.talker, c.predictor) for c in comps if c.sharing == "serial"}
    assert serial == {(MK, MK), (MK, GR), (GR, MK), (GR, GR)}
    splits = [c for c in comps if c.sharing == "split"]
    assert [c.codec_sms for c in splits] == split_sms(132) == [16, 33, 66]
    assert all((c.talker, c.predictor) == (MK, MK) for c in splits)
    assert len(set(comps)) == len(comps) == 7
    assert enumerate_compositions(132, backends=("reference",)) == [Composition("reference", "reference")]
    assert split_sms(S) == [12, 25, 50] and split_sms(2) == [1] and split_sms(1) == []
    with pytest.raises(MkportError, match="split of the SMs needs the talker and the predictor on the megakernel"):
        Composition(GR, MK, 16)
    with pytest.raises(MkportError, match="codec_sms -1"):
        Composition(MK, MK, -1)
    assert Composition(MK, GR).label == "mk+graphs serial" and Composition(MK, MK, 33).label == "mk+mk split 33"


def test_score_follows_the_documented_formulas():
    t = synthetic()
    # serial: producer T + L + host = 1 + 3 + 0.5, then the codec's call, 2; first audio: prefill, a frame, its codec
    assert score(Composition(MK, MK), t, 8) == Estimate(frame_ms=6.5, first_chunk_ms=3 + 4.5 + 2, producer_ms=4.5,
                                                        codec_ms=2.0)
    # split 50: producer on 50 SMs 1.5 + 4.5 + 0.5; the codec on half the SMs, twice as long; the slower sets the pace
    est = score(Composition(MK, MK, 50), t, 8)
    assert est == Estimate(frame_ms=6.5, first_chunk_ms=3 + 6.5 + 4, producer_ms=6.5, codec_ms=4.0)
    assert est.rtf == 6.5 / FRAME_AUDIO_MS
    # split 12: the codec's share is too small: 2 * 100 / 12 a frame
    assert score(Composition(MK, MK, 12), t, 8).frame_ms == pytest.approx(200 / 12)
    assert score(Composition(GR, MK), t, 8).frame_ms == 2 + 3 + 0.5 + 2
    assert score(Composition(MK, MK), t, 16) is None  # nothing timed at 16
    del t.talker[key(MK, 8, 75)]
    assert score(Composition(MK, MK, 25), t, 8) is None


def test_split_wins_when_the_megakernels_barely_slow_on_fewer_sms():
    (choice,) = choose(synthetic(codec=3.0), [8], enumerate_compositions(S))
    assert choice.pick == Composition(MK, MK, 50)  # max(5.5 + 1, 3 * 2) = 6.5 against serial 4.5 + 3
    assert [c for c, _ in choice.estimates][0] == choice.pick
    frames = [e.frame_ms for _, e in choice.estimates]
    assert frames == sorted(frames)


def test_serial_wins_when_the_megakernels_slow_with_fewer_sms():
    (choice,) = choose(synthetic(scale_with_sms=True, codec=3.0), [8], enumerate_compositions(S))
    assert choice.pick == Composition(MK, MK)  # 4.5 + 3 = 7.5; split 25: max(4 / 0.75 + 0.5, 12) = 12


def test_graphs_win_where_their_times_are_lower():
    t = synthetic(batch=1)
    # batch 32: the megakernel on every SM only (its splits not timed), slower than graphs
    t.talker[key(MK, 32, S)], t.predictor[key(MK, 32, S)] = 5.0, 12.0
    t.talker[key(GR, 32, S)], t.predictor[key(GR, 32, S)] = 3.0, 8.0
    t.prefill[key(MK, 32)], t.prefill[key(GR, 32)] = 3.0, 4.0
    t.overhead[key(32)], t.codec[key(32)] = 1.0, 8.0
    small, large = choose(t, [1, 32], enumerate_compositions(S))
    assert small.pick.talker == MK and small.pick.predictor == MK
    assert large.pick == Composition(GR, GR)
    assert len(large.estimates) == 4  # the splits at 32 were not timed: not scored
    t.talker[key(MK, 32, S)] = 2.5  # the megakernel's talker now the faster: the pick mixes backends
    assert choose(t, [32], enumerate_compositions(S))[0].pick == Composition(MK, GR)


def test_choice_keeps_real_time_and_breaks_ties_by_first_chunk():
    t = synthetic(codec=1.0)
    # graphs' talker as fast as the megakernel's, its prefill faster: a tie on the frame, won by the first chunk
    t.talker[key(GR, 8, S)], t.predictor[key(GR, 8, S)] = 1.0, 3.0
    t.prefill[key(GR, 8)] = 1.0
    comps = [Composition(MK, MK), Composition(GR, GR)]
    assert choose(t, [8], comps)[0].pick == Composition(GR, GR)
    t.predictor[key(GR, 8, S)] = 3.0 * 1.05  # 3% slower: no longer a tie
    assert choose(t, [8], comps)[0].pick == Composition(MK, MK)
    t.codec[key(8)] = FRAME_AUDIO_MS  # 80 ms of codec a frame: nothing is real time
    (choice,) = choose(t, [8], comps)
    assert choice.pick is None and len(choice.estimates) == 2


def _plan() -> Plan:
    t = synthetic()
    choices = choose(t, [8], enumerate_compositions(S))
    runs = [Measured(c, [e.frame_ms * 1.1, e.frame_ms * 1.12], [e.first_chunk_ms, e.first_chunk_ms + 1])
            for c, e in choices[0].estimates]
    return Plan("synthetic-model", "talker 2 layers x 256, code predictor 1 layers x 128", t, choices,
                [Validation(8, choices[0].pick, runs)])


def test_plan_file_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    assert json.loads(path.read_text())["version"] == 3
    back = read_plan(path)
    assert back.to_dict() == plan.to_dict()
    assert back.pick(8) == plan.choices[0].pick
    with pytest.raises(MkportError, match="the plan has no batch 16; it has 8"):
        back.pick(16)


def test_a_plan_gives_its_pick_only_for_its_model_and_device():
    plan = _plan()
    shape, pick = plan.shape, plan.choices[0].pick
    assert plan.composition_for(8, shape, "synthetic GPU", S) == pick
    with pytest.raises(MkportError, match=r"made for a model of talker 2 layers x 256, .*, not this one \(talker 28"):
        plan.composition_for(8, "talker 28 layers x 1024, code predictor 5 layers x 1024", "synthetic GPU", S)
    with pytest.raises(MkportError, match=r"made on synthetic GPU \(100 SMs\), not on this synthetic GPU \(50 SMs\)"):
        plan.composition_for(8, shape, "synthetic GPU", 50)  # e.g. a MIG slice of the same GPU
    with pytest.raises(MkportError, match="the plan has no batch 4; it has 8"):
        plan.composition_for(4, shape, "synthetic GPU", S)
    plan.choices[0].pick = None
    with pytest.raises(MkportError, match="no composition is real time at batch 8, so none is picked there"):
        plan.composition_for(8, shape, "synthetic GPU", S)


def _damaged(d: dict, case: str) -> dict:
    if case == "version":
        d["version"] = 1  # before the model's shape was kept
    elif case == "no_version":
        del d["version"]
    elif case == "negative_time":
        d["times"]["talker"][key(MK, 8, S)] = -1.0
    elif case == "no_times":
        del d["times"]
    elif case == "no_shape":
        del d["shape"]
    elif case == "unknown_pick":
        d["batches"][0]["pick"] = {"talker": GR, "predictor": MK, "codec_sms": 7}
    elif case == "bad_composition":
        d["batches"][0]["estimates"][0]["composition"] = {"talker": MK}
    elif case == "split_of_graphs":
        d["batches"][0]["pick"] = {"talker": GR, "predictor": GR, "codec_sms": 7}
    elif case == "run_without_time":
        d["validation"][0]["runs"][0]["frame_ms"] = []
    return d


@pytest.mark.parametrize("case", ["version", "no_version", "negative_time", "no_times", "no_shape", "unknown_pick",
                                  "bad_composition", "split_of_graphs", "run_without_time"])
def test_a_bad_plan_file_is_refused_in_one_line(tmp_path, case):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_damaged(_plan().to_dict(), case)))
    with pytest.raises(MkportError) as e:
        read_plan(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_is_not_a_plan(tmp_path):
    with pytest.raises(MkportError, match="plan file not found"):
        read_plan(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(MkportError, match="not valid JSON"):
        read_plan(tmp_path / "x.json")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(MkportError, match="not a JSON object"):
        read_plan(tmp_path / "x.json")


def test_validation_regret_and_noise():
    a, b = Composition(MK, MK), Composition(GR, GR)
    v = Validation(8, a, [Measured(a, [10.0, 10.2, 10.1], [5, 5, 5]), Measured(b, [9.0, 9.1, 9.05], [6, 6, 6])])
    assert v.best == b
    assert v.regret == pytest.approx(10.1 / 9.05 - 1)
    assert not v.pick_is_best  # 11.6% slower, the runs spread by 2%
    v = Validation(8, a, [Measured(a, [10.0, 10.3, 9.3], [5, 5, 5]), Measured(b, [9.8, 10.1, 9.9], [6, 6, 6])])
    assert v.best == b and 0 < v.regret < v.measured(a).spread and v.pick_is_best  # within the noise
    v = Validation(8, b, v.runs)
    assert v.regret == 0 and v.pick_is_best


def test_table_rows_mark_the_pick_and_the_measured_best():
    plan = _plan()
    rows = plan_rows(plan)
    assert len(rows) == len(plan.choices[0].estimates)
    pick = plan.choices[0].pick
    (pick_row,) = [r for r in rows if "pick" in r[-1]]
    assert pick_row[1] == pick.label
    assert [r for r in rows if "best" in r[-1]][0][1] == plan.validation[0].best.label
    assert all(r[5] != "-" for r in rows)  # every scored composition was measured
    (v,) = validation_rows(plan)
    assert v[:2] == ["8", pick.label] and v[-1] in ("yes", "no")


# -- mkport.tts.compose on CPU, the reference backend standing in for graphs --------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mkport.tts.model import write_random_tts_model

    return write_random_tts_model(tmp_path_factory.mktemp("plan") / "tiny", "tiny", seed=0)


class CodecClock:
    """mkport.tts.compose's clock, with the codec's calls replaced by calls that take `ms` each on this clock and no
    real time (they return zeros of the right shape): the runner's and the measurement's accounting of the codec
    becomes exact. `real`: the clock also runs with the host's (else it stands still but for the codec)."""

    def __init__(self, real: bool):
        self.real, self.ms, self.codec_s = real, 20.0, 0.0

    def perf_counter(self) -> float:
        return (time.perf_counter() if self.real else 0.0) + self.codec_s

    def decode(self, codec, streams, frames) -> torch.Tensor:
        self.codec_s += self.ms / 1e3
        return torch.zeros(len(streams), codec.decoder.upsample)


def _clock(monkeypatch, real: bool) -> CodecClock:
    import mkport.tts.compose as compose
    from mkport.tts.codec import CodecStreams

    clock = CodecClock(real)
    monkeypatch.setattr(compose, "time", clock)
    monkeypatch.setattr(CodecStreams, "decode", lambda self, streams, frames: clock.decode(self, streams, frames))
    return clock


def _runnable(tiny, backend: str) -> str:
    """'reference' stands in for the graphs backend until that lands (and where it cannot run on a CPU)."""
    from mkport.tts.pipeline import make_decoders
    from mkport.tts.model import TtsModel

    try:
        make_decoders(TtsModel.load(tiny), backend, 8, 1, device="cpu")
    except MkportError as e:
        pytest.skip(f"backend {backend} does not run here: {e}")
    return backend


@pytest.mark.parametrize("backend", ["reference", GR])
def test_make_plan_on_cpu_times_scores_and_validates(tiny, tmp_path, monkeypatch, backend):
    import mkport.tts.planner
    import mkport.tts.compose as compose

    backend = _runnable(tiny, backend)
    clock = _clock(monkeypatch, real=True)
    for name in ("TALKER_STEPS", "PREDICTOR_PASSES", "WHOLE_FRAMES"):  # a CPU is slow: one of each
        monkeypatch.setattr(compose, name, 1)
    monkeypatch.setattr(mkport.tts.planner, "FRAME_AUDIO_MS", 1e5)  # ... and far from real time: make it so
    plan = compose.make_plan(tiny, [1, 2], check=True, backends=(backend,), device="cpu", repeats=1, runs=1)
    t = plan.times
    assert t.sm_count == 1
    for batch in (1, 2):
        for table in (t.talker, t.predictor, t.prefill):
            assert table[key(backend, batch, 1) if table is not t.prefill else key(backend, batch)] > 0
        assert t.overhead[key(batch)] >= 0
        assert t.codec[key(batch)] == pytest.approx(clock.ms, abs=5)  # one call for every stream's frame
    assert [c.batch for c in plan.choices] == [1, 2]
    for choice, v in zip(plan.choices, plan.validation):
        assert choice.pick == Composition(backend, backend) == v.pick
        (run,) = v.runs
        assert v.best == run.composition and v.regret == 0 and v.pick_is_best
        assert run.frame > clock.ms  # a frame of B streams includes the codec's call for all of them
        assert run.first_chunk > clock.ms  # its prefill, its first frame and its codec call
    assert plan.shape == "talker 2 layers x 256, code predictor 1 layers x 128"  # the tiny model's
    write_plan(plan, tmp_path / "plan.json")
    assert read_plan(tmp_path / "plan.json").to_dict() == plan.to_dict()


def test_a_run_on_cpu_refuses_a_split(tiny):
    from mkport.tts.compose import Pool, run_composition
    from mkport.tts.model import TtsModel

    pool = Pool(TtsModel.load(tiny), "cpu", 1)
    with pytest.raises(MkportError, match="needs a CUDA GPU"):
        run_composition(pool, Composition(MK, MK, 1), 1)


def test_a_run_times_one_codec_call_a_frame_and_the_joiners_first(tiny, monkeypatch):
    """Serial, on a clock that only the codec moves: every frame of the timed window has one codec call for all the
    streams, and the last stream's first audio is the call of its first frame."""
    from mkport.tts.compose import Pool, run_composition
    from mkport.tts.model import TtsModel

    clock, batch = _clock(monkeypatch, real=False), 3
    pool = Pool(TtsModel.load(tiny), "cpu", batch)
    frame, first = run_composition(pool, Composition("reference", "reference"), batch)
    assert frame == pytest.approx(clock.ms)
    assert first == pytest.approx(clock.ms)


# -- the command ---------------------------------------------------------------------------------------------
def _cli(*args: str, cwd=None):
    import os
    import subprocess
    import sys

    env = dict(os.environ, COLUMNS="400", NO_COLOR="1", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "mkport.cli", "plan", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


PLAN_BAD = {
    "no_model": ([], "give exactly one of DIR"),
    "both": (["somewhere", "--random-weights", "0.6b"], "give exactly one of DIR"),
    "unknown_random": (["--random-weights", "9b"], "unknown --random-weights '9b'"),
    "not_a_folder": (["nowhere"], "plan needs a Qwen3-TTS model folder"),
    "batch_not_a_number": (["--random-weights", "0.6b", "--batch", "1,x"], "--batch '1,x': x is not an integer >= 1"),
    "batch_zero": (["--random-weights", "0.6b", "--batch", "0"], "--batch '0': 0 is not an integer >= 1"),
    "batch_too_large": (["--random-weights", "0.6b", "--batch", "8,65"], "--batch 65: must be 1..64 (streams)"),
    "empty_item": (["--random-weights", "0.6b", "--batch", "1,,8"], "--batch '1,,8': an empty item"),
    "no_runs": (["--random-weights", "0.6b", "--validate", "--runs", "0"], "--runs 0: must be 1..20"),
    "json_folder_missing": (["--random-weights", "0.6b", "--json", "no/such/plan.json"],
                            "--json no/such/plan.json: the folder no/such does not exist"),
}


@pytest.mark.parametrize("case", list(PLAN_BAD))
def test_plan_rejects_bad_input_before_needing_a_gpu(tmp_path, monkeypatch, case):
    """Each an MkportError of one line (which main() prints as `error: ...`, exit 2: the subprocess test below),
    raised before the GPU is looked for."""
    from typer.testing import CliRunner

    import mkport.runtime.decoder
    from mkport.cli import app

    def no_gpu_look():
        raise AssertionError("the GPU was looked for before the input was checked")

    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", no_gpu_look)
    monkeypatch.chdir(tmp_path)
    args, fragment = PLAN_BAD[case]
    result = CliRunner().invoke(app, ["plan", *args])
    assert isinstance(result.exception, MkportError), result.output
    assert fragment in str(result.exception) and "\n" not in str(result.exception)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_plan_without_a_gpu_says_so_in_one_line(tmp_path):
    proc = _cli("--random-weights", "0.6b", "--batch", "1,8", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: no CUDA GPU is visible: this command runs the megakernel (generate --check needs none)"


def test_plan_command_prints_the_table_and_writes_the_file(tmp_path, monkeypatch):
    """The command's wiring, make_plan replaced by a synthetic plan: the table names every composition and the
    pick, the notes say what was not timed, and --json writes the plan."""
    from typer.testing import CliRunner

    import mkport.runtime.decoder
    import mkport.tts.compose
    import mkport.tts.model
    from mkport.cli import app

    plan = _plan()
    plan.times.notes[key(GR, 8)] = "backend 'graphs' is not supported"
    asked = {}

    def fake_make_plan(folder, batches, check=False, runs=3, **kwargs):
        asked.update(folder=folder, batches=batches, check=check, runs=runs)
        return plan

    monkeypatch.setattr(mkport.runtime.decoder, "require_gpu", lambda spec=None: None)
    monkeypatch.setattr(mkport.tts.model, "random_model_folder", lambda which, seed=0: tmp_path / which)
    monkeypatch.setattr(mkport.tts.compose, "make_plan", fake_make_plan)
    result = CliRunner().invoke(app, ["plan", "--random-weights", "0.6b", "--batch", "8", "--validate", "--runs", "2",
                                      "--json", str(tmp_path / "plan.json")], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert asked == {"folder": tmp_path / "0.6b", "batches": [8], "check": True, "runs": 2}
    for comp, _ in plan.choices[0].estimates:
        assert comp.label in result.output
    assert "not timed: graphs at batch 8: backend 'graphs' is not supported" in result.output
    assert "regret" in result.output and "pick is best" in result.output
    assert read_plan(tmp_path / "plan.json").to_dict() == plan.to_dict()
