"""The cache's write-once folders: made whole or not at all, and reused after that."""

from __future__ import annotations

import pytest

from mkport.cache import write_once


def _visible(folder):
    """Entries other than the hidden lock files (kept: removing a lock file races with its next user)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_write_once_writes_once_and_reuses(tmp_path):
    calls = []

    def write(tmp):
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "model.safetensors").write_text("x")

    folder = tmp_path / "cache" / "model-seed0"
    assert write_once(folder, write) == folder
    assert write_once(folder, write) == folder
    assert len(calls) == 1 and (folder / "model.safetensors").read_text() == "x"
    assert _visible(folder.parent) == ["model-seed0"]  # no temporary left


def test_write_once_leaves_nothing_after_a_failed_write(tmp_path):
    def write(tmp):
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    folder = tmp_path / "cache" / "model-seed0"
    with pytest.raises(RuntimeError, match="disk full"):
        write_once(folder, write)
    assert not folder.exists() and _visible(folder.parent) == []
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]
