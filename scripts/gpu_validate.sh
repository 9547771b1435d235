#!/usr/bin/env bash
# Everything that needs the GPU, in one go (run on the H200 from the repository root):
#   bash scripts/gpu_validate.sh tests|diff|bench|tts|all|batch|plan|sanitize|soak|families|family-specs|published|unvalidated
# GPU tests, `mkport diff --layer-by-layer` (clean and with an injected fault) and `mkport bench` for every
# bundled spec; tts: the Qwen3-TTS checks against the official code, `mkport speak` and `mkport bench-tts`
# (mkport, the official pipeline, faster-qwen3-tts) on the random 0.6b and 1.7b models. Results: $RESULTS (default results/), one JSON per run.
set -uo pipefail
what=${1:-all}
RESULTS=${RESULTS:-results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
mkport() { python3 -m mkport.cli "$@"; }
specs=${SPECS:-$(python3 -c "from mkport.kernel.spec import bundled_names; print(' '.join(bundled_names()))")}
status=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$RESULTS/gpu-tests.log" | tail -3 || status=1
fi
if [[ $what == diff || $what == all ]]; then
  i=0
  for s in $specs; do
    mkport diff "$s" --layer-by-layer --random-weights --json "$RESULTS/diff-$s.json" > "$RESULTS/diff-$s.txt" 2>&1
    echo "diff $s: exit $? ($(tail -n 1 "$RESULTS/diff-$s.txt"))"
    # the middle layer, an op of its kind (a hybrid's linear layer has its own: check.diff.injectable_ops)
    at=$(python3 -c "from mkport.kernel.spec import load_spec; from mkport.check.diff import injectable_ops
s = load_spec('$s'); layer = s.num_layers // 2; ops = injectable_ops(s, layer); print(f'{layer}:{ops[$i % len(ops)]}')")
    mkport diff "$s" --layer-by-layer --random-weights --inject "$at" --json "$RESULTS/inject-$s.json" > "$RESULTS/inject-$s.txt" 2>&1
    echo "inject $s $at: exit $? ($(tail -n 1 "$RESULTS/inject-$s.txt"))"
    i=$((i + 1))
  done
fi
if [[ $what == families ]]; then
  # The families after the Llama lineage: their GPU tests (feature ablations, windows past the attention splits and in
  # a batch, phi3's split, the fused prefill, Mistral-7B-v0.1 past its window of 4096), then the new bundled specs
  # diffed clean and with a fault in the middle layer (a NoPE layer's q for smollm3-3b).
  python3 -m pytest -q -m gpu tests/test_gpu_families.py tests/test_gpu_prefill.py -k "famil or window" 2>&1 \
    | tee "$RESULTS/gpu-families.log" | tail -3 || status=1
  for run in "granite-3.1-2b 20:attn_residual" "smollm3-3b 19:q" "mistral-7b-v0.3 16:mlp_residual"; do
    set -- $run
    mkport diff "$1" --layer-by-layer --random-weights --json "$RESULTS/diff-$1.json" > "$RESULTS/diff-$1.txt" 2>&1
    echo "diff $1: exit $? ($(tail -n 1 "$RESULTS/diff-$1.txt"))"
    mkport diff "$1" --layer-by-layer --random-weights --inject "$2" --json "$RESULTS/inject-$1.json" > "$RESULTS/inject-$1.txt" 2>&1
    echo "inject $1 $2: exit $? ($(tail -n 1 "$RESULTS/inject-$1.txt"))"
  done
fi
if [[ $what == family-specs ]]; then
  # Issue 28's bundled family specs at full size, random weights (FAMILY_SPECS: a subset). Every build first, nvcc side
  # by side; then the diffs up to four specs at once (one process each, on the GPU by turns; the random checkpoints and
  # float32 references are made side by side): clean, with a fault in an op of the family's own (Gemma 2: o_proj under
  # the post-attention norm of a full layer; Gemma 3: k through its k norm on a sliding layer; OLMo 2: o_proj under its
  # post-norm; Phi-3.5: the k rows of the fused qkv_proj; Granite: o_proj under its residual multiplier; SmolLM3: q on
  # a NoPE layer), and the sliding specs past their windows (512, 4096). Then `mkport bench` against transformers'
  # static cache and CUDA graphs at context 128, one spec at a time; last, the table (scripts/family_table.py).
  new=(${FAMILY_SPECS:-gemma-2-2b gemma-3-1b olmo-2-0425-1b phi-3.5-mini granite-3.1-2b smollm3-3b mistral-7b-v0.3 mistral-7b-v0.1})
  declare -A fault=([gemma-2-2b]=13:attn_residual [gemma-3-1b]=13:k [olmo-2-0425-1b]=8:attn_residual [phi-3.5-mini]=16:k
                    [granite-3.1-2b]=20:attn_residual [smollm3-3b]=19:q [mistral-7b-v0.3]=16:mlp_residual
                    [mistral-7b-v0.1]=16:k)
  declare -A past=([gemma-2-2b]=4200 [gemma-3-1b]=600 [mistral-7b-v0.1]=4200)
  python3 scripts/plan_variants.py --build-only --specs "$(IFS=,; echo "${new[*]}")" --kinds trace,fast \
    --jobs "$(nproc)" > "$RESULTS/family-specs-build.log" 2>&1 || { status=1; tail -n 3 "$RESULTS/family-specs-build.log"; }
  # as many diffs at once as host memory holds: each peaks near 3x its bf16 checkpoint (the weights, the whole float32
  # reference below diff.LAYERED_REFERENCE_BYTES); two 7B ones beside two others were killed for memory
  at_once=$(python3 -c "import sys; from mkport.kernel.spec import load_spec; from mkport.runtime.weights import checkpoint_bytes
need = max(3 * checkpoint_bytes(load_spec(s)) for s in sys.argv[1:])
avail = next(int(l.split()[1]) * 1024 for l in open('/proc/meminfo') if l.startswith('MemAvailable'))
print(max(1, min(4, int(0.9 * avail // need))))" "${new[@]}")
  echo "family-specs: $at_once diffs at once"
  started=0
  for s in "${new[@]}"; do
    (
      mkport diff "$s" --layer-by-layer --random-weights --json "$RESULTS/diff-$s.json" > "$RESULTS/diff-$s.txt" 2>&1
      echo "diff $s: exit $? ($(tail -n 2 "$RESULTS/diff-$s.txt" | tr '\n' ' '))" > "$RESULTS/family-$s.log"
      mkport diff "$s" --layer-by-layer --random-weights --inject "${fault[$s]}" --json "$RESULTS/inject-$s.json" \
        > "$RESULTS/inject-$s.txt" 2>&1
      echo "inject $s ${fault[$s]}: exit $? ($(tail -n 1 "$RESULTS/inject-$s.txt"))" >> "$RESULTS/family-$s.log"
      if [[ -n ${past[$s]:-} ]]; then
        mkport diff "$s" --layer-by-layer --random-weights --prompt-len "${past[$s]}" \
          --json "$RESULTS/diff-$s-past-window.json" > "$RESULTS/diff-$s-past-window.txt" 2>&1
        echo "diff $s --prompt-len ${past[$s]}: exit $? ($(tail -n 2 "$RESULTS/diff-$s-past-window.txt" | tr '\n' ' '))" \
          >> "$RESULTS/family-$s.log"
      fi
    ) &
    (( ++started % at_once == 0 )) && wait
  done
  wait
  # a clean diff passes with its greedy tokens agreeing (one step may differ, at a near tie)
  agree='import json, sys; d = json.load(open(sys.argv[1])); sys.exit(d["token_agreement"] < d["steps"] - 1)'
  for s in "${new[@]}"; do
    cat "$RESULTS/family-$s.log"
    grep -q "^diff $s: exit 0" "$RESULTS/family-$s.log" && grep -q "found exactly there" "$RESULTS/family-$s.log" \
      && python3 -c "$agree" "$RESULTS/diff-$s.json" || status=1
    [[ -z ${past[$s]:-} ]] || { grep -q "^diff $s --prompt-len ${past[$s]}: exit 0" "$RESULTS/family-$s.log" \
      && python3 -c "$agree" "$RESULTS/diff-$s-past-window.json"; } || status=1
  done
  for s in "${new[@]}"; do
    mkport bench "$s" --random-weights --contexts 128 --engines megakernel,hf_graph --steps 100 \
      --json "$RESULTS/bench-$s.json" > "$RESULTS/bench-$s.txt" 2> "$RESULTS/bench-$s.log"
    rc=$?
    echo "bench $s: exit $rc"; cat "$RESULTS/bench-$s.txt"
    [[ $rc == 0 ]] || { status=1; tail -n 3 "$RESULTS/bench-$s.log"; }
  done
  python3 scripts/family_table.py "$RESULTS" "${new[@]}" | tee "$RESULTS/family-table.md"
fi
if [[ $what == unvalidated ]]; then
  # The families validated on the CPU only (spec.GPU_UNVALIDATED_FAMILIES; empty since glm and glm4 passed this way,
  # as the six before them, docs/validation.md): their tiny models' GPU tests (diff alone and as a batch, faults at
  # their layer and op, each feature's ablation; the test ids name the family), then the published configs of those
  # families at full size through `published` below
  read -r families published < <(python3 -c "import json, pathlib; from mkport.kernel.spec import GPU_UNVALIDATED_FAMILIES as f
names = [p.stem for p in sorted(pathlib.Path('tests/published_configs').glob('*.json'))
         if json.loads(p.read_text()).get('model_type') in f]
print(' or '.join(f) or '-', ' '.join(names))")
  if [[ $families == - ]]; then
    echo "unvalidated: no family awaits its first GPU run (spec.GPU_UNVALIDATED_FAMILIES is empty)"
    what=none
  else
    python3 -m pytest -q -rf -m gpu tests/test_gpu_llama_variants.py -k "$families" 2>&1 \
      | tee "$RESULTS/gpu-unvalidated.log" | tail -3 || status=1
    what=published PUBLISHED=${PUBLISHED:-$published}
  fi
fi
if [[ $what == published ]]; then
  # Configs outside the bundle as a new user brings them (tests/published_configs/; PUBLISHED: a subset), random
  # weights at full size: diffed clean and with a fault in the middle layer, one at a time (the larger ones' float32
  # references run a layer at a time); a model larger than the GPU's free memory is refused in one line (exit 2).
  for name in ${PUBLISHED:-gemma-3-270m-it phi-4-mini-instruct mistral-nemo-instruct-2407 qwen2.5-7b-instruct-yarn mixtral-8x22b-instruct qwen3.5-35b-a3b granite-3.0-1b-a400m ernie-4.5-0.3b-pt helium-1-preview-2b seed-oss-36b-instruct exaone-4.0-32b glm-4-9b-chat-hf glm-4-9b-0414 qwen2.5-vl-7b-instruct}; do
    cfg=tests/published_configs/$name.json
    mkport diff "$cfg" --layer-by-layer --random-weights --json "$RESULTS/diff-$name.json" > "$RESULTS/diff-$name.txt" 2>&1
    rc=$?
    echo "diff $name: exit $rc ($(tail -n 2 "$RESULTS/diff-$name.txt" | tr '\n' ' '))"
    [[ $rc == 0 ]] || { grep -q "mkport runs a model on one GPU" "$RESULTS/diff-$name.txt" && continue; status=1; continue; }
    at=$(python3 -c "import json; from mkport.kernel.spec import spec_from_config; from mkport.check.diff import injectable_ops
s = spec_from_config(json.load(open('$cfg')), 'p'); layer = s.num_layers // 2; print(f'{layer}:{injectable_ops(s, layer)[0]}')")
    mkport diff "$cfg" --layer-by-layer --random-weights --inject "$at" --json "$RESULTS/inject-$name.json" \
      > "$RESULTS/inject-$name.txt" 2>&1
    echo "inject $name $at: exit $? ($(tail -n 1 "$RESULTS/inject-$name.txt"))"
    grep -q "found exactly there" "$RESULTS/inject-$name.txt" || status=1
  done
fi
if [[ $what == bench || $what == all ]]; then
  for s in $specs; do
    mkport bench "$s" --random-weights --contexts 128,2048 --steps 100 --phases --json "$RESULTS/bench-$s.json" 2>/dev/null | tail -n 12
  done
fi
if [[ $what == batch || $what == all ]]; then
  # batched decode: each sequence of a batch against it alone, then step time against the batch size
  python3 scripts/plan_variants.py --build-only --specs "${specs// /,}" --batches 2,4,8,16 --kinds fast --jobs "$(nproc)" > "$RESULTS/batch-build.log" 2>&1 || status=1
  python3 scripts/plan_variants.py --build-only --specs qwen3-tts-0.6b-talker --batches 4 --kinds trace >> "$RESULTS/batch-build.log" 2>&1 || status=1
  grep skipped "$RESULTS/batch-build.log"
  python3 -m pytest -q -s -m gpu tests/test_gpu_batch.py 2>&1 | tee "$RESULTS/gpu-batch.log" | grep -E "near tie|passed|failed|Error" || status=1
  for s in $specs; do
    # the megakernel builds MoE at batch 1 only
    batches=$(python3 -c "from mkport.kernel.spec import load_spec; print('1' if load_spec('$s').moe else '1,2,4,8,16')")
    python3 -m mkport.cli bench "$s" --random-weights --contexts 128 --engines megakernel --batch "$batches" --steps 100 \
      --json "$RESULTS/bench-batch-$s.json" 2>&1 | grep -E "megakernel|floor|Error|error" || status=1
  done
  python3 scripts/profile_batch.py --batches 1,8,16 --json "$RESULTS/profile-batch.json" || status=1
  python3 scripts/bench_tts_batch.py --size 0.6b --batches 1,4,8,16 --json "$RESULTS/tts-batch-0.6b.json" || status=1
  python3 scripts/bench_tts_batch.py --size 1.7b --batches 1,8,16 --json "$RESULTS/tts-batch-1.7b.json" || status=1
fi
if [[ $what == plan || $what == all ]]; then
  # mkport plan: the groups timed alone, every composition scored, then each run end to end against the pick
  # (--validate); two runs a composition keep the stage near 5 minutes with the megakernels already built
  for size in 0.6b 1.7b; do
    timeout 600 python3 -m mkport.cli plan --random-weights "$size" --batch 1,8,16 --validate --runs 2 \
      --json "$RESULTS/plan-$size.json" 2> "$RESULTS/plan-$size.log" | tee "$RESULTS/plan-$size.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || { status=1; tail -n 3 "$RESULTS/plan-$size.log"; }
  done
fi
if [[ $what == sanitize || $what == all ]]; then
  # compute-sanitizer on the megakernel of every bundled spec (a few steps) and one TTS frame (docs/validation.md)
  # racecheck without the TTS frame: under it, torch's Hopper matmuls of the prefill fail
  for tool in memcheck racecheck synccheck; do
    tts=0.6b; [[ $tool == racecheck ]] && tts=''
    timeout 600 compute-sanitizer --tool "$tool" --kernel-name kns=decode_step --print-limit 20 \
      python3 scripts/sanitize_steps.py --steps "${SANITIZE_STEPS:-2}" --tts "$tts" > "$RESULTS/sanitize-$tool.txt" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$RESULTS/sanitize-$tool.txt" | tail -n 1))"
  done
fi
if [[ $what == soak || $what == all ]]; then
  timeout 900 python3 scripts/soak_tts.py --frames "${SOAK_FRAMES:-20000}" --json "$RESULTS/soak.json" > "$RESULTS/soak.txt" 2>&1
  echo "soak: exit $? ($(grep -E '"frames"|ms_per_frame|growth|equal' "$RESULTS/soak.txt" | tr -d '\n'))"
fi
if [[ $what == first-audio ]]; then
  # a warm request's first audio, part by part, then a one-shot `mkport speak` with its kernels cached: wall
  # time, imports (-X importtime) and a function profile
  for size in 0.6b 1.7b; do
    python3 scripts/profile_first_audio.py --size "$size" --json "$RESULTS/first-audio-$size.json" | tee "$RESULTS/first-audio-$size.txt"
  done
  say=(speak "Hello from the megakernel. This is a longer sentence to hear." --random-weights 0.6b --max-frames 60 --force)
  mkport "${say[@]}" --out "$RESULTS/oneshot.wav" > /dev/null 2>&1
  python3 -c "import time; t = time.perf_counter(); import torch; a = time.perf_counter(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); print(f'import torch {a - t:.2f} s, first CUDA call {time.perf_counter() - a:.2f} s')" | tee "$RESULTS/torch-start.txt"
  TIMEFORMAT="wall %R s"
  for i in 1 2; do { time python3 -m mkport.cli "${say[@]}" ${SPEAK_FLAGS:-} --out "$RESULTS/oneshot.wav"; } 2>&1 | tail -n 30 | tee "$RESULTS/oneshot-$i.txt"; done
  python3 -X importtime -m mkport.cli "${say[@]}" --out "$RESULTS/oneshot.wav" 2> "$RESULTS/importtime.txt" > /dev/null
  sort -t'|' -k2 -n "$RESULTS/importtime.txt" | tail -n 25
  python3 -m cProfile -o "$RESULTS/speak.prof" -m mkport.cli "${say[@]}" --out "$RESULTS/oneshot.wav" > /dev/null 2>&1
  python3 -c "import pstats; pstats.Stats('$RESULTS/speak.prof').sort_stats('cumulative').print_stats(60)" > "$RESULTS/speak-prof.txt"
fi
if [[ $what == tts || $what == all ]]; then
  # the official loader and wrapper on CPU (with this machine's transformers), then the GPU checks
  python3 -m pytest -q tests/test_tts_official.py 2>&1 | tee "$RESULTS/tts-official-cpu.log" | tail -3
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  python3 -m pytest -q -s -m gpu tests/test_gpu_tts.py 2>&1 | tee "$RESULTS/gpu-tts.log" | grep -E "frames x 16|codec rel|passed|failed|Error" 
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  for size in 0.6b 1.7b; do
    mkport speak "Hello from the megakernel." --random-weights "$size" --backend megakernel --max-frames 40 \
      --out "$RESULTS/speak-$size.wav" --force 2>&1 | tail -n 3
    mkport bench-tts --random-weights "$size" --steps 100 --json "$RESULTS/bench-tts-$size.json" 2>/dev/null \
      | tee "$RESULTS/bench-tts-$size.txt" || status=1
  done
fi
exit $status
