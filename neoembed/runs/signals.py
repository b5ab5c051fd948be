"""SIGINT / SIGTERM during a run: a checkpoint first, then the exit status a shell expects (130 / 143); the final
save finishes before a signal ends the process."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from neoembed.record import FINISHED, add_to_run_record
from neoembed.runs.checkpoints import list_checkpoints
from neoembed.runs.errors import TrainingInterrupted

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals a run checkpoints on: SIGTERM, SIGINT, and SIGHUP (the terminal or ssh session closed) unless
    it is ignored (``nohup``: the run is meant to go on)."""
    hup = getattr(signal, "SIGHUP", None)  # not on Windows
    if hup is None or signal.getsignal(hup) is signal.SIG_IGN:
        return (signal.SIGTERM, signal.SIGINT)
    return (signal.SIGTERM, signal.SIGINT, hup)


class _Handlers:
    """Installs ``self.handle`` for the :func:`stop_signals` on enter (main thread only) and restores the
    previous handlers on exit."""

    _previous: dict

    def __enter__(self):
        for sig in stop_signals():
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopSignal(_Handlers):
    """SIGTERM / Ctrl-C / SIGHUP set a flag, which the next step starts with (every process reduces it with that step's
    loss, so all stop together): the loop checkpoints after that step. A second Ctrl-C aborts."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning("%s received: checkpointing after the next step, then stopping", self.received)

    def anywhere(self, device=None) -> bool:
        """Whether this process or any other of the run received a signal: one 1-element all-reduce when several
        processes run, so that all stop at the same step (one stopping alone would leave the others waiting in
        their next collective, and one never told would go on to save its final model early). A process told by
        another records SIGTERM. The answer is the reduced flag, not this process's own: a signal handled while
        the all-reduce waited (where a process spends its waits) came too late for the others' answer, so it
        stops every process at the next step."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            flag = torch.tensor([float(self.received is not None)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = flag.item() > 0
            if agreed and self.received is None:
                self.received = "SIGTERM"
            return agreed
        return self.received is not None


class FinalSaveInterrupted(TrainingInterrupted):
    """SIGINT / SIGTERM while the final model was being written: none of it was kept (exit 130 / 143)."""

    def __init__(self, signal_name: str, output: Path, checkpoint: Path | None):
        super().__init__(signal_name, checkpoint)
        again = (
            f"--resume continues from {checkpoint} and saves it"
            if checkpoint is not None
            else "run the command again (with --overwrite)"
        )
        self.args = (
            f"stopped by {signal_name} while the final model was being saved: no final model was written to "
            f"{output} (nothing half-written); {again}",
        )


class _Signalled(BaseException):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _FinalSaveSignals(_Handlers):
    """SIGINT / SIGTERM raise :class:`_Signalled` while the model is written, and wait while it is moved in."""

    def __init__(self):
        self.deferring, self.received, self._previous = False, None, {}

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.deferring:
            raise _Signalled(name)
        self.received = name


def save_final_model(output: str | Path, save: Callable[[Path], None], step: int) -> None:
    """Write a run's final model all or nothing: ``save(folder)`` writes it into ``output/.final.partial``,
    whose entries are then moved into ``output`` (renames, with SIGINT / SIGTERM held until they are done); then
    the run record says the run finished at ``step`` with these entries (a later ``--resume`` reads it:
    :class:`RunFinished`).

    A signal while ``save`` runs removes the partial folder and raises :class:`FinalSaveInterrupted` (exit 130 /
    143) naming the checkpoint that ``--resume`` continues from; so does any error (re-raised as it is)."""
    output = Path(output)
    staged = output / ".final.partial"
    shutil.rmtree(staged, ignore_errors=True)
    with _FinalSaveSignals() as signals:
        try:
            save(staged)
        except _Signalled as e:
            shutil.rmtree(staged, ignore_errors=True)
            ckpts = list_checkpoints(output)
            raise FinalSaveInterrupted(e.name, output, ckpts[-1] if ckpts else None) from None
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        signals.deferring = True
        entries = sorted(staged.iterdir())
        for entry in entries:
            target = output / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
        staged.rmdir()
        add_to_run_record(output, {FINISHED: {"step": step, "entries": [e.name for e in entries]}})
    if signals.received is not None:
        logger.warning(
            "%s received while the final model was moved in: it is complete in %s", signals.received, output
        )
