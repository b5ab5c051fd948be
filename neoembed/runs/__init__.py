"""Run-folder plumbing shared by neoembed's training loops (pre-training, CDE, and the unified trainer through
its callbacks) and by every command that writes an output folder, one module per role:

- :mod:`~neoembed.runs.folder`: **an output folder is never silently reused** (:func:`prepare_output_dir`): a
  non-empty folder is an error unless the caller says ``resume`` (the folder's run must be this run: same recipe,
  up to the settings that do not change the trajectory) or ``overwrite`` (the folder is cleared);
- :mod:`~neoembed.runs.checkpoints`: **checkpoints survive any kill** (:func:`stage_checkpoint`,
  :func:`commit_checkpoint`, :func:`find_resume_checkpoint`): written to ``.checkpoint-N.partial``, every file's
  size and SHA-256 in a completion marker written last, then renamed to ``checkpoint-N``; a resume takes the
  newest checkpoint whose marker and files agree and says which it skipped and why;
- :mod:`~neoembed.runs.errors` and :mod:`~neoembed.runs.signals`: **exit codes tell the truth**:
  :class:`TrainingInterrupted` (SIGINT 130, SIGTERM 143) after the checkpoint, :class:`TrainingStopped` (1) for a
  run that cannot go on, ``ValueError`` / ``OSError`` (2) for bad input;
- :mod:`~neoembed.runs.lock`: **one writer per output folder** (:func:`output_lock`): an OS lock (``flock``) on
  ``.<folder>.neoembed-lock`` beside it for the whole run; a second writer is refused (exit 2) naming the holder;
- :mod:`~neoembed.runs.metrics`: ``metrics.jsonl``, ``training_curves.png`` and trackers, trimmed to the resumed
  step, and a report of a run whose loss and gradient stay at zero (:class:`MetricsLog`);
- :mod:`~neoembed.runs.trackers`: what a tracked run needs from outside, checked before any model loads (a
  tracking server that answers, a readable ``trackers.json``, the MLflow run a resume continues in the store);
- :mod:`~neoembed.runs.checks` (inputs checked before any work), :mod:`~neoembed.runs.optim` (parameter groups),
  :mod:`~neoembed.runs.results` (the results folder of one scored model).
"""

from __future__ import annotations

from neoembed.runs.checkpoints import (
    CHECKPOINT_MARKER,
    commit_checkpoint,
    find_resume_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    run_identity,
    stage_checkpoint,
    verify_checkpoint,
    write_failed,
)
from neoembed.runs.checks import (
    check_device,
    check_pair_counts,
    check_pairs,
    check_weight_files,
    require_module,
)
from neoembed.runs.errors import (
    SIGNAL_EXIT,
    CheckpointWriteError,
    OutputDirError,
    OutputLockedError,
    RunFinished,
    TrainingInterrupted,
    TrainingStopped,
)
from neoembed.runs.folder import (
    NON_TRAJECTORY_KEYS,
    RECORD,
    check_inputs_outside,
    check_known_settings,
    check_output_flags,
    prepare_output_dir,
    recorded_settings,
    resume_defaults,
    resume_settings,
    stopped_before_a_checkpoint,
    trajectory_value,
)
from neoembed.runs.lock import launched_main, lock_path, output_lock
from neoembed.runs.metrics import (
    DEGENERATE_ROWS,
    TRACKER_PROJECT,
    TRACKERS,
    MetricsLog,
    MissingTracker,
    check_mlflow_store,
    check_trackers,
    note_early_stop,
    progress_line,
    recipe_hyperparameters,
    tensorboard_hparams,
    trim_metrics,
)
from neoembed.runs.optim import param_groups, rates_from_schedule
from neoembed.runs.results import (
    MODEL_RECORD,
    WEIGHT_SUFFIXES,
    claim_results_dir,
    default_results_dir,
    model_fingerprint,
    model_identity,
    pipeline_sha256,
)
from neoembed.runs.signals import (
    FinalSaveInterrupted,
    StopSignal,
    save_final_model,
)
from neoembed.runs.trackers import (
    MLFLOW_STORE_KEY,
    TRACKER_IDS,
    check_mlflow_resume,
    check_mlflow_server,
    mlflow_store,
    read_tracker_ids,
)

__all__ = [
    "DEGENERATE_ROWS",
    "MODEL_RECORD",
    "NON_TRAJECTORY_KEYS",
    "RECORD",
    "SIGNAL_EXIT",
    "WEIGHT_SUFFIXES",
    "require_module",
    "CHECKPOINT_MARKER",
    "CheckpointWriteError",
    "FinalSaveInterrupted",
    "MLFLOW_STORE_KEY",
    "MetricsLog",
    "MissingTracker",
    "OutputDirError",
    "OutputLockedError",
    "RunFinished",
    "StopSignal",
    "TRACKERS",
    "TRACKER_IDS",
    "TRACKER_PROJECT",
    "TrainingInterrupted",
    "TrainingStopped",
    "check_device",
    "check_inputs_outside",
    "check_known_settings",
    "check_mlflow_resume",
    "check_mlflow_server",
    "check_mlflow_store",
    "check_pair_counts",
    "check_pairs",
    "check_trackers",
    "check_weight_files",
    "claim_results_dir",
    "commit_checkpoint",
    "default_results_dir",
    "find_resume_checkpoint",
    "list_checkpoints",
    "launched_main",
    "lock_path",
    "mlflow_store",
    "model_fingerprint",
    "model_identity",
    "output_lock",
    "param_groups",
    "pipeline_sha256",
    "rates_from_schedule",
    "check_output_flags",
    "prepare_output_dir",
    "recorded_settings",
    "note_early_stop",
    "progress_line",
    "prune_checkpoints",
    "read_tracker_ids",
    "recipe_hyperparameters",
    "resume_defaults",
    "resume_settings",
    "stopped_before_a_checkpoint",
    "trajectory_value",
    "run_identity",
    "save_final_model",
    "stage_checkpoint",
    "tensorboard_hparams",
    "trim_metrics",
    "verify_checkpoint",
    "write_failed",
]
