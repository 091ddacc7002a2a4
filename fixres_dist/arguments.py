"""The command lines' shared pieces, for every command of the package (the scripts', the dry run's, the
memory estimate's child): argparse types that refuse what is not a positive whole number (of pixels) in
one line, a parser whose usage errors are one line (:class:`OneLineParser`) and a help layout that never
splits a flag at its hyphen (:class:`Formatter`). Imports nothing heavy."""
from __future__ import annotations

import argparse
import textwrap

from fixres_dist.errors import FixresError


def whole(text: str, unit: str = "", least: int = 1) -> int:
    """A whole number of at least ``least`` (1: a positive one; of ``unit``, for the message);
    ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{unit}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a positive whole number{unit}, got {text}" if least == 1
                                         else f"must be {least} or more, got {text}")
    return value


def positive_int(text: str) -> int:
    """A count: a positive whole number."""
    return whole(text)


def non_negative_int(text: str) -> int:
    """A count that may be zero (worker processes)."""
    return whole(text, least=0)


def pixels(text: str) -> int:
    """A resolution: a positive whole number of pixels."""
    return whole(text, " of pixels")


def training_size(text: str) -> int:
    """A training resolution: pixels (``auto`` is main_finetune.py's)."""
    if text == "auto":
        raise argparse.ArgumentTypeError("'auto' only applies to main_finetune.py, which finetunes at the best "
                                         "of --test-sizes")
    return pixels(text)


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors in one line, ``<prog>: error: <message>`` (exit status 2), instead of
    the whole usage message before it (:meth:`hint` may add to the message). ``complete(namespace)``, if
    set, runs after parsing and fills in the namespace's options not given from what the command line
    points to (a ``--config`` file); then ``check(namespace)``, if set: flags given together that do not go
    together. Either raising FixresError is a usage error too."""

    check = None
    complete = None

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        try:
            if self.complete is not None:
                self.complete(parsed)
            if self.check is not None:
                self.check(parsed)
        except FixresError as exc:
            self.error(str(exc))
        return parsed, rest

    def hint(self, message: str) -> str:
        """``message`` as the usage error says it (here: as is)."""
        return message

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self.hint(message)}\n")


class Formatter(argparse.HelpFormatter):
    """argparse's help layout, wrapping only between words: ``--input-size`` is never split at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)
