#!/usr/bin/env bash
# Demonstration of pre-training (issue: NeoBERT pre-training), on CPU with real text every machine has:
#   1. the pydoc plain-text documentation of Python's standard library (modules, classes, functions), split by
#      module: every 10th module is held out for pseudo-perplexity, the rest is tokenized into shards;
#   2. a 4 x 256 NeoBERT pre-trained from scratch (MLM 20%, 100% [MASK], packed sequences of 512 tokens,
#      ~4k tokens per step, AdamW + warm-up + cosine) for STEPS steps (~10 minutes on 2 cores);
#   3. pseudo-perplexity by length on the held-out modules;
#   4. the unified recipe (the local training pairs of ../shared/data/train) on the pre-trained model and on the
#      same architecture at random initialisation, same steps and settings; both scored with `neoembed mteb`
#      on STS12-16, SICK-R (../shared/data/mteb) and MSRP (task card on ../shared/data/eval/MSRP).
# Steps 1-3 are skipped when OUT already holds a finished pre-training run (rerun with another FINETUNE_LR to
# compare learning rates on the same pre-trained model).
# Usage: bash benchmarks/demo_pretrain.sh [OUT] [STEPS] [FINETUNE_STEPS] [FINETUNE_LR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/demo-pretrain}
STEPS=${2:-400}
FT_STEPS=${3:-300}
FT_LR=${4:-1.0e-4}
SHARED=$(cd ../shared && pwd)
TOK="$SHARED/fixtures/neobert-tiny-official"
ARCH="{hidden_size: 256, num_hidden_layers: 4, num_attention_heads: 4, intermediate_size: 1024, max_length: 1024}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -f "$OUT/pretrained/model.safetensors" ] && [ -f "$OUT/ppl/ppl.json" ]; then
  echo "reusing the pre-training run in $OUT/pretrained"
else
# 1. corpus: one text file per documented object, held-out modules apart
(cd benchmarks && python - "$OUT" <<'PY'
import sys
from pathlib import Path
from pretrain_speed import STDLIB, write_pydoc_corpus
out = Path(sys.argv[1])
held = STDLIB[3::10]
train = [m for m in STDLIB if m not in held]
n_train = write_pydoc_corpus(out / "text" / "train", train)
n_held = write_pydoc_corpus(out / "text" / "heldout", held)
print(f"pydoc corpus: {n_train} files from {len(train)} modules (train), {n_held} from {held} (held out)")
PY
)
neoembed preprocess "$OUT/text/train" "$OUT/shards/train" --tokenizer "$TOK"
neoembed preprocess "$OUT/text/heldout" "$OUT/shards/heldout" --tokenizer "$TOK"

# 2. pre-training from scratch
rm -rf "$OUT/pretrained"
time neoembed pretrain --overwrite pretrain-tiny "tokenizer=$TOK" "model.config=$ARCH" "data.sources=[{path: $OUT/shards/train}]" \
  data.seq_length=512 batch.micro_batch_size=8 "steps=$STEPS" optimizer.lr=1.0e-3 schedule.warmup_steps=40 \
  precision=fp32 save_steps=100 save_total_limit=1 logging_steps=10 "output_dir=$OUT/pretrained"

# 3. pseudo-perplexity by length on held-out modules
neoembed ppl --model "$OUT/pretrained" --data "$OUT/shards/heldout" --lengths 64,128,256,512 --max-docs 6 \
  --out "$OUT/ppl"
fi

# 4. the same architecture at random initialisation (same seed as the pre-training run's initial weights)
python - "$OUT/random-init" "$TOK" "$ARCH" <<'PY'
import sys, torch, yaml
from transformers import AutoTokenizer
from neoembed.modeling import NeoBERTConfig, NeoBERTForMaskedLM
out, tok_path, arch = sys.argv[1], sys.argv[2], yaml.safe_load(sys.argv[3])
tok = AutoTokenizer.from_pretrained(tok_path)
torch.manual_seed(0)
model = NeoBERTForMaskedLM(NeoBERTConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **arch))
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"random-init NeoBERT {arch} -> {out}")
PY

. benchmarks/_demo_eval.sh
demo_eval_dir "$OUT/eval" "$SHARED" STS12 STS13 STS14 STS15 STS16 SICK-R MSRP
for init in random-init pretrained; do
  run="finetuned-$init-lr$FT_LR"
  rm -rf "$OUT/$run"
  time neoembed train --overwrite tiny "model=$OUT/$init" "output_dir=$OUT/$run" "steps=$FT_STEPS" batch_size=32 \
    max_length=128 "datasets=[{card: msrp_pairs}, {card: sts2012_pairs}, {card: trecqa_pairs, batch_size: 16}]" \
    "optimizer.lr=$FT_LR" optimizer.warmup_steps=30 optimizer.schedule=cosine save_steps=100000 logging_steps=10
  neoembed mteb --model "$OUT/$run" --data-dir "$OUT/eval" --output "$OUT/scores/$run" --overwrite
done
for init in random-init pretrained; do
  [ -f "$OUT/scores/$init-not-finetuned/summary.json" ] || \
    neoembed mteb --model "$OUT/$init" --data-dir "$OUT/eval" --output "$OUT/scores/$init-not-finetuned"
done
neoembed mteb compare "$OUT"/scores/* --out "$OUT/compare"

# How alike the mean-pooled embeddings of unrelated sentences are (1 = all the same direction), per model: the
# first 500 sentences of the STS12 train split.
python - "$OUT" "$SHARED/data/mteb/STS12/train.jsonl.gz" "$FT_LR" <<'PY'
import gzip, json, sys
import numpy as np
import neoembed
out, path, lr = sys.argv[1], sys.argv[2], sys.argv[3]
texts = [json.loads(line)["sentence1"] for line in gzip.open(path, "rt")][:500]
for name in ("random-init", "pretrained", f"finetuned-random-init-lr{lr}", f"finetuned-pretrained-lr{lr}"):
    e = neoembed.load(f"{out}/{name}").encode(texts, normalize_embeddings=True)
    c = e @ e.T
    print(f"{name}: mean pairwise cosine {c[~np.eye(len(texts), dtype=bool)].mean():.3f}")
PY
