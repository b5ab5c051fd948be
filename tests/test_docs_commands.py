"""Every ``neoembed ...`` command line in the README and docs/ parses: the subcommand exists and so does every
option it names (so a renamed or removed command cannot survive in the documentation)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import typer

from neoembed.cli import app

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _command_lines(text: str) -> list[str]:
    """``neoembed ...`` lines of fenced blocks (comments dropped, ``&&`` chains split, ``-m neoembed`` after a
    launcher) and inline code spans that start with ``neoembed ``."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                part = re.sub(r"\s+#.*$", "", part).strip()
                if "-m neoembed " in part:
                    part = "neoembed " + part.split("-m neoembed ", 1)[1]
                if part.startswith("neoembed "):
                    found.append(part)
    found += re.findall(r"`(neoembed [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return found


def _check(line: str, root) -> str | None:
    """None if ``line`` parses, else why not."""
    try:
        tokens = shlex.split(line.replace("[", " ").replace("]", " "))[1:]
    except ValueError as e:
        return f"{e}"
    command, path = root, ["neoembed"]
    for token in tokens:
        if token.startswith("-") and token not in ("-", "--"):
            name = token.split("=", 1)[0]
            valid = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
            if name not in valid:
                return f"{' '.join(path)} has no option {name} (valid: {sorted(valid)})"
        elif hasattr(command, "commands") and token in command.commands:
            command = command.commands[token]
            path.append(token)
        elif hasattr(command, "commands") and not command.commands.get(token) and len(path) == 1:
            return f"no subcommand {token!r} (valid: {sorted(command.commands)})"
    return None


def test_every_documented_command_line_parses():
    root = typer.main.get_command(app)
    checked, wrong = 0, []
    for page in PAGES:
        for line in _command_lines(page.read_text(encoding="utf8")):
            checked += 1
            if (why := _check(line, root)) is not None:
                wrong.append(f"{page.relative_to(REPO)}: {line}\n    {why}")
    assert checked > 20, checked  # the pages do hold commands: the reader found them
    assert not wrong, "stale command lines:\n" + "\n".join(wrong)


def test_the_checker_catches_stale_commands():
    root = typer.main.get_command(app)
    assert _check("neoembed mteb --model m --tasks STS13", root) is None
    assert "no option --taks" in _check("neoembed mteb --model m --taks STS13", root)
    assert "no subcommand 'evaluate'" in _check("neoembed evaluate --model m", root)
    assert _command_lines("```bash\nx && neoembed quickstart  # go\n```\nsee `neoembed train tiny`") == [
        "neoembed quickstart",
        "neoembed train tiny",
    ]
