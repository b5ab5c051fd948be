"""The installed ``neoembed`` console script in a process of its own, one command line per command family, as a
user's shell runs it (#41): the exit code of the contract in ``neoembed.cli.main`` and a message naming the
problem on stderr, no traceback.

The other command-line tests run ``neoembed.cli.main`` in the test's interpreter (``run_neoembed`` in
``conftest.py``); these check what that cannot: the console script and ``python -m neoembed`` as entry points, and
the exit status a shell sees. Each line stops at its input check, so the file takes seconds. Runs to completion in
a process of their own: ``tests/test_wheel.py`` (train, CDE and pre-training from the installed wheel), the
launched runs of ``tests/test_distributed.py`` (``-m neoembed train``/``pretrain``/``glue``) and the documented
lines that bash runs in ``test_docs_commands.py`` (launchers, redirections, ``&&``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neoembed._version import __version__

# the console script that pip installed beside this interpreter: what `neoembed` on a user's PATH is
NEOEMBED = Path(sys.executable).parent / "neoembed"

# (family, arguments, exit code, what stderr says); {tmp} is the test's scratch folder
LINES = [
    ("train", ["train", "tiny", "steps=-1"], 2, "'steps': Input should be greater than 0"),
    ("pretrain", ["pretrain", "pretrain-tiny", "steps=-1"], 2, "'steps': Input should be greater than 0"),
    ("mteb", ["mteb", "compare", "{tmp}/a", "{tmp}/b"], 2, "holds no neoembed mteb results"),
    ("data", ["data", "check", "{tmp}/card.yaml"], 2, "it is neither a file nor a shipped name"),
    ("mine", ["mine", "{tmp}/card.yaml", "--model", "x", "--out", "{tmp}/m"], 2, "not found"),
    ("glue", ["glue", "WNLI", "--model", "x", "--out", "{tmp}/g"], 2, "WNLI is excluded"),
    ("usage", ["train", "tiny", "--no-such-option"], 2, "No such option: --no-such-option"),
]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", NEOEMBED_DEBUG="")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("family", "args", "code", "said"), LINES, ids=[line[0] for line in LINES])
def test_console_script_exit_code_and_message(family, args, code, said, tmp_path):
    r = _run([str(NEOEMBED), *(a.format(tmp=tmp_path) for a in args)], tmp_path)
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert said in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_both_entry_points_print_the_version(tmp_path):
    for argv in ([str(NEOEMBED)], [sys.executable, "-m", "neoembed"]):
        r = _run([*argv, "--version"], tmp_path)
        assert r.returncode == 0 and r.stdout.strip() == f"neoembed {__version__}", (argv, r.stdout, r.stderr)


# A26 (#43): a command whose output is complete, signalled while the interpreter shuts down (a thread still
# running, the exit callbacks, the modules freed after a large model)
_LATE = """
import atexit, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell's foreground process has it
atexit.register(lambda: print("last stage ignores:", [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)]))
threading.Thread(target=time.sleep, args=(60,)).start()  # a thread that keeps the process in its shutdown
from neoembed.cli import entry
sys.argv = ["neoembed", "--version"]
entry()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a26_signal_after_the_command_ended_keeps_its_exit_status(sig, tmp_path):
    import signal
    import time

    p = subprocess.Popen(
        [sys.executable, "-c", _LATE], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == f"neoembed {__version__}"  # the command ended; the thread holds on
    time.sleep(0.5)
    p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, (p.returncode, out, err)
    assert f"{sig} after the command ended: its output is complete" in err and "Traceback" not in err, err


def test_a26_the_last_exit_callback_ignores_signals(tmp_path):
    # past the exit callbacks the interpreter restores the default handlers, which would kill a finished command
    r = subprocess.run(
        [sys.executable, "-c", _LATE.replace("args=(60,)", "args=(0,)")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "last stage ignores: [True, True]" in r.stdout, r.stdout
