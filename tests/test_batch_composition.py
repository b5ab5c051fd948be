"""What a batch may hold: duplicate masking keyed on the text whatever the column's padding, and batches that
never hold a text twice for cards whose texts repeat (real TREC QA rows: one question, several answers)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from sentence_transformers.base.sampler import DefaultBatchSampler
from torch.utils.data import RandomSampler

import neoembed
from neoembed.data.sampler import NoDuplicatesBatchSampler, no_duplicate_batches, text_repeats
from neoembed.losses import CachedInfoNCELoss, InfoNCELoss, duplicate_mask, info_nce, text_keys


@pytest.fixture(scope="module")
def trecqa(shared_dir):
    path = shared_dir / "data/train/trecqa_pairs/train.jsonl.gz"
    return [json.loads(line) for line in gzip.open(path, "rt")]


@pytest.fixture(scope="module")
def tiny(tiny_official):
    model = neoembed.load(tiny_official)
    model.eval()
    return model


def _mined_batch(rows: list[dict], size: int = 6) -> dict[str, list[str]]:
    """Rows of distinct questions whose first row's hard negative is the third row's positive (what mining
    against a corpus holding every positive produces) and whose last row's negative is the second's."""
    picked, seen = [], set()
    for row in rows:
        if row["query"] not in seen and row.get("negative"):
            picked.append(row)
            seen.add(row["query"])
        if len(picked) == size:
            break
    batch = {c: [r[c] for r in picked] for c in ("query", "positive", "negative")}
    batch["negative"][0] = batch["positive"][2]
    batch["negative"][-1] = batch["positive"][1]
    return batch


def test_text_keys_equal_across_columns_of_other_widths(tiny, trecqa):
    batch = _mined_batch(trecqa)
    pos, neg = tiny.tokenize(batch["positive"]), tiny.tokenize(batch["negative"])
    assert pos["input_ids"].shape[1] != neg["input_ids"].shape[1]  # padded to different widths
    kp, kn = text_keys(pos), text_keys(neg)
    assert kn[0] == kp[2] and kn[-1] == kp[1]
    assert len(set(kp.tolist()) | set(kn.tolist())) == 2 * len(kp) - 2
    ids, mask = pos["input_ids"], pos["attention_mask"]  # the same rows, left-padded
    left = {
        "input_ids": torch.stack([_left_pad(r, m) for r, m in zip(ids, mask, strict=True)]),
        "attention_mask": torch.stack([_left_pad(m, m) for m in mask]),
    }
    assert torch.equal(text_keys(left), kp)


def _left_pad(row, mask):
    n = int(mask.sum())
    return torch.cat([row[n:], row[:n]])


def _hand_mask(batch: dict[str, list[str]]) -> torch.Tensor:
    cands = batch["positive"] + batch["negative"]
    b = len(batch["positive"])
    return torch.tensor(
        [[j != i and cands[j] == batch["positive"][i] for j in range(len(cands))] for i in range(b)]
    )


@pytest.mark.parametrize("cached", [False, True])
def test_a_mined_negative_that_is_another_rows_positive_is_masked(tiny, trecqa, cached):
    batch = _mined_batch(trecqa)
    features = [tiny.tokenize(batch[c]) for c in ("query", "positive", "negative")]
    loss_fn = CachedInfoNCELoss(tiny, mini_batch_size=2) if cached else InfoNCELoss(tiny)
    with torch.no_grad():
        loss = float(loss_fn(features, torch.zeros(len(batch["query"]))))
        q, p, n = (tiny(f)["sentence_embedding"] for f in features)
    mask = _hand_mask(batch)
    assert int(mask.sum()) == 2
    expected = float(info_nce(q, torch.cat([p, n]), loss_fn.tau, mask))
    unmasked = float(info_nce(q, torch.cat([p, n]), loss_fn.tau))
    assert loss == pytest.approx(expected, rel=1e-5) and loss != pytest.approx(unmasked, rel=1e-5)
    assert duplicate_mask(text_keys(features[1]), torch.cat([text_keys(f) for f in features[1:]])).equal(mask)


def _share_with_a_repeat(batches, rows) -> float:
    def repeats(batch):
        texts = [t for i in batch for t in rows[i].values()]
        return len(texts) != len(set(texts))

    return sum(map(repeats, batches)) / len(batches)


def test_batches_hold_no_question_twice_on_cards_whose_questions_repeat(trecqa):
    rows = [{"query": r["query"], "positive": r["positive"]} for r in trecqa]
    dataset = Dataset.from_list(rows)
    assert text_repeats(dataset)
    g = torch.Generator().manual_seed(0)
    plain = list(DefaultBatchSampler(RandomSampler(dataset, generator=g), batch_size=16, drop_last=True))
    assert (
        _share_with_a_repeat(plain, rows) > 0.9
    )  # a 16-row batch of TREC QA nearly always repeats a question
    kwargs = {"batch_size": 16, "drop_last": True, "seed": 0}
    sampler = no_duplicate_batches("auto", dataset, generator=torch.Generator(), **kwargs)
    assert isinstance(sampler, NoDuplicatesBatchSampler)
    batches = list(sampler)
    assert batches and _share_with_a_repeat(batches, rows) == 0.0
    assert all(len(b) == 16 for b in batches)
    assert batches == list(no_duplicate_batches("auto", dataset, generator=torch.Generator(), **kwargs))


def test_a_duplicate_free_pass_short_of_batches_is_said_in_neoembeds_words(trecqa, caplog):
    """Walk AA: a raw sentence-transformers line ("NoDuplicatesBatchSampler produced only 7 of the expected 10
    batches ... this epoch's samples") between the step lines of own-data.md's run. Said in neoembed's terms."""
    import logging

    from neoembed.data.sampler import say_sampler_shortfall

    rows = [{"query": r["query"], "positive": r["positive"]} for r in trecqa[:150]]
    say_sampler_shortfall()
    say_sampler_shortfall()  # once a process, however many runs
    sampler = NoDuplicatesBatchSampler(
        Dataset.from_list(rows), batch_size=23, drop_last=True, generator=torch.Generator(), seed=0
    )
    with caplog.at_level(logging.WARNING):
        batches = list(sampler)
    said = [r.getMessage() for r in caplog.records if "batches with no text twice" in r.getMessage()]
    assert len(said) == 1 and "NoDuplicatesBatchSampler" not in caplog.text and len(batches) == len(sampler)
    made = int(said[0].split("made ")[1].split()[0])
    assert said[0].startswith(f"a pass over a card's rows made {made} batches with no text twice of the 6 ")
    assert 0 < made < 6 and f"the other {6 - made} are drawn again" in said[0]


def test_cards_without_repeats_keep_the_plain_sampler(trecqa):
    unique, seen = [], set()
    for r in trecqa:
        if not {r["query"], r["positive"]} & seen:
            unique.append({"query": r["query"], "positive": r["positive"]})
            seen |= {r["query"], r["positive"]}
    dataset = Dataset.from_list(unique)
    assert not text_repeats(dataset)
    assert no_duplicate_batches("auto", dataset, batch_size=4, drop_last=True) is None
    assert no_duplicate_batches(True, dataset, batch_size=4, drop_last=True) is not None
    repeated = Dataset.from_list([*unique, unique[0]])
    assert no_duplicate_batches("auto", repeated, batch_size=4, drop_last=True) is not None
    assert no_duplicate_batches(False, repeated, batch_size=4, drop_last=True) is None


REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes/tiny.yaml"


def _trecqa_recipe(output: Path, tiny_official, *overrides):
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    return load_recipe(
        TINY,
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={output}",
            f"card_dirs=[{REPO / 'tests/data_cards'}]",
            "datasets=[{card: trecqa_pairs, max_rows: 96}]",
            *overrides,
        ],
    )


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_on_a_card_with_repeated_questions_uses_it_and_resumes_bit_identical(
    tmp_path, tiny_official, caplog
):
    """The sampler replays the same batches after a kill and --resume (the trainer skips the batches of the
    steps done by iterating the sampler again), so a resumed run logs the uninterrupted run's losses."""
    import shutil

    from neoembed.train.trainer import train

    settings = ("steps=4", "save_steps=2", "batch_size=16")
    with caplog.at_level("INFO", logger="neoembed"):
        full = train(_trecqa_recipe(tmp_path / "full", tiny_official, *settings), recipe_dir=TINY.parent)
    assert "card trecqa_pairs: a text repeats across rows, so no batch holds it twice" in caplog.text
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    train(_trecqa_recipe(resumed, tiny_official, *settings), recipe_dir=TINY.parent, resume=True)
    assert len(_losses(full)) == 4 and _losses(resumed) == _losses(full)[2:]


def _questions(trecqa, n_rows):
    return Dataset.from_list([{"query": r["query"], "positive": r["positive"]} for r in trecqa[:n_rows]])


def test_a_batch_larger_than_the_rows_free_of_repeats_is_refused_or_falls_back(trecqa, caplog):
    """The first 96 TREC QA rows hold 21 questions: a batch of 32 cannot be free of repeats. "auto" warns and keeps plain
    batches, true is refused before any model loads, and a sampler that runs dry mid-run names the dataset
    (it used to end in 'RuntimeError: generator raised StopIteration')."""
    from torch.utils.data import ConcatDataset

    from neoembed.data.cards import DataCardError
    from neoembed.data.sampler import PowerLawDatasetBatchSampler, duplicate_free_rows, plan_no_duplicates

    dataset = _questions(trecqa, 96)
    free = duplicate_free_rows(dataset, 1000)
    assert free == len(set(dataset["query"])) == 21
    assert plan_no_duplicates("auto", dataset, 16, "trecqa") and plan_no_duplicates(
        True, dataset, 21, "trecqa"
    )
    with caplog.at_level("WARNING", logger="neoembed"):
        assert not plan_no_duplicates("auto", dataset, 32, "trecqa")
    assert "card trecqa: only 21 of its rows share no text" in caplog.text
    with pytest.raises(
        DataCardError, match="card trecqa: only 21 .* batch size 32.* set no_duplicates: false"
    ):
        plan_no_duplicates(True, dataset, 32, "trecqa")
    assert not plan_no_duplicates(False, dataset, 16, "trecqa")
    dry = NoDuplicatesBatchSampler(dataset, batch_size=32, drop_last=True, generator=torch.Generator())
    sampler = PowerLawDatasetBatchSampler(ConcatDataset([dataset]), [dry], num_steps=3)
    with pytest.raises(RuntimeError, match="dataset 0 .* no batch of 32 rows.*no_duplicates: false"):
        list(sampler)


def test_a_recipe_asking_for_impossible_unique_batches_fails_before_the_model_loads(tmp_path, trecqa):
    from neoembed.data.cards import DataCardError
    from neoembed.train.trainer import train

    # 96 rows sampled from 93 questions: fewer than 90 distinct ones
    recipe = _trecqa_recipe(tmp_path / "run", "no-such-model", "no_duplicates=true", "batch_size=90")
    with pytest.raises(DataCardError, match=r"trecqa_pairs: only \d+ .* batch size 90"):
        train(recipe, recipe_dir=TINY.parent)
    assert not (tmp_path / "run").exists()


def _asked_twice(rows: list[dict], size: int = 6) -> dict[str, list[str]]:
    """Real TREC QA rows whose first two ask the same question with different answers (the card's order),
    then rows of other questions."""
    first = [r for r in rows if r["query"] == rows[0]["query"] and r.get("negative")][:2]
    others, seen = [], {rows[0]["query"]}
    for row in rows:
        if row["query"] not in seen and row.get("negative"):
            others.append(row)
            seen.add(row["query"])
    picked = first + others[: size - 2]
    assert picked[0]["positive"] != picked[1]["positive"]
    return {c: [r[c] for r in picked] for c in ("query", "positive", "negative")}


def _hand_mask_by_question(batch: dict[str, list[str]]) -> torch.Tensor:
    """Candidate j is masked for query i when it is a positive of a row asking query i, not i's own column."""
    cands = batch["positive"] + batch["negative"]
    b = len(batch["query"])
    answers = [
        {batch["positive"][k] for k in range(b) if batch["query"][k] == batch["query"][i]} for i in range(b)
    ]
    return torch.tensor([[j != i and cands[j] in answers[i] for j in range(len(cands))] for i in range(b)])


@pytest.mark.parametrize("cached", [False, True])
def test_the_same_question_twice_masks_each_others_answer(tiny, trecqa, cached):
    """One question, two answers in one batch: answer 1 is not a negative of row 0, nor answer 0 of row 1
    (the loss used to keep both in the denominators when no_duplicates fell back to plain batches)."""
    batch = _asked_twice(trecqa)
    features = [tiny.tokenize(batch[c]) for c in ("query", "positive", "negative")]
    loss_fn = CachedInfoNCELoss(tiny, mini_batch_size=2) if cached else InfoNCELoss(tiny)
    with torch.no_grad():
        loss = float(loss_fn(features, torch.zeros(len(batch["query"]))))
        q, p, n = (tiny(f)["sentence_embedding"] for f in features)
    mask = _hand_mask_by_question(batch)
    assert mask[0, 1] and mask[1, 0] and int(mask.sum()) == 2
    assert loss == pytest.approx(float(info_nce(q, torch.cat([p, n]), loss_fn.tau, mask)), rel=1e-5)
    assert loss != pytest.approx(float(info_nce(q, torch.cat([p, n]), loss_fn.tau)), rel=1e-5)


def test_duplicate_mask_by_question_across_gathered_ranks():
    """Two ranks of two rows, candidates gathered as [positives of both ranks, negatives of both ranks]: rank 1's
    row 0 asks rank 0's row 1's question, so rank 0's answer is masked for it, and its own column is not."""
    queries = torch.tensor([10, 11, 11, 12])  # rows of rank 0 then rank 1
    positives = torch.tensor([20, 21, 22, 23])
    negatives = torch.tensor([30, 20, 31, 32])  # rank 0's row 1 has row 0's positive as its negative
    cands = torch.cat([positives, negatives])
    rank1 = duplicate_mask(
        positives[2:], cands, offset=2, query_keys=queries[2:], candidate_query_keys=queries
    )
    assert rank1.nonzero().tolist() == [[0, 1]]
    rank0 = duplicate_mask(
        positives[:2], cands, offset=0, query_keys=queries[:2], candidate_query_keys=queries
    )
    assert rank0.nonzero().tolist() == [[0, 5], [1, 2]]
    assert duplicate_mask(positives[:2], cands).nonzero().tolist() == [[0, 5]]  # by positive text alone


def test_cde_masks_the_answer_of_the_same_question_on_another_row(trecqa):
    from types import SimpleNamespace

    from neoembed.cde.loss import step_mask
    from neoembed.cde.trainer import Source

    batch = _asked_twice(trecqa, size=4)
    src = Source("trecqa", batch["query"], batch["positive"], [[t] for t in batch["negative"]])
    recipe = SimpleNamespace(filtering=SimpleNamespace(enabled=False), mask_duplicates=True)
    mask = step_mask(recipe, src, [0, 1, 2, 3], batch["positive"] + batch["negative"])
    assert mask.equal(_hand_mask_by_question(batch)) and mask[0, 1] and mask[1, 0]


def test_walk_rows_sharing_one_query_and_no_negatives_are_refused_before_the_model_loads(tmp_path, trecqa, tiny):
    """`neoembed init` on rows that all ask one question, then `train`: the loss was 0 and the gradient 0 at
    every step (each row's in-batch candidates are the question's other answers, which the duplicate mask takes
    out), and the run ended "done", exit 0, with the base weights. Refused now, naming the card and the fix; one
    shared positive likewise (copies of it score alike: zero gradient); real pairs pass."""
    from neoembed.data.cards import DataCardError
    from neoembed.data.sampler import check_contrast
    from neoembed.train.trainer import train

    answers = list(dict.fromkeys(r["positive"] for r in trecqa))[:8]
    one_query = {"query": [trecqa[0]["query"]] * 8, "positive": answers}
    batch = {"query": one_query["query"][:4], "positive": answers[:4]}
    loss = InfoNCELoss(tiny, temperature=0.07)
    features = [tiny.tokenize(batch[c]) for c in ("query", "positive")]
    with pytest.warns(UserWarning, match="no query of this batch kept a negative"):  # the Python path's word
        assert loss(features, None).item() == 0.0  # what such a run trains on
    with pytest.raises(DataCardError, match="all 8 rows have the same query.*mask_duplicates: false"):
        check_contrast(Dataset.from_dict(one_query), "one", mask_duplicates=True)
    check_contrast(Dataset.from_dict(one_query), "one", mask_duplicates=False)  # other answers are negatives
    with pytest.raises(DataCardError, match="all 8 rows have the same positive"):
        check_contrast(Dataset.from_dict({"query": answers, "positive": [answers[0]] * 8}), "p", False)
    real = trecqa[:32]
    check_contrast(Dataset.from_dict({c: [r[c] for r in real] for c in ("query", "positive")}), "t", True)

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"query": "same", "positive": a}) + "\n" for a in answers))
    (tmp_path / "one.yaml").write_text(
        "name: one\nsource:\n  local: {path: rows.jsonl, format: json}\ncolumns: {query: query, positive: positive}\n"
        "license: test\n"
    )
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    out = tmp_path / "run"
    recipe = load_recipe(TINY, UnifiedRecipe, ["model=no-such-model", f"output_dir={out}", f"card_dirs=[{tmp_path}]",
                                               "datasets=[{card: one}]", "batch_size=4"])  # fmt: skip
    with pytest.raises(DataCardError, match="card one: all 8 rows have the same query"):
        train(recipe, recipe_dir=TINY.parent)
    assert not out.exists()
