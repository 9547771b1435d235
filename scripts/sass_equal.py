"""Does a change to the kernel sources change the compiled code? Renders every bundled spec (batch 1 and 8, or
--batches, where the plan fits) and the family configs of the tests, from BEFORE_REV and from this tree, compiles
each to an sm_90 cubin (fast, trace and profile builds, the flags of build.py) and compares them: the cubin's bytes,
else the SASS of every function (cuobjdump -sass), else each kernel's registers, spills and shared memory
(-res-usage).

    PYTHONPATH=$PWD python scripts/sass_equal.py c17841e [--jobs 2] [--only gemma] [--kinds fast,trace] [--batches 1,16]

Needs nvcc and cuobjdump with nvdisasm (PATH, $CUDA_HOME/bin, or --cuobjdump; the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm carry both; nvdisasm is found beside cuobjdump). BEFORE_REV is
exported with git archive (no worktree is added); each tree renders with its own mkport in a subprocess. Compiled
results are kept under --work by the hash of their sources and flags, so a second run compiles only what changed.
Exits 0 when every case is equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from mkport.kernel.build import KERNEL_SOURCE, NVCC_FLAGS, nvcc, nvcc_version  # noqa: E402

KINDS = {"fast": [], "trace": ["-DMK_TRACE=1"], "profile": ["-DMK_PROFILE=1"]}
BATCHES = (1, 8)
ARCH = "sm_90"

# Run by each tree's own mkport: renders the cases read from stdin into argv[1]/<case>/, prints {case: folder or
# the reason there is none}.
RENDER = r"""
import json, sys
from pathlib import Path
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec, spec_from_config
out = {}
for case in json.load(sys.stdin):
    try:  # a spec this tree does not bundle, or cannot plan, has nothing to compare
        spec = load_spec(case["name"]) if case["config"] is None else spec_from_config(case["config"], case["name"])
        plan = plan_launch(spec, target_for_arch(case["arch"]), batch=case["batch"])
    except MkportError as e:
        out[case["id"]] = {"skip": str(e)}
        continue
    out[case["id"]] = {"dir": str(render(spec, plan).write(Path(sys.argv[1]) / case["id"]))}
print(json.dumps(out))
"""


def family_configs() -> dict:
    """The tests' family configs: the tiny Gemma 1/2/3 of test_gemma.py and the real-sized shapes (yarn, Gemma 2 and
    3, two layers) that test_kernel_families.py compiles."""
    from test_gemma import CONFIGS
    from test_kernel_families import COMPILED

    return {**CONFIGS, **COMPILED}


def cases(only: str | None, batches=BATCHES) -> list[dict]:
    from mkport.kernel.spec import bundled_names

    named = {name: None for name in bundled_names()} | family_configs()
    found = [{"id": f"{name}-b{batch}", "name": name, "config": config, "batch": batch, "arch": ARCH}
             for name, config in named.items() for batch in batches]
    return [c for c in found if only is None or only in c["id"]]


def export(rev: str, dest: Path) -> Path:
    """The tree of `rev` (mkport/ and its package data) in dest, by git archive."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "mkport"],
                             capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    tar = dest / "tree.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()
    return dest


def render_tree(tree: Path, out: Path, todo: list[dict]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", RENDER, str(out)], input=json.dumps(todo), capture_output=True,
                          text=True, cwd=tree, env=env)
    if proc.returncode != 0:
        sys.exit(f"rendering in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def find_tool(name: str, given: str | None) -> str:
    if given:
        return given
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    for candidate in (shutil.which(name), str(Path(home) / "bin" / name)):
        if candidate and Path(candidate).exists():
            return candidate
    sys.exit(f"{name} not found: pass --{name} (pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


class Compiler:
    """Compiles a source folder to a cubin and dumps its SASS and resource usage, kept by the hash of its inputs."""

    def __init__(self, work: Path, cuobjdump: str):
        self.work, self.cuobjdump, self.nvcc = work / "compiled", cuobjdump, nvcc()
        self.work.mkdir(parents=True, exist_ok=True)
        self.version = nvcc_version(self.nvcc)
        self.env = dict(os.environ)
        self.env.setdefault("NVDISASM_PATH", str(Path(cuobjdump).parent))

    def __call__(self, src: Path, kind: str) -> Path:
        flags = [*NVCC_FLAGS, f"-arch={ARCH}", *KINDS[kind]]
        h = hashlib.sha256(f"{self.version}\0{' '.join(flags)}".encode())
        for path in sorted(src.glob("*.cu*")):
            h.update(f"\0{path.name}\0".encode() + path.read_bytes())
        out = self.work / h.hexdigest()[:20]
        if (out / "sass.txt").exists():
            return out
        tmp = Path(tempfile.mkdtemp(dir=self.work.parent))
        cubin = tmp / "kernel.cubin"
        proc = subprocess.run([self.nvcc, "-cubin", *flags, "-I", str(src), str(src / KERNEL_SOURCE), "-o", str(cubin)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp)
            raise RuntimeError(f"nvcc failed on {src} ({kind}): {proc.stderr[-2000:]}")
        for what, option in (("sass.txt", "-sass"), ("res.txt", "-res-usage")):
            dump = subprocess.run([self.cuobjdump, option, str(cubin)], capture_output=True, text=True, env=self.env,
                                  check=True).stdout
            (tmp / what).write_text(dump)
        try:
            tmp.rename(out)
        except OSError:  # another run put it there first
            shutil.rmtree(tmp)
        return out


def verdict(before: Path, after: Path) -> str:
    if (before / "kernel.cubin").read_bytes() == (after / "kernel.cubin").read_bytes():
        return "identical cubin"
    if (before / "sass.txt").read_text() == (after / "sass.txt").read_text():
        return "equal SASS"
    same_res = (before / "res.txt").read_text() == (after / "res.txt").read_text()
    old, new = functions(before / "sass.txt"), functions(after / "sass.txt")
    changed = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
    return (f"DIFFERENT SASS in {', '.join(changed)} "
            f"({'same' if same_res else 'different'} registers, spills and shared memory)")


def functions(sass: Path) -> dict[str, str]:
    """Each function's SASS in a cuobjdump -sass dump, by its (mangled) name."""
    parts = re.split(r"^\s*Function : (\S+)$", sass.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before_rev")
    ap.add_argument("--jobs", type=int, default=2, help="nvcc runs side by side")
    ap.add_argument("--only", help="cases whose id (NAME-bBATCH) contains this")
    ap.add_argument("--kinds", default=",".join(KINDS), help="builds to compare: fast, trace, profile")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes to render, where they fit")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mkport-sass-equal",
                    help="compiled results kept here between runs")
    ap.add_argument("--cuobjdump", help="path of cuobjdump (nvdisasm beside it or on PATH)")
    ap.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    compile_ = Compiler(args.work, find_tool("cuobjdump", args.cuobjdump))
    todo = cases(args.only, [int(b) for b in args.batches.split(",")])
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        before_tree = export(args.before_rev, Path(tmp) / "before")
        rendered = {side: render_tree(tree, Path(tmp) / f"{side}-src", todo)
                    for side, tree in (("before", before_tree), ("after", ROOT))}
        jobs, results, skipped = [], {}, {}
        for case in todo:
            b, a = rendered["before"][case["id"]], rendered["after"][case["id"]]
            if "skip" in b or "skip" in a:
                skipped[case["id"]] = (b.get("skip") or a.get("skip")).splitlines()[0][:100]
                continue
            jobs += [(case["id"], kind, Path(b["dir"]), Path(a["dir"])) for kind in kinds]
        flat = [(src, kind) for _, kind, b, a in jobs for src in (b, a)]
        with ThreadPoolExecutor(args.jobs) as pool:
            built = list(pool.map(lambda job: compile_(*job), flat))
        for i, (case_id, kind, _, _) in enumerate(jobs):
            results[f"{case_id} {kind}"] = verdict(built[2 * i], built[2 * i + 1])
    if args.json:
        print(json.dumps({"results": results, "skipped": skipped}, indent=1))
    else:
        for key, v in results.items():
            print(f"{key:48s} {v}")
        for case_id, why in skipped.items():
            print(f"{case_id:48s} skipped: {why}")
    different = [k for k, v in results.items() if v.startswith("DIFFERENT")]
    print(f"{len(results) - len(different)} equal, {len(different)} different, {len(skipped)} cases skipped",
          file=sys.stderr)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
