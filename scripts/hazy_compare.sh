#!/usr/bin/env bash
# Hazy Research's low-latency-llama megakernel beside mkport's, on the GPU machine, in one call (issue 27):
# builds their extension for sm_90a from .thirdparty/ (laid out by scripts/hazy_fetch.sh; nothing of it is in the
# repository), then runs scripts/hazy_compare.py: both kernels on the same random Llama-3.2-1B weights, timed the way
# `mkport bench` times its step, and checked against mkport's float32 reference.
#
#   bash scripts/hazy_compare.sh OUT_DIR [--build-only | --compile-only] [hazy_compare.py options...]
#
# --compile-only compiles their .cu to an object with the same flags and stops (no GPU, no link: a check that runs on
# a machine without the driver's library).
#
# From the repository root; the device call carries .thirdparty:
#   run(command="bash scripts/hazy_compare.sh $OUT", carry=[".thirdparty"])
# OUT_DIR gets build.log, hazy_compare.json, hazy_compare.md and run.log; each stage writes what it measured even
# when a later one fails. The build is cached in $HAZY_BUILD_DIR (default .hazy-build/, ignored), keyed by the
# sources, the flags and the compiler: a second call on a warm machine skips it.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: bash scripts/hazy_compare.sh OUT_DIR [--build-only] [hazy_compare.py options]}
shift
BUILD_ONLY=0
COMPILE_ONLY=0
if [[ ${1:-} == --build-only ]]; then BUILD_ONLY=1; shift; fi
if [[ ${1:-} == --compile-only ]]; then COMPILE_ONLY=1; shift; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
NVCC=${NVCC:-nvcc}
SRC=.thirdparty/Megakernels
TK=$SRC/ThunderKittens
DEMO=$SRC/demos/low-latency-llama
ARCH=${HAZY_GENCODE:-arch=compute_90a,code=sm_90a}  # nvcc 13 refuses their Makefile's -arch=sm_90a

fail() {  # one clear line, in the log and in the JSON the caller looks for
  echo "hazy_compare: FAILED: $*" | tee -a "$OUT/run.log" >&2
  "$PY" - "$OUT/hazy_compare.json" "$*" <<'EOF' || true
import json, sys
path, why = sys.argv[1:]
try:
    data = json.load(open(path))
except (OSError, ValueError):
    data = {}
data.setdefault("errors", {})["build"] = why
json.dump(data, open(path, "w"), indent=1)
EOF
  exit 1
}

[[ -f $DEMO/llama.cu && -f $TK/include/kittens.cuh ]] \
  || fail "no Hazy sources in .thirdparty/ (run scripts/hazy_fetch.sh where the fetch tool is, and carry .thirdparty)"
command -v "$NVCC" >/dev/null || fail "no nvcc on PATH"

PYINC=$("$PY" -m pybind11 --includes 2>/dev/null) || PYINC=""
if [[ -z $PYINC ]]; then  # no pybind11 package: torch ships its headers
  PYINC=$("$PY" -c "import sysconfig, os, torch; print('-I' + sysconfig.get_paths()['include'], '-I' + os.path.join(os.path.dirname(torch.__file__), 'include'))") \
    || fail "neither pybind11 nor torch gives pybind11's headers to $PY"
fi
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))") || fail "$PY does not run"
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}

# their Makefile's flags for an H100, with -gencode for the target, -arch dropped, no link against libpython (an
# extension module needs none) nor cuBLAS (nothing of theirs calls it), and the driver stub as a fallback for -lcuda
FLAGS=(-DNDEBUG -Xcompiler=-fPIE --expt-extended-lambda --expt-relaxed-constexpr -Xcompiler=-Wno-psabi
       -Xcompiler=-fno-strict-aliasing --use_fast_math -forward-unknown-to-host-compiler -O3
       -Xptxas=--verbose -Xptxas=--warn-on-spills -std=c++20 -lineinfo -DKITTENS_HOPPER -gencode "$ARCH"
       -I"$TK/include" -I"$SRC/include" $PYINC -shared -fPIC)
LIBS=(-L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lrt -lpthread -ldl -lcuda -lcudadevrt -lcudart_static)

KEY=$( { cat "$SRC/../SOURCES" 2>/dev/null; find "$SRC/include" "$TK/include" "$DEMO" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' \) | sort | xargs sha256sum;
         echo "${FLAGS[*]} ${LIBS[*]} $EXT"; "$NVCC" --version; } | sha256sum | cut -c1-16)
BUILD=${HAZY_BUILD_DIR:-.hazy-build}/$KEY
MODULE=$BUILD/mk_llama$EXT
if [[ $COMPILE_ONLY == 1 ]]; then
  mkdir -p "$BUILD"
  start=$(date +%s)
  "$NVCC" -x cu -c "$DEMO/llama.cu" "${FLAGS[@]}" -o "$BUILD/mk_llama.o" >"$OUT/build.log" 2>&1 \
    || fail "nvcc exit $? compiling Hazy's llama.cu (first error: $(grep -m1 -iE 'error|cannot find' "$OUT/build.log" || tail -n 1 "$OUT/build.log"))"
  echo "hazy_compare: compiled $BUILD/mk_llama.o in $(( $(date +%s) - start )) s; $(grep -o 'Used [0-9]* registers[^\"]*' "$OUT/build.log" | head -n 1)" | tee -a "$OUT/run.log"
  exit 0
fi
if [[ -f $MODULE ]]; then
  echo "hazy_compare: cached build $MODULE" | tee -a "$OUT/run.log"
  cp "$BUILD/build.log" "$OUT/build.log" 2>/dev/null || true
else
  mkdir -p "$BUILD"
  echo "hazy_compare: building $MODULE ($ARCH)" | tee -a "$OUT/run.log"
  start=$(date +%s)
  "$NVCC" -x cu "$DEMO/llama.cu" "${FLAGS[@]}" "${LIBS[@]}" -o "$BUILD/mk_llama.tmp$EXT" >"$BUILD/build.log" 2>&1
  rc=$?
  cp "$BUILD/build.log" "$OUT/build.log"
  [[ $rc == 0 ]] || fail "nvcc exit $rc building Hazy's extension (last line: $(grep -m1 -iE 'error|cannot find' "$BUILD/build.log" || tail -n 1 "$BUILD/build.log"))"
  mv "$BUILD/mk_llama.tmp$EXT" "$MODULE"
  echo "hazy_compare: built in $(( $(date +%s) - start )) s; $(grep -m1 -o 'Used [0-9]* registers[^\"]*' "$BUILD/build.log" || echo 'register count not in the log')" | tee -a "$OUT/run.log"
fi
[[ $BUILD_ONLY == 1 ]] && exit 0

# under the device call's 600 s: a hung kernel is cut here, and the JSON keeps the stages that ended before it
left=$(( ${HAZY_DEADLINE:-570} - SECONDS ))
(( left > 60 )) || fail "only $left s left for the run after the build (HAZY_DEADLINE=${HAZY_DEADLINE:-570})"
timeout -k 10 "$left" "$PY" scripts/hazy_compare.py --out "$OUT" --hazy-src "$SRC" --hazy-module-dir "$BUILD" "$@" 2>&1 \
  | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
[[ $rc == 124 || $rc == 137 ]] && fail "hazy_compare.py cut after $left s (a hang? hazy_compare.json keeps the stages that ended)"
exit "$rc"
