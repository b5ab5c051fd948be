"""The exceptions of a run and the exit statuses they map to (1 stopped, 2 bad input, 130 / 143 signals)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass



# Exit statuses of a run stopped by a signal, as a shell reports a process killed by it (128 + number).
SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}


class TrainingStopped(RuntimeError):
    """A run stopped before its end (NaN/inf loss, out of memory, a checkpoint that could not be written); the
    message says why and what to do. The command line exits with status 1, printing ``label: message``."""

    exit_code = 1
    label = "training stopped"


class TrainingInterrupted(TrainingStopped):
    """SIGINT / SIGTERM: the run wrote a checkpoint and stopped; ``--resume`` continues it. Exit 130 / 143."""

    def __init__(self, signal_name: str, checkpoint: Path | None, last_step: bool = False):
        self.signal_name, self.checkpoint = signal_name, checkpoint
        self.exit_code = SIGNAL_EXIT.get(signal_name, 1)
        # the signal reached the last step: every step is trained, and what a finished run does after its steps
        # (the final model, its evaluation) is left to the resume, which trains nothing again
        rest = "write the final model with --resume (no step is trained again)" if last_step else "continue with --resume"
        super().__init__(
            f"stopped by {signal_name}{' at the last step' * last_step}; checkpoint {checkpoint} written: {rest}"
            if checkpoint is not None
            else f"stopped by {signal_name} before the first step; nothing to resume"
        )


class CheckpointWriteError(TrainingStopped):
    """A checkpoint could not be written (a full disk, say); the previous checkpoint is intact."""


class RunFinished(Exception):
    """``--resume`` on a run that already finished with these settings: nothing is run or written. The command
    line prints the message and exits 0, so a job script that always passes ``--resume`` (a preemptible queue)
    ends cleanly once its run is done."""

    def __init__(self, output: Path, step: int, steps: int | None, stopped_early: dict | None = None):
        self.output, self.step = output, step
        more = f"; to train on, resume with more steps (steps={2 * step})" if steps is not None else ""
        # an early stop's patience count is resumed too: more steps stop at the next unbeaten evaluation
        if stopped_early:
            more = (
                f" (keep_best.patience={stopped_early.get('patience')} ended it early); more steps would stop "
                "again at the next evaluation that is not a new best"
            )
        super().__init__(f"{output}: its run finished at step {step}, nothing left to run{more}")


class OutputDirError(ValueError):
    """An output folder that cannot be used as asked (exit 2); the message names the fix."""


class OutputLockedError(OutputDirError):
    """Another process is writing the output folder (exit 2); the message names the folder and the holder."""
