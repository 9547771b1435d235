"""The cache: write-once folders (made whole or not at all), the build cache (keyed by everything that
changes the binary, locked, checked before a load), atomic rendering, and `mkport cache list|clear`."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mkport.kernel import build
from mkport.kernel.build import ensure_library, library_intact
from mkport.kernel.cache import clear_cache, list_cache, write_once
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import PARAM_FIELDS, PREFILL_FUNCTIONS
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec
from mkport.kernel.launch_plan import plan_launch


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


# -- the build cache ------------------------------------------------------------------------------------
FAKE_NVCC = """#!/bin/sh
# a stand-in for nvcc: --version prints VERSION; a build logs one line to $FAKE_NVCC_LOG, takes a moment,
# and writes its arguments (but the output name) as the "library"
if [ "$1" = "--version" ]; then echo "VERSION"; exit 0; fi
echo build >> "$FAKE_NVCC_LOG"
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; shift; else args="$args $1"; fi
  shift
done
sleep 0.3
printf 'library built with%s' "$args" > "$out"
"""


class FakeNvcc:
    def __init__(self, folder: Path):
        self.script, self.log = folder / "nvcc", folder / "nvcc.log"
        self.set_version("Cuda compilation tools, release 13.0, V13.0.88")

    def set_version(self, version: str) -> None:
        """A new compiler file, as an upgrade of the toolkit leaves."""
        self.script.unlink(missing_ok=True)
        self.script.write_text(FAKE_NVCC.replace("VERSION", version))
        self.script.chmod(0o755)

    def builds(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """A fake nvcc first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = FakeNvcc(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVCC_LOG", str(fake.log))
    return fake


def _sources(folder: Path, text: str = "// kernel\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "decode_step.cu").write_text(text)
    (folder / "common.cuh").write_text("// constants\n")
    return folder


def test_a_cached_build_is_reused(tmp_path, fake_nvcc):
    src = _sources(tmp_path / "src")
    lib, cached = ensure_library(src, "sm_90")
    assert not cached and fake_nvcc.builds() == 1 and lib.read_text().startswith("library built with")
    assert ensure_library(src, "sm_90") == (lib, True) and fake_nvcc.builds() == 1


def test_the_build_key_covers_nvcc_flags_arch_variant_and_sources(tmp_path, fake_nvcc, monkeypatch):
    src = _sources(tmp_path / "src")
    first, _ = ensure_library(src, "sm_90")
    others = {
        "arch": ensure_library(src, "sm_80")[0],
        "variant": ensure_library(src, "sm_90", trace=True)[0],
    }
    monkeypatch.setattr(build, "NVCC_FLAGS", build.NVCC_FLAGS + ["-lineinfo"])
    others["flags"] = ensure_library(src, "sm_90")[0]
    monkeypatch.setattr(build, "NVCC_FLAGS", build.NVCC_FLAGS[:-1])
    fake_nvcc.set_version("Cuda compilation tools, release 13.1, V13.1.10")
    others["nvcc"] = ensure_library(src, "sm_90")[0]
    fake_nvcc.set_version("Cuda compilation tools, release 13.0, V13.0.88")
    (src / "common.cuh").write_text("// other constants\n")
    others["sources"] = ensure_library(src, "sm_90")[0]
    assert len({first, *others.values()}) == 1 + len(others), others
    assert fake_nvcc.builds() == 1 + len(others)  # each a build of its own, none reused wrongly
    assert "-lineinfo" in others["flags"].read_text() and "-lineinfo" not in first.read_text()


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "no_record"])
def test_a_damaged_cached_library_is_rebuilt(tmp_path, fake_nvcc, damage):
    src = _sources(tmp_path / "src")
    lib, _ = ensure_library(src, "sm_90")
    good = lib.read_bytes()
    if damage == "truncate":
        lib.write_bytes(good[: len(good) // 2])
    elif damage == "overwrite":
        lib.write_bytes(good.upper())
    else:
        lib.with_name(lib.name + ".json").unlink()
    assert not library_intact(lib)
    messages = []
    assert ensure_library(src, "sm_90", log=messages.append) == (lib, False)
    assert lib.read_bytes() == good and library_intact(lib) and fake_nvcc.builds() == 2
    assert messages == [f"rebuilding damaged {lib}"]


def _build_in_another_process(src: str) -> str:
    return str(ensure_library(Path(src), "sm_90")[0])


def test_concurrent_builds_build_once(tmp_path, fake_nvcc):
    src = _sources(tmp_path / "src")
    context = multiprocessing.get_context("fork")
    with context.Pool(4) as pool:
        paths = pool.map(_build_in_another_process, [str(src)] * 4)
    assert len(set(paths)) == 1 and fake_nvcc.builds() == 1  # one built, three waited and used it
    assert library_intact(Path(paths[0]))
    assert [p.name for p in src.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_truncated_real_library_is_rebuilt_and_loads(tmp_path):
    """With the real nvcc, loaded by ctypes in a fresh process each time (before, a truncated cached
    library was loaded as it was, and the process died)."""
    src = _sources(tmp_path / "src", LAUNCHER)
    load = [sys.executable, "-c", "import sys; from mkport.kernel.build import build_library; "
            "lib, cached = build_library(sys.argv[1], 'sm_90'); print(cached, lib.params_bytes)", str(src)]
    expected = f"False {8 * len(PARAM_FIELDS)}"
    first = subprocess.run(load, capture_output=True, text=True, timeout=300)
    assert first.stdout.strip() == expected, first.stderr
    (lib,) = src.glob("*.so")
    cut = tmp_path / "cut.so"
    cut.write_bytes(lib.read_bytes()[:4096])
    os.replace(cut, lib)  # as a full disk or a killed copy leaves it
    second = subprocess.run(load, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.strip() == expected, second.stderr
    assert library_intact(lib)


# The host side of a decode step without a kernel: enough for KernelLibrary to load it.
LAUNCHER = """
extern "C" {
int mk_params_bytes() { return %d; }
int mk_launch(const char*, void*) { return 0; }
int mk_blocks_per_sm(int* blocks) { *blocks = 1; return 0; }
const char* mk_error_string(int) { return "none"; }
long long mk_prefill_delta_floats(int) { return 0; }
%s
}
""" % (8 * len(PARAM_FIELDS), "\n".join(f"int {name}() {{ return 0; }}" for name in PREFILL_FUNCTIONS))


# -- rendered sources -----------------------------------------------------------------------------------
def test_concurrent_renders_never_show_a_torn_file(tmp_path):
    """Writers replace a stale copy of the sources while readers read: every read is the stale file or the
    whole new one (before, files were rewritten in place and readers saw them cut short)."""
    spec = load_spec("qwen3-tts-0.6b-talker")
    sources = render(spec, plan_launch(spec, target_for_arch("sm_90")))
    folder = sources.write(tmp_path)
    stale = {name: "// stale\n" * 4000 for name in sources.files}
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            for name in sources.files:
                try:
                    seen.add((name, (folder / name).read_text()))
                except FileNotFoundError:
                    pass

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for _ in range(15):
            for name, text in stale.items():  # a stale copy, put in place whole
                (tmp_path / name).write_text(text)
                os.replace(tmp_path / name, folder / name)
            writers = [threading.Thread(target=sources.write, args=(tmp_path,)) for _ in range(3)]
            for t in writers:
                t.start()
            for t in writers:
                t.join()
    finally:
        stop.set()
        for t in readers:
            t.join()
    torn = {name for name, text in seen if text not in (sources.files[name], stale[name])}
    assert torn == set()
    assert all((folder / name).read_text() == text for name, text in sources.files.items())


# -- mkport cache list / clear --------------------------------------------------------------------------
def _fill(root: Path, outside: Path) -> dict[str, Path]:
    """A cache root with one entry of each kind, things of the user's beside them, and links that point
    out of the cache."""
    made = {
        "build": root / "builds" / "qwen3-0.6b-0123456789ab",
        "weights": root / "random" / "qwen3-0.6b-0123456789ab-seed0",
        "tts": root / "tts-random" / "tiny-0",
        "compiled": root / "compiled" / "fxgraph",
    }
    for i, folder in enumerate(made.values()):
        folder.mkdir(parents=True)
        (folder / "data.bin").write_bytes(b"x" * (1000 * (i + 1)))
    (root / "builds" / ".qwen3-0.6b-0123456789ab.lock").write_text("")
    outside.mkdir()
    (outside / "precious.safetensors").write_bytes(b"keep")
    (root / "random" / "linked-seed9").symlink_to(outside, target_is_directory=True)
    (root / "notes.txt").write_text("the user's")
    (root / "mine").mkdir()
    (root / "mine" / "model.safetensors").write_bytes(b"mine")
    return made


def test_cache_list_and_clear(tmp_path):
    root, outside = tmp_path / "cache", tmp_path / "outside"
    made = _fill(root, outside)
    entries = {(e.kind, e.name): e.size for e in list_cache(root)}
    assert entries == {("build", made["build"].name): 1000, ("random weights", made["weights"].name): 2000,
                       ("random weights", "linked-seed9"): (root / "random" / "linked-seed9").lstat().st_size,
                       ("random TTS model", "tiny-0"): 3000, ("compiled codec", "fxgraph"): 4000}
    removed = clear_cache("builds", root)
    assert [e.name for e in removed] == [made["build"].name, "fxgraph"] and not made["build"].exists()
    assert not made["compiled"].exists()
    assert made["weights"].exists() and made["tts"].exists()
    removed = clear_cache("weights", root)
    assert {e.name for e in removed} == {made["weights"].name, "linked-seed9", "tiny-0"}
    assert list_cache(root) == []
    assert (outside / "precious.safetensors").read_bytes() == b"keep"  # the link went, not its target
    assert (root / "notes.txt").exists() and (root / "mine" / "model.safetensors").exists()
    with pytest.raises(MkportError, match="unknown cache group 'everything'"):
        clear_cache("everything", root)


def test_cache_clear_all_leaves_a_linked_folder_and_the_users_files(tmp_path):
    root, outside = tmp_path / "cache", tmp_path / "outside"
    _fill(root, outside)
    shutil.rmtree(root / "builds")
    (root / "builds").symlink_to(outside, target_is_directory=True)  # a whole kind pointed elsewhere
    clear_cache("all", root)
    assert (outside / "precious.safetensors").exists() and not (root / "builds").exists()
    assert sorted(p.name for p in root.iterdir()) == ["compiled", "mine", "notes.txt", "random", "tts-random"]
    assert list_cache(root) == []


def test_cache_commands(tmp_path):
    root, outside = tmp_path / "cache", tmp_path / "outside"
    made = _fill(root, outside)
    env = dict(os.environ, MKPORT_CACHE=str(root), COLUMNS="80", NO_COLOR="1")

    def mkport(*args):
        return subprocess.run([sys.executable, "-m", "mkport.cli", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    listed = json.loads(mkport("cache", "list", "--json").stdout)
    assert listed["root"] == str(root) and {e["name"] for e in listed["entries"]} == {
        made["build"].name, made["weights"].name, "linked-seed9", "tiny-0", "fxgraph"}
    table = mkport("cache", "list").stdout
    assert made["build"].name in table and "5 entries" in table
    proc = mkport("cache", "clear")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: give one of --builds, --weights or --all"
    proc = mkport("cache", "clear", "--weights")
    assert proc.returncode == 0 and "removed 3 entries" in proc.stdout
    assert made["build"].exists() and not made["weights"].exists()
    assert (outside / "precious.safetensors").exists()


def test_a_cache_that_is_a_file_is_refused(tmp_path):
    """MKPORT_CACHE naming a file: `cache list` says so in one line (it listed 0 entries, exit 0), the file kept."""
    root = tmp_path / "cache"
    root.write_text("mine")
    env = dict(os.environ, MKPORT_CACHE=str(root), COLUMNS="80", NO_COLOR="1")
    proc = subprocess.run([sys.executable, "-m", "mkport.cli", "cache", "list"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: the mkport cache {root} is a file, not a folder: set MKPORT_CACHE to a folder"
    assert root.read_text() == "mine"
