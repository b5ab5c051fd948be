"""The unified trainer: sampler statistics, a tiny end-to-end run, resume, determinism, records, bad input, DDP."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, ConcatDataset, RandomSampler

from neoembed.data.cards import DataCardError
from neoembed.data.sampler import PowerLawDatasetBatchSampler, dataset_probabilities
from neoembed.recipe import RecipeError, load_recipe
from neoembed.train.recipe import UnifiedRecipe
from neoembed.train.trainer import train

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"


def _samplers(sizes, bs):
    data = [list(range(n)) for n in sizes]
    samplers = [
        BatchSampler(RandomSampler(d, generator=torch.Generator().manual_seed(i)), bs, True)
        for i, d in enumerate(data)
    ]
    return ConcatDataset(data), samplers


def test_sampling_frequencies_follow_power_law():
    sizes = [100, 400, 1600]
    ds, samplers = _samplers(sizes, 4)
    sampler = PowerLawDatasetBatchSampler(ds, samplers, seed=3, alpha=0.5, num_steps=6000)
    offsets = [0, 100, 500, 2100]
    counts = [0, 0, 0]
    for batch in sampler:
        owners = {next(i for i in range(3) if offsets[i] <= j < offsets[i + 1]) for j in batch}
        assert len(owners) == 1  # every batch is single-dataset
        counts[owners.pop()] += 1
    expected = dataset_probabilities(sizes, 0.5)  # 1/7, 2/7, 4/7
    n = sum(counts)
    for c, p in zip(counts, expected, strict=True):
        sd = (p * (1 - p) / n) ** 0.5
        assert abs(c / n - p) < 4 * sd, (c / n, p)


def test_two_ranks_draw_the_same_dataset_each_step(monkeypatch):
    from accelerate.data_loader import BatchSamplerShard

    import neoembed.data.sampler as mod

    monkeypatch.setattr(mod, "_world", lambda: 2)
    sizes = [50, 200]
    data = [list(range(n)) for n in sizes]

    def sampler():  # each process builds its own, with the same seeds
        samplers = [  # per-dataset batch sizes differ (5 and 3)
            BatchSampler(RandomSampler(d, generator=torch.Generator().manual_seed(i)), bs, True)
            for i, (d, bs) in enumerate(zip(data, (5, 3), strict=True))
        ]
        return PowerLawDatasetBatchSampler(ConcatDataset(data), samplers, seed=0, alpha=0.5, num_steps=200)

    assert len(list(sampler())) == 400
    # what each rank receives through accelerate's sharding (as the trainer's prepared dataloader does)
    ranks = [
        list(
            BatchSamplerShard(
                sampler(), num_processes=2, process_index=r, split_batches=False, even_batches=False
            )
        )
        for r in range(2)
    ]
    assert [len(r) for r in ranks] == [200, 200]  # no step lost (batches of 3 are not dropped)
    for a, b in zip(*ranks, strict=True):
        owner = {j >= 50 for j in a + b}
        assert len(owner) == 1  # the step's global batch is single-dataset
        assert len(a) == len(b) == (5 if owner == {False} else 3)
        assert not set(a) & set(b)  # ranks see disjoint rows


def _recipe(tmp_path, tiny_official, *overrides):
    return load_recipe(TINY, UnifiedRecipe, [f"model={tiny_official}", f"output_dir={tmp_path}", *overrides])


def _losses(out: Path):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_metrics_row_names_every_dataset_its_steps_drew(tmp_path, tiny_official):
    """Walk AD: with logging_steps 4 a row's `dataset` was its last step's, though its loss is the mean over four
    steps of up to three datasets. A row names each dataset of its window, with their steps where several."""
    rows = {}
    for every in (1, 4):
        recipe = _recipe(tmp_path / f"log{every}", tiny_official, f"logging_steps={every}", "save_steps=8")
        out = train(recipe, recipe_dir=TINY.parent)
        rows[every] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    drawn = [r["dataset"] for r in rows[1]]
    assert len(drawn) == 8 and len(set(drawn)) > 1
    for row in rows[4]:
        window = drawn[row["step"] - 4 : row["step"]]
        counts = {n: window.count(n) for n in dict.fromkeys(window)}
        assert row["dataset"] == "+".join(counts)
        assert row.get("dataset_steps", counts if len(counts) > 1 else None) == (counts if len(counts) > 1 else None)
    from types import SimpleNamespace

    from neoembed.loop import _tracked

    mixed = next(r for r in rows[4] if "dataset_steps" in r)  # a tracker takes no nested value; MLflow no text
    assert "dataset_steps" not in _tracked(SimpleNamespace(name="wandb"), mixed)
    assert _tracked(SimpleNamespace(name="wandb"), mixed)["dataset"] == mixed["dataset"]
    assert "dataset" not in _tracked(SimpleNamespace(name="mlflow"), mixed)


def test_tiny_recipe_trains_saves_reloads_and_loss_decreases(
    tmp_path, tiny_official, block_neoembed, fake_hub
):
    import neoembed

    recipe = _recipe(
        tmp_path / "run",
        tiny_official,
        "datasets=[{card: pydoc_names, max_rows: 64}]",
        "steps=12",
        "save_steps=100",
    )
    out = train(recipe, recipe_dir=TINY.parent)
    losses = _losses(out)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert (out / "training_curves.png").stat().st_size > 1000
    model = neoembed.load(out)
    assert model.encode(["a sentence"]).shape == (1, 64)
    # the trained model carries the two NeoBERT files, so it loads where neoembed is not installed
    assert (out / "modeling_neobert.py").is_file() and (out / "configuration_neobert.py").is_file()
    code = block_neoembed + (
        "from sentence_transformers import SentenceTransformer\n"
        f"print(SentenceTransformer({str(out)!r}, trust_remote_code=True).encode(['a sentence']).tolist())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])[0] == pytest.approx(
        model.encode(["a sentence"])[0].tolist(), abs=1e-6
    )
    record = json.loads((out / "run_record.json").read_text())
    assert record["recipe"]["steps"] == 12 and record["seed"] == 0 and record["data"]
    kept = record["cards"]["pydoc_names"][
        "data"
    ]  # what the card gave: rows kept, dropped per reason, full size
    assert kept["rows_read"] == 64 and kept["full_size"] == 200 and kept["dropped"] == {} and kept["sampled"]
    # the text before the card's queries, which one card also saves as the model's query prompt
    assert record["cards"]["pydoc_names"]["query_prompt"] == model.prompts["query"] != ""
    card = (out / "README.md").read_text()
    # the base model by its identity (#44): the local fixture names no hub id, so neither its folder nor its path
    assert (
        "pydoc_names" in card
        and "PSF-2.0" in card
        and "a local model that names no hub id" in card
        and "base_model:" not in card
        and tiny_official.name not in card
        and str(tiny_official) not in card
    )
    assert "trust_remote_code=True" in card
    # pushed to the hub: the trainer's card (base model, data, licences) with loading code for the hub id
    assert model.push_to_hub("someone/tiny-neobert") == "someone/tiny-neobert@fake"
    pushed = fake_hub / "someone" / "tiny-neobert"
    card = (pushed / "README.md").read_text()
    # the base model by its identity (#44): the local fixture names no hub id, so neither its folder nor its path
    assert (
        "pydoc_names" in card
        and "PSF-2.0" in card
        and "a local model that names no hub id" in card
        and "base_model:" not in card
        and tiny_official.name not in card
        and str(tiny_official) not in card
    )
    assert 'neoembed.load("someone/tiny-neobert")' in card
    assert 'SentenceTransformer("someone/tiny-neobert", trust_remote_code=True)' in card
    assert card.count("## Loading with and without neoembed") == 1 and f'"{out.name}"' not in card
    assert (pushed / "modeling_neobert.py").is_file() and (pushed / "configuration_neobert.py").is_file()
    assert neoembed.load(pushed).encode(["a sentence"]) == pytest.approx(
        model.encode(["a sentence"]), abs=1e-6
    )


def test_resume_equals_uninterrupted_and_seed_repeats(tmp_path, tiny_official):
    full = train(_recipe(tmp_path / "full", tiny_official), recipe_dir=TINY.parent)
    again = train(_recipe(tmp_path / "again", tiny_official), recipe_dir=TINY.parent)
    assert _losses(full) == _losses(again)  # same seed, same numbers
    assert (full / "checkpoint-4" / "modeling_neobert.py").is_file()  # checkpoints load anywhere too
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    train(_recipe(resumed, tiny_official), recipe_dir=TINY.parent, resume=True)
    assert _losses(resumed) == pytest.approx(_losses(full)[4:], rel=1e-6)


def test_bad_input_fails_before_training(tmp_path, tiny_official):
    out = tmp_path / "out"  # tmp_path holds the cards: a used folder is refused before any data is read
    with pytest.raises(DataCardError, match="not found"):
        train(_recipe(out, tiny_official, "datasets=[{card: no_such_card}]"), recipe_dir=TINY.parent)
    with pytest.raises(DataCardError, match="batch size 500 is larger than the dataset"):
        train(_recipe(out, tiny_official, "batch_size=500"), recipe_dir=TINY.parent)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\nsource: {local: {path: "
        + str(REPO / "tests/shared/data/train/msrp_pairs/train.jsonl.gz")
        + "}}\ncolumns: {query: question, positive: positive}\n"
    )
    with pytest.raises(DataCardError, match="column 'question'"):
        train(_recipe(out, tiny_official, f"datasets=[{{card: {bad}}}]"), recipe_dir=TINY.parent)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"query": "", "positive": ""}\n')
    card = tmp_path / "empty.yaml"
    card.write_text(
        f"name: empty\nsource: {{local: {{path: {empty}}}}}\ncolumns: {{query: query, positive: positive}}\n"
    )
    with pytest.raises(DataCardError, match="no usable rows"):
        train(_recipe(out, tiny_official, f"datasets=[{{card: {card}}}]"), recipe_dir=TINY.parent)
    with pytest.raises(DataCardError, match=r"instruction_overrides names card\(s\) \['qqp'\]"):
        train(
            _recipe(out, tiny_official, "instruction_overrides={qqp: Find it.}"), recipe_dir=TINY.parent
        )
    with pytest.raises(DataCardError, match="appears twice"):
        train(
            _recipe(out, tiny_official, "datasets=[{card: pydoc_names}, {card: pydoc_names}]"),
            recipe_dir=TINY.parent,
        )
    with pytest.raises(RecipeError, match="unknown key 'stepz'"):
        _recipe(out, tiny_official, "stepz=3")


def test_instructions_go_before_queries_and_can_be_overridden(tmp_path, tiny_official):
    from neoembed.train.trainer import prepare_datasets

    recipe = _recipe(tmp_path, tiny_official, "instruction_overrides={pydoc_names: Find a paraphrase.}")
    data, _, sizes = prepare_datasets(recipe, TINY.parent)
    assert data["pydoc_names"][0]["query"].startswith("Find a paraphrase. ")
    assert not data["pydoc_names"][0]["positive"].startswith("Find")  # documents stay plain
    assert not data["pydoc_details"][0]["query"].startswith("Find")
    assert sizes == {"pydoc_names": 16, "pydoc_details": 16, "pydoc_signatures": 8}
    plain, _, _ = prepare_datasets(_recipe(tmp_path, tiny_official, "instructions=false"), TINY.parent)
    assert data["pydoc_names"][0]["query"].endswith(plain["pydoc_names"][0]["query"])


def test_cli_train_tiny(tmp_path, tiny_official):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "neoembed",
            "train",
            "tiny",
            f"model={tiny_official}",
            f"output_dir={tmp_path / 'o'}",
            "steps=2",
            "save_steps=100",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "o" / "model.safetensors").is_file()
    # safetensors 0.8 writes its files 0600 (its issue #782): the weights are as readable as the config beside them
    weights = sorted((tmp_path / "o").rglob("*.safetensors"))
    config = (tmp_path / "o" / "config.json").stat().st_mode & 0o777
    assert len(weights) >= 2 and {w.stat().st_mode & 0o777 for w in weights} == {config}, weights
    # one console line per card: what it gave, how it is batched, how often it is drawn (pi_i of the full sizes)
    assert "card pydoc_names: 64 of 64 rows kept (dropped: none" in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("card pydoc_signatures: ")]
    assert line.endswith("1 hard negative per query; 8 queries per step (24 texts); pi 0.3333"), line  # each card: 200 rows
    assert "step 2/2 (100%)" in r.stderr
    assert "Computing widget examples" not in r.stderr  # sentence-transformers' bar: redraws piled into a log


def _launch(processes: int) -> list[str]:
    """`accelerate launch` for N gloo processes on CPU.

    In accelerate 1.x, `--cpu --num_processes 2` starts a single process; `--multi_gpu` with
    ACCELERATE_USE_CPU=1 (see _LAUNCH_KW) is what starts N CPU processes under torch.distributed. Port 0:
    accelerate picks a free port, since pytest-xdist may run another file's launch at the same time.
    """
    mode = ["--multi_gpu"] if processes > 1 else ["--cpu"]
    return [
        sys.executable, "-m", "accelerate.commands.launch", *mode,
        "--num_machines", "1", "--num_processes", str(processes), "--main_process_port", "0",
        "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip


_LAUNCH_KW = dict(
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
)


DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from accelerate import Accelerator
    import neoembed
    from neoembed.losses import InfoNCELoss
    acc = Accelerator(cpu=True)
    model = neoembed.load(sys.argv[1])
    q = ["what is neobert", "capital of france", "how do cats purr", "what is neobert"]
    p = ["an encoder model", "paris", "vibrating vocal folds", "an encoder model"]
    n = ["a decoder", "lyon", "dogs bark", "a car"]
    world, rank = acc.num_processes, acc.process_index
    sl = slice(rank * 4 // world, (rank + 1) * 4 // world)
    loss = InfoNCELoss(model, gather_across_devices=world > 1)
    feats = [model.tokenize(c[sl]) for c in (q, p, n)]
    value = loss(feats, torch.zeros(len(q[sl])))
    value.backward()
    grad = model[0].auto_model.encoder.weight.grad.clone()
    if world > 1:
        dist.all_reduce(grad)
        grad /= world
        v = value.detach().clone(); dist.all_reduce(v); v /= world
    else:
        v = value.detach()
    if rank == 0:
        torch.save({"loss": float(v), "grad": grad, "world": world}, sys.argv[2])
    acc.wait_for_everyone()
    acc.end_training()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # results saved: skip interpreter teardown, where gloo's threads can abort (torch #190489)
""")


def test_two_processes_with_gathered_negatives_equal_one_process(tmp_path, tiny_official):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    one = subprocess.run(
        [*_launch(1), str(script), str(tiny_official), str(tmp_path / "one.pt")], **_LAUNCH_KW
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [*_launch(2), str(script), str(tiny_official), str(tmp_path / "two.pt")], **_LAUNCH_KW
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (a["world"], b["world"]) == (1, 2)  # really two processes, not one
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    torch.testing.assert_close(b["grad"], a["grad"], rtol=1e-4, atol=1e-6)


def test_nan_loss_stops_without_saving(tmp_path, tiny_official):
    from neoembed.train.trainer import TrainingStopped

    recipe = _recipe(
        tmp_path / "nan",
        tiny_official,
        "optimizer.lr=1.0e+30",
        "optimizer.grad_clip=1.0e+30",
        "steps=6",
        "save_steps=100",
    )
    with pytest.raises(TrainingStopped, match="loss is nan at step .*: training stopped before the update"):
        train(recipe, recipe_dir=TINY.parent)
    assert not (tmp_path / "nan" / "model.safetensors").exists()


def test_sigterm_in_process_checkpoints_then_resume_finishes(tmp_path, tiny_official, monkeypatch, sigterm_at):
    """SIGTERM mid-run (sent from inside step 2): a checkpoint after the next step, then --resume ends."""
    import signal

    from neoembed.train import trainer as trainer_mod

    out = tmp_path / "sig"
    recipe = _recipe(out, tiny_official, "datasets=[{card: pydoc_names, max_rows: 64}]", "save_steps=100")
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 2)
    before = signal.getsignal(signal.SIGTERM)
    from neoembed.runs import TrainingInterrupted

    with pytest.raises(TrainingInterrupted) as stopped:
        train(recipe, recipe_dir=TINY.parent)
    assert stopped.value.exit_code == 143  # what a shell reports for SIGTERM: the run did not finish
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    ckpts = [p.name for p in out.glob("checkpoint-*")]
    assert ckpts in (["checkpoint-2"], ["checkpoint-3"]) and not (out / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) == before  # our handler is removed after training
    train(recipe, recipe_dir=TINY.parent, resume=True)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)) and (out / "model.safetensors").is_file()


def test_a_resumed_run_of_a_model_with_dropout_equals_the_uninterrupted_one(
    tmp_path, minilm_path, monkeypatch, sigterm_at
):
    """all-MiniLM-L6-v2 trains with dropout, whose masks come from the global generator the checkpoint restores.
    A resumed run's data iterator drew its seed from that generator at its first batch, after the restore (a
    fresh run draws it before its first step): every mask after the resume moved, and so did the losses."""
    from safetensors.torch import load_file

    from neoembed.runs import TrainingInterrupted
    from neoembed.train import trainer as trainer_mod

    def recipe(out):
        return _recipe(out, minilm_path, "datasets=[{card: pydoc_names, max_rows: 64}]", "steps=4",
                       "save_steps=100", "optimizer.lr=1e-4")  # fmt: skip

    whole = train(recipe(tmp_path / "whole"), recipe_dir=TINY.parent)
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 1)  # stops after step 2
    with pytest.raises(TrainingInterrupted):
        train(recipe(tmp_path / "resumed"), recipe_dir=TINY.parent)
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    resumed = train(recipe(tmp_path / "resumed"), recipe_dir=TINY.parent, resume=True)
    assert _losses(resumed) == _losses(whole)
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_more_steps_runs_the_new_schedule_from_its_first_step(tmp_path, tiny_official):
    """A checkpoint restores the rate its run's schedule gave; resumed with more steps, the first resumed step ran
    at that old rate (0.0002 where the new schedule gives 0.000434 in a walk's pre-training run) and only the
    next one followed the new schedule. Every resumed step's rate is now the new schedule's."""
    args = ("datasets=[{card: pydoc_names, max_rows: 64}]", "optimizer.schedule=linear", "save_steps=2")
    whole = train(_recipe(tmp_path / "whole", tiny_official, *args, "steps=8"), recipe_dir=TINY.parent)
    out = train(_recipe(tmp_path / "short", tiny_official, *args, "steps=4"), recipe_dir=TINY.parent)
    shutil.rmtree(out / "checkpoint-4")  # as if killed after checkpoint-2
    (out / "model.safetensors").unlink()
    train(_recipe(out, tiny_official, *args, "steps=8"), recipe_dir=TINY.parent, resume=True)

    def rates(folder):
        return [json.loads(line)["learning_rate"] for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert rates(out)[2:] == pytest.approx(rates(whole)[2:], rel=1e-9)


def test_sigterm_reaching_the_last_step_says_the_resume_only_writes_the_model(
    tmp_path, tiny_official, monkeypatch, sigterm_at
):
    """A SIGTERM during the second-to-last step stops after the last one: every step is trained, so the message
    says that --resume writes the final model and trains nothing again, which it then does."""
    from neoembed.runs import TrainingInterrupted
    from neoembed.train import trainer as trainer_mod

    out = tmp_path / "sig"
    recipe = _recipe(out, tiny_official, "datasets=[{card: pydoc_names, max_rows: 64}]", "save_steps=100")
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 7)
    with pytest.raises(TrainingInterrupted, match="at the last step; checkpoint .*checkpoint-8 written: write the "
                       "final model with --resume \\(no step is trained again\\)"):  # fmt: skip
        train(recipe, recipe_dir=TINY.parent)
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    rows = (out / "metrics.jsonl").read_text()
    train(recipe, recipe_dir=TINY.parent, resume=True)
    assert (out / "metrics.jsonl").read_text() == rows and (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_checkpoints_then_resume_finishes(tmp_path, tiny_official):
    import signal
    import time

    out = tmp_path / "sig"
    cmd = [
        sys.executable,
        "-m",
        "neoembed",
        "train",
        "tiny",
        f"model={tiny_official}",
        f"output_dir={out}",
        "steps=150",
        "save_steps=1000",
        "datasets=[{card: pydoc_names, max_rows: 64}]",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    ckpts = list(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / "model.safetensors").exists()
    stopped_at = int(ckpts[0].name.split("-")[1])
    assert 0 < stopped_at < 150
    r = subprocess.run(
        [
            *cmd[:-2],
            "steps=150",
            "save_steps=1000",
            "datasets=[{card: pydoc_names, max_rows: 64}]",
            "--resume",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 150 and (out / "model.safetensors").is_file()


def test_out_of_memory_is_answered_with_advice(tmp_path, tiny_official, monkeypatch):
    from neoembed.train import trainer as trainer_mod
    from neoembed.train.trainer import TrainingStopped

    def oom(*args, **kwargs):
        def step_fn(step, stop):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return step_fn, lambda *a: {}

    monkeypatch.setattr(trainer_mod, "unified_step", oom)
    with pytest.raises(TrainingStopped, match="loss.mini_batch_size=32.*--resume continues.*max_length"):
        train(_recipe(tmp_path / "oom", tiny_official), recipe_dir=TINY.parent)


def test_the_saved_model_remembers_its_training(tmp_path, tiny_official):
    """The query instruction is the saved `query` prompt (encode_query applies it), max_seq_length is the base
    model's, not training's max_length, and the card shows the prompt and names the base model without a path."""
    import neoembed

    recipe = _recipe(
        tmp_path / "run", tiny_official, "datasets=[{card: pydoc_names, max_rows: 32}]", "steps=2"
    )
    base = neoembed.load(tiny_official)
    out = train(recipe, recipe_dir=TINY.parent)
    model = neoembed.load(out)
    prefix = "Given the name of a Python standard-library function, retrieve its one-line description. "
    assert model.prompts["query"] == prefix and model.prompts["document"] == ""
    assert model.max_seq_length == base.max_seq_length != recipe.max_length
    assert model.encode_query(["os.path.join"]) == pytest.approx(
        model.encode([prefix + "os.path.join"]), abs=1e-6
    )
    card = (out / "README.md").read_text()  # a local model without a hub id: no base_model, no folder name
    assert "base_model:" not in card and str(tiny_official) not in card
    assert f"`{tiny_official.name}`" not in card
    assert "from a local model that names no hub id" in card
    assert json.loads((out / "run_record.json").read_text())["base_model"] is None
    assert repr(prefix) in card and "encode_query" in card


def test_train_quickstart_without_its_card_says_how_to_run_it(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "neoembed", "train", "quickstart"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "run `neoembed quickstart`" in r.stderr and "datasets=" in r.stderr
    assert list(tmp_path.iterdir()) == []


def _static_model(folder: Path, tiny_official: Path) -> Path:
    """A sentence-transformers StaticEmbedding model on the tiny fixture's tokenizer (random token vectors)."""
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    try:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:  # sentence-transformers before 5.3
        from sentence_transformers.models import StaticEmbedding

    tokenizer = Tokenizer.from_file(str(tiny_official / "tokenizer.json"))
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=16)], device="cpu").save(
        str(folder)
    )
    return folder


def test_train_refuses_a_static_embedding_model(tmp_path, tiny_official, monkeypatch, capsys):
    """A StaticEmbedding model used to fail mid-setup with "property 'max_seq_length' of 'StaticEmbedding' object
    has no setter ... please report it" (exit 1); the unified trainer's losses read padded token sequences, which a
    static model does not give. Refused with exit 2, naming the module, before the data or the model load (a
    local folder), and, for a model known only once loaded (a hub id), before training."""
    from neoembed.cli import main
    from neoembed.train import trainer as trainer_mod

    static = _static_model(tmp_path / "static", tiny_official)
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["neoembed", "train", str(TINY), f"model={static}", f"output_dir={out}"])
    monkeypatch.setattr(trainer_mod, "_training_data", lambda *a: pytest.fail("the data loaded first"))
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert (
        "is a static-embedding model (its first module is a StaticEmbedding" in err and "report it" not in err
    )
    assert not out.exists()
    monkeypatch.undo()
    monkeypatch.setattr(trainer_mod, "_check_first_module", lambda recipe: None)  # as for a hub id
    recipe = load_recipe(TINY, UnifiedRecipe, [f"model={static}", f"output_dir={out}", "steps=2"])
    with pytest.raises(RecipeError, match="first module is a StaticEmbedding"):
        train(recipe, recipe_dir=TINY.parent)
    assert not (out / "model.safetensors").exists()


def test_fp16_on_the_cpu_says_it_runs_fp32(tmp_path, tiny_official):
    """precision=fp16 on a CPU machine trained in fp32 without a word (a fault walk's pb3 / pf1): accelerate
    autocasts to fp16 only on accelerators. The run says so, and its losses are the fp32 run's (each run in a
    process of its own: accelerate's state keeps the first run's precision)."""
    import subprocess
    import sys

    losses, said = {}, {}
    for precision in ("fp32", "fp16"):
        out = tmp_path / precision
        args = [f"model={tiny_official}", f"output_dir={out}", "steps=3", "logging_steps=1", f"precision={precision}"]
        run = subprocess.run(
            [sys.executable, "-m", "neoembed", "train", str(TINY), *args],
            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        losses[precision], said[precision] = _losses(out), run.stderr
    assert "precision=fp16 on the CPU" in said["fp16"] and "computes in fp32" in said["fp16"], said["fp16"]
    assert "precision=fp16" not in said["fp32"] and losses["fp16"] == losses["fp32"]


def test_every_trainer_trains_fp32_weights_from_a_folder_saved_in_bf16(tmp_path, tiny_official, fake_hub):
    """transformers keeps a folder's saved dtype: from a bf16 copy, `neoembed train` (precision fp32) trained and
    saved bf16 weights, AdamW updating them in bf16; so did CDE, GLUE and pre-training's init_from. The recipe's
    precision is autocast's; the weights stay fp32."""
    import neoembed
    from neoembed.cde.modeling_cde import ContextualDocumentEmbedder
    from neoembed.glue.run import _load_model
    from neoembed.glue.tasks import get_task
    from neoembed.pretrain.recipe import PretrainRecipe
    from neoembed.pretrain.trainer import _build_model

    bf16 = tmp_path / "bf16"
    neoembed.load(tiny_official, dtype="bf16").save(str(bf16))
    out = train(_recipe(tmp_path / "run", bf16, "datasets=[{card: pydoc_names, max_rows: 32}]", "steps=2",
                        "save_steps=2"), recipe_dir=TINY.parent)  # fmt: skip
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.float32}
    stages = ContextualDocumentEmbedder.from_backbone(str(bf16))
    assert {p.dtype for p in stages.parameters()} == {torch.float32}
    classifier = _load_model(get_task("MRPC"), str(bf16), transfer=False)
    assert {p.dtype for p in classifier.parameters()} == {torch.float32}
    pretrain_tiny = REPO / "recipes" / "pretrain-tiny.yaml"
    recipe = load_recipe(pretrain_tiny, PretrainRecipe, [f"model={{init_from: {bf16}}}"])
    from transformers import AutoTokenizer

    model = _build_model(recipe, AutoTokenizer.from_pretrained(str(bf16)))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
