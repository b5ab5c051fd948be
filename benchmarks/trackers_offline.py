"""W&B (offline) and Trackio (local) as a user runs them: the unified trainer and the CDE run loop, each stopped by
SIGTERM mid-run and resumed, then every tracked value read back from the trackers' own files.

    pip install 'neoembed[wandb,trackio]'
    python benchmarks/trackers_offline.py           # the tiny NeoBERT fixture, about a minute on 2 CPU cores

No network: W&B writes its offline run files (``WANDB_MODE=offline``), Trackio its local SQLite store. Read back:
W&B's ``.wandb`` record logs (LevelDB log blocks of protobuf records, wandb's own format) for history and
config; Trackio through its storage API. Checked: one tracked run per trainer, named after the output folder, in
the project ``neoembed``; the recipe as ``recipe.*`` config; every logged step exactly once across the resume,
each loss equal to ``metrics.jsonl``'s. Results: results/trackers_offline_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import tempfile
from pathlib import Path

from _common import REPO, SHARED, header, write_results

TINY = REPO / "recipes" / "tiny.yaml"
CDE_TINY = REPO / "recipes" / "cde-tiny.yaml"
MODEL = SHARED / "fixtures" / "neobert-tiny-official"
STOP_AT = 3


def _unified(out: Path) -> None:
    from neoembed.recipe import load_recipe
    from neoembed.runs import TrainingInterrupted
    from neoembed.train import callbacks as callbacks_mod
    from neoembed.train import trainer as trainer_mod
    from neoembed.train.recipe import UnifiedRecipe

    recipe = load_recipe(
        TINY,
        UnifiedRecipe,
        [
            f"model={MODEL}",
            f"output_dir={out}",
            "datasets=[{card: pydoc_names, max_rows: 64}]",
            "steps=8",
            "save_steps=100",
            "report_to=[wandb, trackio]",
        ],
    )
    on_log = callbacks_mod.MetricsCallback.on_log

    def on_log_then_sigterm(self, args, state, control, logs=None, **kwargs):
        on_log(self, args, state, control, logs=logs, **kwargs)
        if state.global_step == STOP_AT:
            os.kill(os.getpid(), signal.SIGTERM)

    callbacks_mod.MetricsCallback.on_log = on_log_then_sigterm
    try:
        trainer_mod.train(recipe, recipe_dir=TINY.parent)
    except TrainingInterrupted:
        pass
    finally:
        callbacks_mod.MetricsCallback.on_log = on_log
    _process_end()
    trainer_mod.train(recipe, recipe_dir=TINY.parent, resume=True)
    _process_end()


def _cde(out: Path) -> None:
    from neoembed.cde import trainer as cde_trainer
    from neoembed.cde.recipe import CDERecipe
    from neoembed.recipe import load_recipe
    from neoembed.runs import TrainingInterrupted

    recipe = load_recipe(
        CDE_TINY,
        CDERecipe,
        [
            f"model={MODEL}",
            f"output_dir={out}",
            "datasets=[{card: pydoc_names, max_rows: 32}]",
            "steps=6",
            "save_steps=2",
            "logging_steps=1",
            "report_to=[wandb, trackio]",
        ],
    )
    real = cde_trainer._cde_step  # returns (step_fn, row_fn): SIGTERM during step STOP_AT

    def interrupting(*args, **kwargs):
        step_fn, row_fn = real(*args, **kwargs)

        def step(i, stop):
            if i + 1 == STOP_AT:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_fn(i, stop)

        return step, row_fn

    cde_trainer._cde_step = interrupting
    try:
        cde_trainer.train_cde(recipe, recipe_dir=CDE_TINY.parent, progress=False)
    except TrainingInterrupted:
        pass
    finally:
        cde_trainer._cde_step = real
    _process_end()
    cde_trainer.train_cde(recipe, recipe_dir=CDE_TINY.parent, resume=True, progress=False)
    _process_end()


def _process_end() -> None:
    """What the end of a process does to a W&B run that transformers' callback left open: the resumed half then
    starts from the recorded run id (RUN/trackers.json), as after a real kill."""
    import wandb

    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()  # wandb reads its environment (WANDB_RUN_ID) once per process: start over, as a new one would


def _leveldb_records(path: Path):
    """The records of a W&B ``.wandb`` file: a 7-byte W&B header, then LevelDB log blocks of 32 KiB whose chunks
    (crc32, length, type: full / first / middle / last) carry serialized ``Record`` protobufs."""
    data = path.read_bytes()[7:]
    block, pos, pending = 32768, 0, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        elif kind == 0:
            break


def _wandb_read(wandb_dir: Path, name: str) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb

    runs: dict[str, dict] = {}
    for path in sorted(wandb_dir.rglob("*.wandb")):
        for raw in _leveldb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run" and record.run.display_name == name:
                runs.setdefault(record.run.run_id, {"project": record.run.project, "loss": {}, "config": {}})
                current = runs[record.run.run_id]
            elif kind == "run":
                current = None
            elif kind == "history" and current is not None:
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
                }
                step = items.get("train/global_step", items.get("_step"))
                loss = items.get("train/loss", items.get("loss"))
                if loss is not None:
                    current["loss"].setdefault(int(step), []).append(loss)
            elif kind == "config" and current is not None:
                for item in record.config.update:
                    current["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return runs


def _trackio_read(project: str, name: str) -> dict:
    from trackio.sqlite_storage import SQLiteStorage

    ids = [r["id"] for r in SQLiteStorage.get_run_records(project) if r["name"] == name]
    loss: dict[int, list] = {}
    config: dict = {}
    configs = SQLiteStorage.get_all_run_configs(project)
    for run_id in ids:
        for row in SQLiteStorage.get_logs(project, run_id=run_id):
            value = row.get("train/loss", row.get("loss"))
            if value is not None:
                loss.setdefault(int(row.get("train/global_step", row.get("step"))), []).append(value)
        config |= configs.get(run_id, {})
    return {"runs": len(ids), "loss": loss, "config": config}


def _check(name: str, out: Path, wandb_dir: Path) -> dict:
    logged = {
        r["step"]: r["loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    w = _wandb_read(wandb_dir, out.name)
    t = _trackio_read("neoembed", out.name)
    w_loss = {s: v for run in w.values() for s, vs in run["loss"].items() for v in vs}
    w_steps = sorted(s for run in w.values() for s, vs in run["loss"].items() for _ in vs)
    t_steps = sorted(s for s, vs in t["loss"].items() for _ in vs)
    w_config = {k for run in w.values() for k in run["config"]}
    return {
        "trainer": name,
        "steps logged (metrics.jsonl)": sorted(logged),
        "wandb runs (ids)": sorted(w),
        "wandb project": sorted({run["project"] for run in w.values()}),
        "wandb steps, each once": w_steps == sorted(logged),
        "wandb losses equal": all(abs(w_loss[s] - v) <= 1e-6 * max(1, abs(v)) for s, v in logged.items()),
        "wandb recipe keys": len([k for k in w_config if k.startswith("recipe.")]),
        "trackio runs of that name": t["runs"],
        "trackio steps, each once": t_steps == sorted(logged),
        "trackio losses equal": all(
            s in t["loss"] and abs(t["loss"][s][0] - v) <= 1e-6 * max(1, abs(v)) for s, v in logged.items()
        ),
        "trackio recipe keys": len([k for k in t["config"] if k.startswith("recipe.")]),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="neoembed-trackers-"))
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp / "wandb"),
        WANDB_SILENT="true",
        TRACKIO_DIR=str(tmp / "trackio"),
    )
    (tmp / "wandb").mkdir()
    sys.path.insert(0, str(REPO))
    rows = []
    for name, run in (("unified", _unified), ("cde", _cde)):
        out = tmp / f"tracked-{name}"
        run(out)
        rows.append(_check(name, out, tmp / "wandb"))
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows]
    write_results("trackers_offline_cpu", {"header": header(), "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
