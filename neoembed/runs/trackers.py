"""What a tracked run needs from outside, checked before any model loads (by
:func:`neoembed.runs.check_trackers`): an MLflow tracking server that answers, ``OUTPUT/trackers.json``
readable on a resume, and the MLflow run a resume continues present in the store MLflow now points at. Each
used to fail only once the model had loaded, as an unexpected error (an unreachable server after minutes of
mlflow's retries)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

#: OUTPUT/trackers.json: the MLflow / W&B runs a resume continues, and the MLflow store the run was logged to
TRACKER_IDS = "trackers.json"

#: the key of trackers.json that records the MLflow store (not a tracker's name)
MLFLOW_STORE_KEY = "mlflow_tracking_uri"

# seconds the check waits for a tracking server (mlflow's own requests retry for minutes)
_PROBE_SECONDS = 5

_FOLDER_STORE = "MLFLOW_TRACKING_URI=file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true (a local folder)"


def read_tracker_ids(output: Path) -> dict:
    """``OUTPUT/trackers.json`` (``{}`` when there is none); a file that is not a JSON object is refused,
    naming it and what to do."""
    saved = Path(output) / TRACKER_IDS
    if not saved.is_file():
        return {}
    try:
        ids = json.loads(saved.read_text())
    except (UnicodeDecodeError, ValueError) as e:  # json's errors are ValueErrors
        ids = f"{type(e).__name__}: {e}"
    if not isinstance(ids, dict):
        detail = ids if isinstance(ids, str) else f"a JSON {type(ids).__name__}, not an object"
        raise ValueError(
            f"--resume: {saved} is unreadable ({detail}); it keeps the MLflow / W&B runs this run continues. "
            f"Restore it from a copy, or delete it to continue training in new tracked runs"
        )
    return ids


def mlflow_store(uri: str) -> str:
    """``uri`` as trackers.json keeps and messages show it: a local folder as an absolute ``file:`` URI (a
    relative one depends on the working folder), a server without the password of ``user:password@``."""
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    relative = parsed.scheme == "file" and not parsed.netloc and not parsed.path.startswith("/")
    if parsed.scheme == "" or relative:
        return Path(parsed.path if parsed.scheme else uri).resolve().as_uri()
    if parsed.password is not None:
        host = parsed.netloc.rsplit("@", 1)[1]
        return parsed._replace(netloc=f"{parsed.username}:***@{host}").geturl()
    return uri


@contextlib.contextmanager
def _quick_requests():
    """mlflow's HTTP requests without retries and with a short timeout, for the checks alone (by default
    mlflow retries a server that does not answer for minutes); the environment is put back after."""
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 0, "MLFLOW_HTTP_REQUEST_TIMEOUT": _PROBE_SECONDS}
    before = {name: os.environ.get(name) for name in quick}
    for name, value in quick.items():
        with contextlib.suppress(ValueError):  # a lower setting of the user's own is kept
            value = min(value, int(before[name] or value))
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_mlflow_server(uri: str, given: str) -> None:
    """An http(s) tracking URI answers within seconds: one request to the server (the experiments search the
    tracker starts with), without mlflow's retries."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with _quick_requests():
        try:
            MlflowClient(uri).search_experiments(max_results=1)
            return
        except MlflowException as e:
            error = e
    chain = _causes(error)
    shown, reason = mlflow_store(uri), str(chain[-1]).strip().splitlines()[0][:200]
    if not any(isinstance(cause, OSError) for cause in chain):  # the server answered, with an error
        raise ValueError(
            f"report_to: [mlflow]: the tracking server {shown} ({given}) answered with an error ({reason}): "
            "check that it is an MLflow tracking server and its credentials (MLFLOW_TRACKING_USERNAME / "
            "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN), or set MLFLOW_TRACKING_URI to another server"
        )
    raise ValueError(
        f"report_to: [mlflow]: the tracking server {shown} ({given}) could not be reached ({reason}; "
        f"waited {_PROBE_SECONDS} s at most). Start the server (mlflow server --host HOST --port PORT), or set "
        f"MLFLOW_TRACKING_URI to one that runs, or to {_FOLDER_STORE}, or remove mlflow from report_to"
    )


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions under it, outermost first (mlflow wraps requests' error, which wraps
    urllib3's, which wraps the OS error: "[Errno 111] Connection refused")."""
    chain = [error]
    while len(chain) < 10 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return [e for e in chain if str(e).strip()] or [error]


def check_mlflow_resume(output: Path) -> None:
    """The MLflow run a resume continues (``MLFLOW_RUN_ID``, else the one in ``OUTPUT/trackers.json``) is in
    the store MLflow now points at; a run logged to another store used to end in "Run '...' not found" once
    the model had loaded."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    ids = read_tracker_ids(output)
    from_env = bool(os.environ.get("MLFLOW_RUN_ID"))
    run_id = os.environ.get("MLFLOW_RUN_ID") or ids.get("mlflow")
    if not run_id:
        return
    uri = mlflow.get_tracking_uri()
    with _quick_requests():
        try:
            MlflowClient(uri).get_run(str(run_id))
            return
        except MlflowException as e:
            error = e
    current = mlflow_store(uri)
    given = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "mlflow's default"
    if error.error_code != "RESOURCE_DOES_NOT_EXIST":
        raise ValueError(f"--resume: MLflow run {run_id} could not be read from {current} ({given}): {error}")
    saved = Path(output) / TRACKER_IDS
    if from_env:
        raise ValueError(
            f"MLFLOW_RUN_ID={run_id} names an MLflow run that is not in the tracking store {current} "
            f"({given}): set MLFLOW_TRACKING_URI to the store it is in, or unset MLFLOW_RUN_ID"
        )
    logged = ids.get(MLFLOW_STORE_KEY)
    where = f"it was logged to {logged}" if logged else "it was logged to another store (not recorded)"
    if logged == current:
        where = "it was logged there, and has been deleted since (or the store moved)"
    back = f"MLFLOW_TRACKING_URI={logged}" if logged else "MLFLOW_TRACKING_URI to the store it was logged to"
    raise ValueError(
        f"--resume: this run continues MLflow run {run_id} ({saved}), which is not in the current tracking "
        f"store {current} ({given}); {where}. To continue it, set {back}; to continue training in a new "
        f'MLflow run in {current}, delete the "mlflow" entry of {saved}'
    )
