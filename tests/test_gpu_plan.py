"""`mkport plan --validate` on the GPU (random 0.6b model, batch 1 and 4): the file it writes is consistent with
itself and with the device, and the schedule model is in the range of what the end-to-end runs measure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mkport.tts.planner import BACKENDS, choose, enumerate_compositions, key, read_plan, score

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.serial,  # the plan's times and the runs it checks them against, measured with the GPU to themselves
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BATCHES = [1, 4]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan-0.6b.json"
    proc = subprocess.run([sys.executable, "-m", "mkport.cli", "plan", "--random-weights", "0.6b", "--batch",
                           ",".join(map(str, BATCHES)), "--validate", "--json", str(path)],
                          env=dict(os.environ, COLUMNS="200"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    return read_plan(path), proc.stdout


def test_the_plan_file_is_consistent(planned):
    plan, stdout = planned
    times = plan.times
    assert times.sm_count == torch.cuda.get_device_properties(0).multi_processor_count
    assert [c.batch for c in plan.choices] == BATCHES == [v.batch for v in plan.validation]
    comps = enumerate_compositions(times.sm_count)
    for choice in plan.choices:
        # the megakernel fits the 0.6b at these batch sizes: mk+mk serial and every split were timed
        scored = [c for c, _ in choice.estimates]
        assert {c for c in comps if c.talker == c.predictor == "megakernel"} <= set(scored)
        assert all(c.talker in BACKENDS and c.predictor in BACKENDS for c in scored)
        # the estimates and the pick are what the file's own times give
        assert [(c, score(c, times, choice.batch)) for c, _ in choice.estimates] == choice.estimates
        assert choose(times, [choice.batch], comps)[0].pick == choice.pick
        assert choice.pick is not None  # a random 0.6b is far inside real time at batch 4
        for backend in ("megakernel", "graphs"):
            assert key(backend, choice.batch, times.sm_count) in times.talker or key(backend, choice.batch) in \
                times.notes
    for v, choice in zip(plan.validation, plan.choices):
        assert v.pick == choice.pick
        assert [m.composition for m in v.runs] == [c for c, _ in choice.estimates]
        assert all(min(m.frame_ms) > 0 and min(m.first_chunk_ms) > 0 for m in v.runs)
        assert v.best is not None and v.regret >= 0
    assert "pick" in stdout and "regret" in stdout


def test_the_model_is_near_what_runs_measure(planned):
    """Serial compositions: the estimate sums the groups' times; end to end the frame should not be far off (a
    factor of 2 either way would mean the model misses a cost or counts one twice)."""
    plan, _ = planned
    for choice, v in zip(plan.choices, plan.validation):
        for comp, est in choice.estimates:
            if comp.sharing == "serial":
                ratio = v.measured(comp).frame / est.frame_ms
                assert 0.5 < ratio < 2, (choice.batch, comp.label, est.frame_ms, v.measured(comp).frame)
