"""What a tracked run needs from outside, checked before any model loads (by
:func:`neoembed.runs.check_trackers`): an MLflow tracking server that answers. It used to fail only once the
model had loaded, after minutes of mlflow's retries, as an unexpected error."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# seconds the check waits for a tracking server (mlflow's own requests retry for minutes)
_PROBE_SECONDS = 5

_FOLDER_STORE = "MLFLOW_TRACKING_URI=file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true (a local folder)"


def mlflow_store(uri: str) -> str:
    """``uri`` as messages show it: a local folder as an absolute ``file:`` URI (a relative one depends on the
    working folder), a server without the password of ``user:password@``."""
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
