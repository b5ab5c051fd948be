"""A pre-imported ``neoembed`` for tests that run many command lines as written (the documented pages).

Each ``neoembed`` process spends most of a short command importing torch, transformers, sentence-transformers and
mteb (about 10 s on a 2-core CI machine). ``WarmNeoembed`` pays that once: a server process imports them and forks
a copy of itself for every command, so each command still starts from a fresh interpreter state, never from what
an earlier command left. A ``neoembed`` shim first on ``PATH`` sends its argv, working directory, environment and
standard streams to the server and exits with the command's exit code, so bash runs the lines unchanged (quoting,
``&&``, redirections); ``python -m neoembed`` and ``accelerate launch -m neoembed`` still start their own
interpreters.

The server is started with the commands' environment: what a library reads from it at import time
(``HF_HUB_OFFLINE``, ``OMP_NUM_THREADS``) is what the commands would have read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER = r"""
import atexit, gc, json, os, socket, sys, threading

import accelerate, mteb, sentence_transformers  # noqa: F401  what the commands import, paid once
from neoembed.cli import main


def serve(path):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(16)
    gc.freeze()  # what is imported stays out of the forks' collections: their pages stay shared
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:  # a manager per command: forks the command, waits, reports its exit code
            server.close()
            command = os.fork()
            if command == 0:
                return conn, json.loads(message), fds
            code = os.waitstatus_to_exitcode(os.waitpid(command, 0)[1])
            conn.send(str(128 - code if code < 0 else code).encode())
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)
        while True:  # reap finished managers
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


conn, request, fds = serve(sys.argv[1])
conn.close()
for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.argv = [sys.argv[2], *request["argv"]]
try:
    main()
    code = 0
except SystemExit as e:  # as the interpreter reads it
    code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
except BaseException:
    sys.excepthook(*sys.exc_info())
    code = 1
# exit as the interpreter does (threads joined, exit functions run, streams flushed), less the module teardown:
# in a fork it touches every inherited page (seconds)
threading._shutdown()
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""

SHIM = """#!{python} -IS
import json, os, socket, sys

s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({socket!r})
request = {{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}
socket.send_fds(s, [json.dumps(request).encode()], [0, 1, 2])
sys.exit(int(s.recv(16) or 1))
"""


class WarmNeoembed:
    """``with WarmNeoembed(env) as warm:`` then run commands with ``warm.env`` (``PATH`` starts at the shim), or
    ``warm.run(["neoembed", ...], cwd)``. The socket and the shim live in a temporary folder of their own (a short
    path: a socket's is limited to 107 bytes)."""

    def __init__(self, env: dict[str, str]):
        self.folder = Path(tempfile.mkdtemp(prefix="neoembed-warm-"))
        socket = self.folder / "socket"
        script = Path(sys.executable).parent / "neoembed"  # the console script the shim stands for
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(socket), str(script)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if self.server.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the pre-imported neoembed server did not start (its stderr is above)")
        shim = self.folder / "bin" / "neoembed"
        shim.parent.mkdir()
        shim.write_text(SHIM.format(python=sys.executable, socket=str(socket)))
        shim.chmod(0o755)
        self.env = dict(env, PATH=f"{shim.parent}{os.pathsep}{env.get('PATH', '')}")

    def run(self, argv: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        """``neoembed ARGS`` as ``subprocess.run(..., capture_output=True, text=True)`` runs it; ``env`` as
        given to a command (the server's own was set at its start)."""
        assert argv[0] == "neoembed", argv
        env = self.env if env is None else dict(env, PATH=self.env["PATH"])
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)

    def close(self) -> None:
        self.server.kill()
        self.server.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> WarmNeoembed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
