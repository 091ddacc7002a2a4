"""What rank 0 shows while a job runs: progress bars on stderr and the job's remaining time.

* :class:`Bar`: one tqdm bar (training epoch, evaluation) that redraws at most every
  ``interval`` seconds. Between redraws it only counts: the latest step's loss, a tensor that may
  live on the GPU, is kept by reference and read (one host-device synchronisation) only when the bar
  is about to redraw, so the loss shown is always that of the latest step, with no
  synchronisation per step. Disabled (every call a no-op, nothing written) on ranks other than 0
  and with ``--no-progress``.
* :class:`JobClock`: the job's remaining time, from the rates measured so far: seconds per
  training image, and seconds per evaluated image per pixel of its area (an evaluation at ``s``
  pixels costs about ``s**2``). Before anything was evaluated, an evaluated image is assumed to
  cost a third of a trained one of the same area (a forward pass against a forward and backward
  pass).

Bars go to ``sys.stderr``; the Trainer logs with ``tqdm.write``, which clears a bar and redraws it
under the message, so log lines stay whole.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from fixres_dist.errors import is_terminal

REFRESH_SECONDS = 0.5  # a bar redraws at most this often
FORWARD_SHARE = 1 / 3  # an evaluated image's cost against a trained one's, until one is measured


def format_seconds(seconds: float | None) -> str:
    """``"1:02:03"``/``"02:03"`` for a duration in seconds; ``"?"`` when unknown."""
    return "?" if seconds is None else tqdm.format_interval(max(0, round(seconds)))


UNSIZED_TERMINAL = (100, 20)  # columns, rows drawn in where the terminal reports 0 x 0


def _unsized_terminal(file) -> tuple[int, int] | None:
    """:data:`UNSIZED_TERMINAL` for a terminal that reports no size (a pseudo-terminal nobody sized,
    as ``script`` makes from a pipe), where tqdm would draw nothing; None otherwise (tqdm follows
    the terminal's size as it changes)."""
    try:
        columns, rows = os.get_terminal_size(file.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    return UNSIZED_TERMINAL if not (columns and rows) else None


class Bar:
    """A progress bar over ``total`` units (images) on stderr, redrawn at most every ``interval`` seconds.

    ``initial``: units already done (a resumed epoch). ``postfix(bar)``: extra text shown after the
    loss (the job's remaining time), computed only at a redraw. ``clock``: seconds, monotonic.
    ``file``: where to draw (default ``sys.stderr`` at construction).
    """

    def __init__(self, total: int, desc: str, *, enabled: bool, initial: int = 0, unit: str = "img",
                 postfix: Callable[["Bar"], str] | None = None, interval: float = REFRESH_SECONDS,
                 clock: Callable[[], float] = time.monotonic, file=None):
        self.enabled, self.interval, self.clock, self.postfix = enabled, interval, clock, postfix
        self.total, self.initial, self.done = total, initial, initial
        self.started = clock() if enabled else 0.0
        self._next = self.started + interval
        self._drawn = initial  # units the tqdm bar has been told of
        self._loss: tuple[torch.Tensor, int] | None = None  # the latest step's (summed loss, images)
        self.shown_loss: float | None = None  # the mean loss (nats) on the bar, as last drawn
        file = file or sys.stderr
        size = _unsized_terminal(file)
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=True, leave=False,
                         mininterval=0, miniters=1, file=file, disable=not enabled, dynamic_ncols=size is None,
                         ncols=size and size[0], nrows=size and size[1])

    def advance(self, units: int, loss_sum: torch.Tensor | None = None, images: int = 0) -> None:
        """``units`` more done; ``loss_sum`` (summed over ``images``) is the latest step's loss,
        kept unread until the next redraw. Redraws when ``interval`` seconds have passed."""
        if not self.enabled:
            return
        self.done += units
        if loss_sum is not None:
            self._loss = (loss_sum, images)
        if self.clock() >= self._next:
            self.refresh()

    def seconds(self) -> float:
        """Seconds since the bar was created."""
        return self.clock() - self.started

    def refresh(self) -> None:
        """Redraw now, with the latest loss (read from the device here) and the postfix."""
        if not self.enabled:
            return
        parts = []
        if self._loss is not None:
            loss_sum, images = self._loss
            self.shown_loss = float(loss_sum) / max(images, 1)  # the one host-device sync per redraw
            parts.append(f"loss={self.shown_loss:.3f}")
        if self.postfix is not None:
            parts.append(self.postfix(self))
        self._bar.set_postfix_str(", ".join(p for p in parts if p), refresh=False)
        self._bar.update(self.done - self._drawn)  # mininterval 0: tqdm draws at once
        self._drawn = self.done
        self._next = self.clock() + self.interval

    def close(self) -> None:
        """Remove the bar (it leaves no line behind)."""
        self._bar.close()


def shown(config) -> bool:
    """Whether this process draws progress bars for a run of ``config``: rank 0, with ``--progress``,
    or by default when its stderr is a terminal (not a log file or a pipe)."""
    wanted = config.progress
    return config.global_rank == 0 and (is_terminal(sys.stderr) if wanted is None else wanted)


class JobClock:
    """Measured rates and the job's remaining time in seconds (see the module docstring)."""

    def __init__(self):
        self.train_images, self.train_seconds = 0, 0.0
        self.eval_area, self.eval_seconds = 0.0, 0.0  # images x pixels^2 evaluated, and their seconds

    def add_training(self, images: int, seconds: float) -> None:
        """Record ``images`` trained on in ``seconds`` (one epoch, or the part of it this process ran)."""
        self.train_images, self.train_seconds = self.train_images + images, self.train_seconds + seconds

    def add_evaluation(self, images: int, size: int, seconds: float) -> None:
        """Record an evaluation of ``images`` at ``size`` pixels that took ``seconds``."""
        self.eval_area, self.eval_seconds = self.eval_area + images * size ** 2, self.eval_seconds + seconds

    def remaining(self, train_images: float, train_size: int, evaluations: Iterable[tuple[float, int]],
                  live: tuple[int, float] = (0, 0.0)) -> float | None:
        """Seconds left for ``train_images`` images at ``train_size`` pixels and ``evaluations``
        (``(images, size in pixels)`` each); ``live``: images and seconds of the epoch in progress,
        not yet recorded. None while no rate that the remaining work needs was measured."""
        images, seconds = self.train_images + live[0], self.train_seconds + live[1]
        per_train_image = seconds / images if images and seconds > 0 else None
        if self.eval_area and self.eval_seconds > 0:
            per_eval_area = self.eval_seconds / self.eval_area
        elif per_train_image is not None:
            per_eval_area = FORWARD_SHARE * per_train_image / train_size ** 2
        else:
            per_eval_area = None
        area = sum(n * size ** 2 for n, size in evaluations)
        if (train_images and per_train_image is None) or (area and per_eval_area is None):
            return None
        return (train_images * per_train_image if train_images else 0.0) + (area * per_eval_area if area else 0.0)
