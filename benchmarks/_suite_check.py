"""The dry run's checks of benchmarks/gpu_suite.sh, in one process (importing torch once instead of once per step).

    python benchmarks/_suite_check.py 'python benchmarks/throughput.py --device cuda' ...

For each command (as the suite runs it, from the repository root): a script must exist and its ``--help`` must
list every ``--option`` the command passes; ``-m pytest`` must collect at least one test; a script that runs
``neoembed mteb`` (mteb_precision.py) has the options it passes there checked against ``neoembed mteb --help``.
Prints one line per problem; exits 1 if there is any.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

MTEB_OPTIONS = ("--model", "--data-dir", "--precision", "--device", "--output", "--overwrite")


def captured_help(run) -> str:
    """stdout + stderr of ``run()``, which is expected to end with SystemExit (argparse/typer after --help)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            run()
        except SystemExit:
            pass
    return buf.getvalue()


def missing_options(help_text: str, args: list[str]) -> list[str]:
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    return [f for f in flags if not re.search(rf"(^|[^\w-]){re.escape(f)}([^\w-]|$)", help_text)]


def script_help(script: str) -> str:
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [script, "--help"]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        return captured_help(lambda: runpy.run_path(script, run_name="__main__"))
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def neoembed_help(*command: str) -> str:
    from neoembed.cli import app

    return captured_help(lambda: app([*command, "--help"], prog_name="neoembed"))


def check(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[1:3] == ["-m", "pytest"]:
        import pytest

        class Count:  # a pytest plugin that keeps the selection
            items: list = []

            def pytest_collection_finish(self, session):
                Count.items = list(session.items)

        with contextlib.redirect_stdout(io.StringIO()):
            code = pytest.main(
                [*argv[3:], "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[Count()]
            )
        print(f"  {len(Count.items)} tests collected for: {command}")
        if code == 0 and Count.items:
            return []
        return [f"pytest collection failed or selected nothing (exit {code}): {command}"]
    script = argv[1]
    if not Path(script).is_file():
        return [f"{script} does not exist"]
    help_text = script_help(script)
    problems = [f"{script} has no option {f}" for f in missing_options(help_text, argv[2:])]
    if "usage:" not in help_text:
        problems.append(f"{script} --help printed no usage: {help_text[-300:]!r}")
    if Path(script).name == "mteb_precision.py":
        mteb = neoembed_help("mteb")
        problems += [f"neoembed mteb has no option {f}" for f in missing_options(mteb, list(MTEB_OPTIONS))]
    return problems


def main() -> None:
    problems = [p for command in sys.argv[1:] for p in check(command)]
    for p in problems:
        print(f"  CHECK FAILED: {p}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
