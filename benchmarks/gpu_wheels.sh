#!/usr/bin/env bash
# Everything the GPU suite needs on the GPU machine beyond its image and the repository, in one git-ignored folder
# (.gpu/), made on any machine with pip's registry (the GPU machine reaches none):
#   .gpu/wheels/  neoembed built from this checkout and the packages of benchmarks/gpu_wheels.txt: what neoembed
#                 needs that the image (benchmarks/gpu_image.txt: Python 3.12, torch 2.11, transformers 5.17,
#                 sentence-transformers 6.0.1, accelerate 1.15, ...) lacks, as cp312 manylinux x86-64 wheels
#   .gpu/polars/  polars and its runtime (mteb imports it), 54 MB: sent alone in a first device call, since with
#                 the rest the working tree would pass the device's 64 MiB
#   .gpu/shared/  ../shared's data, fixtures/neobert-tiny-official and paper (only the repository travels)
#   .gpu/neobert/ the NeoBERT of the suite's mteb-precision step: benchmarks/demo_pretrain.sh's fine-tuned
#                 pre-trained model with its weights stored in fp16 (to fit; the fp32 run upcasts them exactly, so
#                 fp16 and fp32 evaluation compare the same weights). demo_pretrain.sh runs once into
#                 .gpu-cache/demo-pretrain (about 40 min on 2 CPU cores) and is reused after.
# It ends with the offline check: pip resolves neoembed from .gpu/wheels and .gpu/polars alone plus metadata-only
# stand-ins for the image's packages at their versions (pip install --dry-run --no-index --target), and each
# device call's working tree (tracked files + what it carries) must stay under 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh           # build or refresh .gpu/, then check it
#   bash benchmarks/gpu_wheels.sh --check   # only the check
#   bash benchmarks/gpu_wheels.sh --lock    # re-resolve benchmarks/gpu_wheels.txt against the registry first (after
#                                           # a change to pyproject's dependencies or to gpu_image.txt)
#
# On the GPU machine, two calls in a row (the second within the machine's 30 s warm window, which keeps the first's
# install in /tmp/neoembed-site; if it went cold, gpu_suite.sh says so and runs without polars, see its header):
#   1. carry [".gpu/polars"]:
#      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/neoembed-site .gpu/polars/*.whl
#   2. carry [".gpu/wheels", ".gpu/shared", ".gpu/neobert"], timeout_s 600:
#      bash benchmarks/gpu_suite.sh --wheels .gpu/wheels --shared .gpu/shared --neobert .gpu/neobert 2>&1 |
#        tee $OUT/gpu_suite.log; tar czf $OUT/results.tgz benchmarks/results/*_cuda.* runs/mteb-precision
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu
CACHE=.gpu-cache
LIMIT=$((64 * 1024 * 1024))
PY=${PYTHON:-python}
SHARED=$(cd ../shared 2>/dev/null && pwd) || { echo "../shared not found beside the repository" >&2; exit 2; }
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
  manylinux2014 manylinux1; do PLATFORMS+=(--platform "${p}_x86_64"); done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
MODE=build
case "${1:-}" in
  "") ;;
  --check) MODE=check ;;
  --lock) MODE=lock ;;
  -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
  *) echo "unknown argument '$1': use --check, --lock or nothing" >&2; exit 2 ;;
esac
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

neoembed_wheel() {  # neoembed from this checkout, the only neoembed wheel in $1
  rm -f "$1"/neoembed-*.whl
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$1" .
}

lock() {  # resolve neoembed against the registry with the image's pinned packages as stand-ins
  neoembed_wheel "$TMP/dist"
  "$PY" benchmarks/_gpu_wheels.py stubs "$TMP/stubs"
  grep -E '^[A-Za-z0-9].*==' benchmarks/gpu_image.txt >"$TMP/pins.txt"
  "$PY" -m pip install -q --dry-run --ignore-installed --report "$TMP/report.json" "${TARGET[@]}" \
    --target "$TMP/site" --find-links "$TMP/stubs" -c "$TMP/pins.txt" "$TMP"/dist/neoembed-*.whl
  "$PY" benchmarks/_gpu_wheels.py lock "$TMP/report.json"
}

wheels() {  # download the pinned wheels; drop any other version left from an earlier lock
  mkdir -p "$DIR/wheels"
  mv "$DIR"/polars/*.whl "$DIR/wheels/" 2>/dev/null || true
  "$PY" benchmarks/_gpu_wheels.py carried >"$TMP/carried.txt"
  "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR/wheels" -r "$TMP/carried.txt"
  "$PY" - "$DIR/wheels" "$TMP/carried.txt" <<'PY'
import re, sys
from pathlib import Path
want = {re.sub(r"[-_.]+", "-", l.split("==")[0]).lower() + "==" + l.split("==")[1] for l in open(sys.argv[2]).read().split()}
for whl in Path(sys.argv[1]).glob("*.whl"):
    name, version = whl.name.split("-")[:2]
    if re.sub(r"[-_.]+", "-", name).lower() + "==" + version not in want and name != "neoembed":
        print(f"removing {whl.name}: not in gpu_wheels.txt"); whl.unlink()
PY
  neoembed_wheel "$DIR/wheels"
  # the records the suite writes name this commit (the GPU machine's copy has no git)
  { git rev-parse HEAD | tr -d '\n'; git diff --quiet HEAD || printf -- '-dirty'; echo; } >"$DIR/wheels/COMMIT"
  rm -rf "$DIR/polars"
  mkdir -p "$DIR/polars"
  for name in $("$PY" benchmarks/_gpu_wheels.py first); do mv "$DIR/wheels/${name//-/_}"-*.whl "$DIR/polars/"; done
}

shared() {  # ../shared's parts the suite reads (its README and cards say what they are)
  rm -rf "$DIR/shared"
  mkdir -p "$DIR/shared/fixtures"
  cp -r "$SHARED/data" "$SHARED/paper" "$DIR/shared/"
  cp -r "$SHARED/fixtures/neobert-tiny-official" "$DIR/shared/fixtures/"
  chmod -R u+w "$DIR/shared"
}

neobert() {  # the demo's fine-tuned pre-trained NeoBERT, built once; its weights in fp16
  local run="$CACHE/demo-pretrain/finetuned-pretrained-lr1.0e-4"
  if [ ! -f "$run/config.json" ]; then
    mkdir -p "$CACHE"
    echo "building the demo NeoBERT (once): bash benchmarks/demo_pretrain.sh $CACHE/demo-pretrain 400 300"
    time bash benchmarks/demo_pretrain.sh "$CACHE/demo-pretrain" 400 300 >"$CACHE/demo-pretrain.log" 2>&1
  fi
  rm -rf "$DIR/neobert"
  cp -r "$run" "$DIR/neobert"
  rm -rf "$DIR"/neobert/checkpoint-* "$DIR"/neobert/*.pt "$DIR"/neobert/optimizer* "$DIR"/neobert/scheduler*
  "$PY" - "$DIR/neobert" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
for f in Path(sys.argv[1]).rglob("*.safetensors"):
    tensors = {k: v.half() if v.is_floating_point() else v for k, v in load_file(f).items()}
    save_file(tensors, f, metadata={"format": "pt"})
    print(f"{f}: fp16, {f.stat().st_size} bytes")
PY
}

size() { du -sb "$@" | awk '{s += $1} END {print s}'; }

check() {  # offline resolution against the image's versions; each device call under 64 MiB
  "$PY" benchmarks/_gpu_wheels.py stubs "$TMP/image" --assumed
  "$PY" -m pip install --dry-run --no-index --find-links "$DIR/wheels" --find-links "$DIR/polars" \
    --find-links "$TMP/image" "${TARGET[@]}" --target "$TMP/site" "$DIR"/wheels/neoembed-*.whl | tail -1
  local repo first second
  repo=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
  first=$((repo + $(size "$DIR/polars")))
  second=$((repo + $(size "$DIR/wheels" "$DIR/shared" "$DIR/neobert")))
  for part in "$DIR"/*; do echo "  $(size "$part") bytes  $part"; done
  echo "tracked files: $repo bytes; device call 1 (.gpu/polars): $first bytes; call 2 (wheels, shared, neobert):"
  echo "  $second bytes; the limit: $LIMIT bytes each"
  [ "$first" -lt "$LIMIT" ] && [ "$second" -lt "$LIMIT" ] || { echo "a call is over 64 MiB: carry less" >&2; exit 1; }
}

[ "$MODE" = lock ] && lock
if [ "$MODE" != check ]; then
  wheels
  shared
  neobert
fi
check
