"""The commands the README, the pages of ``docs/`` and the scripts' comments show, for the tests
that run them.

A *block* is one fenced ```` ```bash ```` block of README.md or of a page ``docs/*.md``, or one
``e.g.`` example in the header comment of a script (``scripts/*.sh``, ``slurm/job.sbatch``). Its
*commands* are its logical lines: backslash continuations joined, comments and blank lines dropped.
A test takes what it runs from here, by the start of a command (:func:`block`, :func:`command`), so
that it runs what the pages say, and ``tests/jobs/test_readme.py`` checks that every command shown is
taken by some test. Placeholders (``DATA``, ``SHARED``, ``/tmp/runs``, ``n1``, ...) are replaced by
:func:`filled`.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [*sorted((ROOT / "scripts").glob("*.sh")), ROOT / "slurm" / "job.sbatch"]


def _logical_lines(lines: list[str]) -> list[str]:
    commands, pending = [], ""
    for line in lines:
        line = re.sub(r"(^|\s)#\s.*$", "", line.rstrip()) if not line.lstrip().startswith("#!") else ""
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
            continue
        line = (pending + line.strip()).strip()
        pending = ""
        if line:
            commands.append(re.sub(r"\s+", " ", line))
    return commands


def pages() -> list[Path]:
    """The pages that show commands: README.md, then every ``docs/*.md`` by name."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(page: Path) -> list[list[str]]:
    """The ```bash blocks of one page (indented ones too), each as its list of commands."""
    blocks, current = [], None
    for line in page.read_text().splitlines():
        fence = line.strip()
        if current is None and fence == "```bash":
            current, indent = [], len(line) - len(line.lstrip())
        elif current is not None and fence == "```":
            blocks.append(_logical_lines(current))
            current = None
        elif current is not None:
            current.append(line[indent:])
    return [b for b in blocks if b]


def readme_blocks() -> list[list[str]]:
    """The ```bash blocks of README.md and of every page of ``docs/``, page by page."""
    return [b for page in pages() for b in page_blocks(page)]


def script_examples() -> list[list[str]]:
    """The ``e.g.`` commands of the scripts' header comments (``#   e.g. CMD \\`` and its continuation)."""
    blocks = []
    for script in SCRIPTS:
        lines = script.read_text().splitlines()
        for i, line in enumerate(lines):
            found = re.match(r"#\s+e\.g\.\s+(.*)$", line)
            if found:
                example = [found.group(1)]
                while example[-1].rstrip().endswith("\\"):
                    i += 1
                    example.append(lines[i].lstrip("#").strip())
                blocks.append(_logical_lines(example))
    return blocks


def all_blocks() -> list[list[str]]:
    return readme_blocks() + script_examples()


def block(start: str) -> list[str]:
    """The one block (of a page or of a script's comments) that has a command starting with ``start``."""
    found = [b for b in all_blocks() if any(c.startswith(start) for c in b)]
    assert len(found) == 1, f"{len(found)} blocks shown have a command starting with {start!r}"
    return found[0]


def command(start: str) -> str:
    """The one command shown that starts with ``start``."""
    found = [c for b in all_blocks() for c in b if c.startswith(start)]
    assert len(found) == 1, f"{len(found)} commands shown start with {start!r}: {found}"
    return found[0]


def filled(text: str, **values) -> str:
    """``text`` with each placeholder word ``KEY`` (as a whole word or path) replaced by ``values[KEY]``."""
    for key, value in values.items():
        text = re.sub(rf"(?<![\w/.-]){re.escape(key)}(?![\w-])", str(value), text)
    return text


def argv(text: str, **values) -> list[str]:
    """:func:`filled` then split as the shell would (no expansions)."""
    return shlex.split(filled(text, **values))


def sandbox(folder: Path) -> Path:
    """A folder that looks like a fresh clone for commands run in it: links to the repository's
    scripts, package, data and ``.venv``, so ``runs/`` and other outputs land in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("main_scratch.py", "main_finetune.py", "fixres_dist", "scripts", "slurm", "setup.py", ".venv"):
        if (ROOT / name).exists() and not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)
    return folder


def shell_env(**extra) -> dict:
    """The environment of an activated ``.venv`` (``python``, ``torchrun`` are the venv's), with no
    launcher variables, the repository importable, and ``extra``."""
    import sys

    from conftest import clean_env
    env = clean_env(**extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env
