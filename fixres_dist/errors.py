"""The one exception type that is shown to users as a single line.

Anything raised as :class:`FixresError` is a problem with the user's input or environment (a bad
flag, a missing folder, a peer rank that never arrived). The launcher prints it as
``fixres_dist: rank R: <message>`` on stderr and exits with status 1, without a traceback. Any
other exception is a bug and keeps its traceback.
"""
import sys


class FixresError(Exception):
    """A user-facing error; its message is one line that says what is wrong and what to do."""


class FixresWarning(UserWarning):
    """A warning about a run that goes on (an EMA too slow to move, a finetune below the train
    resolution, a TensorBoard log that stopped). The Trainer also logs it as a ``warning:`` line, so a
    run started with ``Trainer(config)()`` (as the scripts do) shows only that line."""


def user_message(exc: BaseException) -> str | None:
    """The one-line message of a FixresError, also when a DataLoader worker re-raised it wrapped."""
    if isinstance(exc, FixresError) and "Original Traceback" not in str(exc):
        return str(exc)
    text = str(exc)
    marker = "FixresError: "
    if marker in text:
        return text.rsplit(marker, 1)[1].strip().splitlines()[0]
    return None


def plural(count: int, word: str) -> str:
    """``"1 rank"``, ``"2 ranks"``, ``"0 updates"``: a count and its noun, for messages."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)``, or the exception's type name when it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


CLEAR_LINE = "\r\033[K"  # back to the line's start, erase it: where rank 0's progress bar may be drawn


def is_terminal(file) -> bool:
    """Whether ``file`` (e.g. ``sys.stderr``) is a terminal, where progress bars are drawn."""
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write, so that the one-line errors of ranks
    sharing a terminal never run together on one line; on a terminal, the line is cleared first, so
    that the message does not land after a progress bar (which another process may have drawn)."""
    sys.stderr.write((CLEAR_LINE if is_terminal(sys.stderr) else "") + line + "\n")
    sys.stderr.flush()
