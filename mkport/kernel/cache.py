"""The mkport cache: where it is, how things get into it safely, and what `mkport cache list|clear` sees.

Layout under cache_root() ($MKPORT_CACHE, or ~/.cache/mkport):
  builds/<name>-<digest>/      rendered sources and the compiled decode_step_*.so (runtime.Decoder)
  random/<name>-<digest>-seed<N>/   seeded random checkpoints (mkport diff/bench --random-weights)
  tts-random/<which>-<N>/      seeded random Qwen3-TTS model folders (speak/bench --random-weights)
  compiled/                    torch.compile's own cache of the compiled speech decoder (mkport serve, batched on a GPU)

Everything is written under a unique temporary name (host, process and a random part, so that two
machines sharing a cache never collide), flushed to disk and renamed into place: a reader sees a
whole file or folder or none.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..errors import MkportError

BUILDS, RANDOM_WEIGHTS, RANDOM_TTS, COMPILED = "builds", "random", "tts-random", "compiled"
KINDS = {BUILDS: "build", RANDOM_WEIGHTS: "random weights", RANDOM_TTS: "random TTS model", COMPILED: "compiled codec"}
CLEAR_GROUPS = {"builds": (BUILDS, COMPILED), "weights": (RANDOM_WEIGHTS, RANDOM_TTS), "all": tuple(KINDS)}


def cache_root() -> Path:
    root = Path(os.environ.get("MKPORT_CACHE") or Path.home() / ".cache" / "mkport")
    if root.exists() and not root.is_dir():  # else `cache list` says it is empty, and builds fail deep inside
        raise MkportError(f"the mkport cache {root} is a file, not a folder: set MKPORT_CACHE to a folder")
    return root


def temp_name(path: Path) -> Path:
    """A sibling of `path` no other process or machine picks (the PID alone repeats across containers)."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")


def lock_for(path: Path) -> FileLock:
    """The lock that guards making `path` (a hidden file beside it)."""
    return FileLock(str(path.with_name(f".{path.name}.lock")))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def replace_durably(tmp: Path, path: Path) -> None:
    """Renames a written temporary into place after its bytes are on disk, then records the rename."""
    fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Writes `path` whole: a temporary beside it, flushed, then renamed over it."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_once(folder: Path, write) -> Path:
    """Returns `folder`, having made it with write(tmp) first if it does not exist. One process writes
    (a file lock), the others wait and reuse its result; the folder appears whole or not at all (written
    under a private name, then renamed), so an existing one is complete."""
    if folder.exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with lock_for(folder):
        if folder.exists():  # made by another process while this one waited
            return folder
        tmp = temp_name(folder)
        try:
            write(tmp)
            for path in tmp.rglob("*"):
                if path.is_file():
                    fsync_file(path)
            os.replace(tmp, folder)
            _fsync_dir(folder.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write
    return folder


# -- mkport cache list / clear --------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheEntry:
    kind: str  # a value of KINDS
    name: str
    path: Path
    size: int  # bytes

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "path": str(self.path), "bytes": self.size}


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir() or p.is_symlink())


def list_cache(root: Path | None = None) -> list[CacheEntry]:
    """What the cache holds, by kind, largest first within a kind."""
    root = cache_root() if root is None else Path(root)
    entries = []
    for sub, kind in KINDS.items():
        folder = root / sub
        if not folder.is_dir() or folder.is_symlink():
            continue
        found = [CacheEntry(kind, p.name, p, _size(p)) for p in folder.iterdir() if not p.name.startswith(".")]
        entries += sorted(found, key=lambda e: (-e.size, e.name))
    return entries


def clear_cache(group: str, root: Path | None = None) -> list[CacheEntry]:
    """Removes the cache's builds, weights (random checkpoints and TTS models) or all of them; returns what
    was removed. Only the known sub-folders of the cache root are touched, and a symbolic link is removed
    as a link, never followed, so nothing outside the cache root is ever deleted."""
    if group not in CLEAR_GROUPS:
        raise MkportError(f"unknown cache group '{group}'; supported: {', '.join(CLEAR_GROUPS)}")
    root = cache_root() if root is None else Path(root)
    removed = []
    for sub in CLEAR_GROUPS[group]:
        folder = root / sub
        if folder.is_symlink():  # someone pointed it elsewhere: drop the link, keep what it points at
            folder.unlink()
            continue
        if not folder.is_dir():
            continue
        removed += [e for e in list_cache(root) if e.path.parent == folder]
        for path in folder.iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return removed
