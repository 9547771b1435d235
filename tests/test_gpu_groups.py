"""The GPU suite's xdist groups (conftest.xdist_group_for): under `pytest -n N --dist loadgroup -m gpu`, the GPU tests
of bundled specs with large checkpoints share one worker, so at most one such model and its reference are resident."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import LARGE_CHECKPOINT_BYTES, LARGE_CHECKPOINT_GROUP, pytest_collection_modifyitems, xdist_group_for
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import checkpoint_bytes


def test_large_bundled_specs_share_a_worker_on_the_gpu():
    assert checkpoint_bytes(load_spec("mistral-7b-v0.1")) > LARGE_CHECKPOINT_BYTES > checkpoint_bytes(load_spec("qwen3-0.6b"))
    assert xdist_group_for({"name": "qwen3-30b-a3b", "kernel": "v16"}, gpu=True) == LARGE_CHECKPOINT_GROUP
    assert xdist_group_for({"index": 3, "name": "mistral-7b-v0.1"}, gpu=True) == LARGE_CHECKPOINT_GROUP
    assert xdist_group_for({"name": "qwen3-tts-0.6b-talker", "kernel": "v16"}, gpu=True) is None
    assert xdist_group_for({"name": "qwen3-30b-a3b"}, gpu=False) is None  # a CPU test of it runs anywhere
    assert xdist_group_for({"case": "qwen3"}, gpu=True) is None  # a tiny model's case name, not a bundled spec


class _Item:
    """What the collection hook reads of a test item and writes to it."""

    def __init__(self, params: dict | None, gpu: bool):
        self.callspec = SimpleNamespace(params=params) if params is not None else None
        self.gpu, self.added = gpu, []

    def get_closest_marker(self, name):
        return object() if name == "gpu" and self.gpu else None

    def add_marker(self, marker):
        self.added.append(marker)


def test_the_collection_hook_marks_only_large_gpu_tests():
    items = [_Item({"name": "mixtral-8x7b", "kernel": "v16"}, gpu=True), _Item({"name": "qwen3-0.6b"}, gpu=True),
             _Item({"name": "mixtral-8x7b"}, gpu=False), _Item(None, gpu=True)]
    pytest_collection_modifyitems(None, items)
    assert [[(m.name, m.args) for m in item.added] for item in items] == [
        [("xdist_group", (LARGE_CHECKPOINT_GROUP,))], [], [], []]
