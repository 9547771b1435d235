"""Compiling rendered sources: an nvcc resource check (no GPU needed) and the JIT build for the runtime."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .cache import lock_for, replace_durably, temp_name, write_atomic
from ..errors import MkportError
from .gpu import GpuTarget
from .interface import PREFILL_FUNCTIONS
from .launch_plan import LaunchPlan

KERNEL_SOURCE = "decode_step.cu"
DECODE_KERNEL = "decode_step_kernel"  # the persistent kernel the plan sizes; the rest are the prefill's
NVCC_FLAGS = ["-std=c++17", "-O3"]


@dataclass
class KernelResources:
    kernel: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    static_smem: int = 0


@dataclass
class CheckResult:
    arch: str
    dynamic_smem: int
    kernels: list[KernelResources] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def nvcc() -> str:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    if candidate.exists():
        return str(candidate)
    raise MkportError("nvcc not found: install the CUDA toolkit (12.8 or newer) or set CUDA_HOME")


def parse_ptxas(text: str) -> list[KernelResources]:
    """Per-kernel resources from `ptxas -v` output. Spills and stack of the device functions the kernel
    calls (reported under their own names) are added to the kernel's."""
    kernels: list[KernelResources] = []
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernels.append(KernelResources(m.group(1)))
            continue
        if not kernels:
            continue
        current = kernels[-1]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stack, stores, loads = map(int, m.groups())
            current.stack_bytes = max(current.stack_bytes, stack)
            current.spill_stores += stores
            current.spill_loads += loads
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current.static_smem = int(s.group(1)) if s else 0
    return kernels


def compile_check(src_dir: Path, plan: LaunchPlan, target: GpuTarget, trace: bool = False) -> CheckResult:
    """Compiles the kernel for target.arch and checks registers, spills and shared memory against it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc(), "-c", *NVCC_FLAGS, f"-arch={target.arch}", "-Xptxas", "-v", "-I", str(src_dir)]
        if trace:
            cmd.append("-DMK_TRACE=1")
        cmd += [str(Path(src_dir) / KERNEL_SOURCE), "-o", str(Path(tmp) / "decode_step.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
        raise MkportError(f"nvcc failed for {target.arch}: {first}")
    result = CheckResult(target.arch, plan.smem_bytes, parse_ptxas(proc.stderr))
    if not result.kernels:
        raise MkportError(f"nvcc printed no resource report for {target.arch}")
    if not any(k.kernel == DECODE_KERNEL for k in result.kernels):
        raise MkportError(f"nvcc printed no resource report of {DECODE_KERNEL} for {target.arch}")
    for k in result.kernels:
        if k.spill_stores or k.spill_loads:
            result.problems.append(f"{k.kernel}: spills {k.spill_stores} bytes stored, {k.spill_loads} loaded")
        if k.kernel != DECODE_KERNEL:
            continue  # the prefill's kernels: their launch bounds fit their registers; small static shared memory
        if k.registers > plan.max_regs_per_thread:
            result.problems.append(
                f"{k.kernel}: {k.registers} registers a thread, the plan allows {plan.max_regs_per_thread}"
            )
        if k.static_smem + plan.smem_bytes > target.smem_per_block:
            result.problems.append(
                f"{k.kernel}: {k.static_smem + plan.smem_bytes} bytes of shared memory, "
                f"{target.arch} allows {target.smem_per_block}"
            )
    return result


def device_ptr(t) -> int:
    """The address a kernel takes for a tensor, 0 (null) for None."""
    return 0 if t is None else t.data_ptr()


class KernelLibrary:
    """The compiled decode step, loaded with ctypes: launch() takes the Params (interface.KernelParams); prefill(name,
    *args, stream) launches one of the prefill's fused kernels."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.mk_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._lib.mk_blocks_per_sm.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self._lib.mk_error_string.restype = ctypes.c_char_p
        self._lib.mk_prefill_delta_floats.restype = ctypes.c_longlong
        self.params_bytes = self._lib.mk_params_bytes()
        for name, args in PREFILL_FUNCTIONS.items():
            getattr(self._lib, name).argtypes = [*args, ctypes.c_void_p]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise MkportError(f"{what} failed: {self._lib.mk_error_string(code).decode()}")

    def blocks_per_sm(self) -> int:
        blocks = ctypes.c_int(0)
        self._check(self._lib.mk_blocks_per_sm(ctypes.byref(blocks)), "occupancy query")
        return blocks.value

    def launch(self, params: ctypes.Structure, stream: int) -> None:
        """Launches the decode step with `params` (interface.KernelParams), copied into the launch: the caller may
        change them for the next step at once."""
        if ctypes.sizeof(params) != self.params_bytes:
            raise MkportError(f"params have {ctypes.sizeof(params)} bytes, the kernel wants {self.params_bytes}")
        self._check(self._lib.mk_launch(ctypes.addressof(params), stream), "decode step launch")

    def prefill(self, name: str, *args) -> None:
        self._check(getattr(self._lib, name)(*args), f"{name} launch")

    def prefill_attn_smem(self, context: int) -> int:
        """Shared memory bytes of the prefill's attention kernel for a prompt ending at row `context`."""
        return self._lib.mk_prefill_attn_smem(context)

    def prefill_delta_smem(self) -> int:
        """Shared memory bytes a block of mk_prefill_delta_rule's kernels takes (0 without linear attention)."""
        return self._lib.mk_prefill_delta_smem()

    def prefill_delta_floats(self, n: int) -> int:
        """Workspace floats of mk_prefill_delta_rule for n rows (0 for a spec without linear attention)."""
        return self._lib.mk_prefill_delta_floats(n)


def nvcc_version(compiler: str) -> str:
    """`nvcc --version`, asked once per compiler file (a replaced nvcc is asked again)."""
    stat = os.stat(compiler)
    return _nvcc_version(compiler, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _nvcc_version(compiler: str, mtime_ns: int, size: int) -> str:
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise MkportError(f"{compiler} --version failed: {(proc.stderr.strip() or 'no output')[:200]}")
    return proc.stdout.strip()


def build_key(src_dir: Path, version: str, flags: list[str]) -> str:
    """Names a build by everything that changes the binary: the sources as they are on disk, the nvcc
    version and the flags (arch and variant included)."""
    h = hashlib.sha256()
    for path in sorted(Path(src_dir).glob("*.cu*")):
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode() + data)
    h.update(f"\0{version}\0{' '.join(flags)}".encode())
    return h.hexdigest()[:16]


def _file_record(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _record_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".json")


def library_intact(lib: Path) -> bool:
    """True when the library is exactly the file its build recorded beside it (size and sha256): a
    truncated or overwritten library is rebuilt, never loaded (loading one can end the process with SIGBUS)."""
    try:
        record = json.loads(_record_path(lib).read_text())
        return _file_record(lib) == {"bytes": record["bytes"], "sha256": record["sha256"]}
    except (OSError, ValueError, KeyError, TypeError):
        return False


def ensure_library(src_dir: Path, arch: str, trace: bool = False, profile: bool = False, log=None) -> tuple[Path, bool]:
    """The kernel's shared library beside its sources, built once per build_key. One process builds under
    a file lock while the others wait and then use its result; the library is written under a unique name,
    flushed and renamed into place, then recorded (size, sha256) for library_intact. The nvcc command is the
    one `generate --check` runs. Returns (path, was_cached)."""
    src_dir = Path(src_dir)
    compiler = nvcc()
    variant = "trace" if trace else "profile" if profile else "fast"
    flags = [*NVCC_FLAGS, f"-arch={arch}"] + (["-DMK_TRACE=1"] if trace else []) + (["-DMK_PROFILE=1"] if profile else [])
    version = nvcc_version(compiler)
    lib = src_dir / f"decode_step_{arch}_{variant}_{build_key(src_dir, version, flags)}.so"
    with lock_for(lib):
        if library_intact(lib):
            if log:
                log(f"using cached build {lib}")
            return lib, True
        if log:
            log(f"{'rebuilding damaged' if lib.exists() else 'building'} {lib}")
        tmp = temp_name(lib)
        try:
            cmd = [compiler, "-shared", "-Xcompiler", "-fPIC", *flags, "-I", str(src_dir),
                   str(src_dir / KERNEL_SOURCE), "-o", str(tmp)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
                raise MkportError(f"nvcc failed for {arch}: {first}")
            replace_durably(tmp, lib)
        finally:
            tmp.unlink(missing_ok=True)
        write_atomic(_record_path(lib), json.dumps({**_file_record(lib), "nvcc": version, "flags": flags}, indent=1))
    return lib, False


def build_library(
    src_dir: Path, arch: str, trace: bool = False, profile: bool = False, log=None
) -> tuple[KernelLibrary, bool]:
    """ensure_library, loaded with ctypes. Returns (library, was_cached)."""
    path, cached = ensure_library(src_dir, arch, trace, profile, log)
    return KernelLibrary(path), cached


def build_libraries(jobs, arch: str, workers: int, log=lambda message: None) -> None:
    """ensure_library for each (source folder, kind) of `jobs`, kind one of fast, trace, profile: `workers` nvcc
    runs side by side, so that the decoders and tests that follow load every library from the cache."""

    def build(job) -> str:
        src, kind = job
        ensure_library(src, arch, trace=kind == "trace", profile=kind == "profile")
        return f"{src.name} ({kind})"

    with ThreadPoolExecutor(workers) as pool:
        for built in pool.map(build, jobs):
            log(f"built {built}")
