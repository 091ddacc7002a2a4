"""Numbers that stay numbers: a diverged loss stops every rank at the same step, and nothing
non-finite is ever written (checkpoints, weights read, ``metrics.jsonl``).

* :class:`LossWatch` records, per rank, the first optimizer step whose summed loss was not finite,
  without a host-device synchronisation per step: on the CPU the check is immediate; on CUDA the
  flag is copied, without blocking, into pinned host memory and read one step later, once the
  device has finished that step (the next step's kernels are already queued behind it, so the
  device never idles).
* :func:`agreement_code` / :func:`agreed_bad_step`: this rank's first bad step rides on the
  per-step stop-signal all-reduce (:class:`fixres_dist.distributed.preemption.StepAgreement`, a MAX over
  ranks), so all ranks learn the earliest bad step of any rank at the same step, with no
  collective of its own. That agreement is one step late after a plain training step and immediate
  before a checkpoint, which therefore never holds the weights of a non-finite step.
* :func:`non_finite_tensors` names the floating-point tensors of a state that hold NaN or infinity:
  the checkpoint writer refuses such a state (:func:`fixres_dist.training.checkpoint.save_checkpoint`), as
  does the weight loader (:mod:`fixres_dist.models.weights`) and the resume
  (:func:`fixres_dist.training.checkpoint.load_checkpoint`).
* :func:`json_safe` replaces non-finite floats by ``None`` (JSON ``null``), so that every line of
  ``metrics.jsonl`` is strict JSON (RFC 8259 has no NaN or Infinity).
"""
from __future__ import annotations

import math

import torch

from fixres_dist.errors import FixresError

# No bad step: below every -step, so that a MAX over ranks picks the earliest bad step (-step largest).
_NO_BAD_STEP = -(2 ** 62)


class NonFiniteLoss(FixresError):
    """Training produced a NaN or infinite loss (or outputs): every rank stops, nothing is written."""


class NonFiniteWeights(FixresError):
    """The weights or optimizer state to checkpoint hold NaN or infinity (an update diverged after a
    finite loss); ``detail`` says which tensors (:func:`describe_non_finite`)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


class LossWatch:
    """This rank's first optimizer step with a non-finite loss (:attr:`first_bad`, None while all finite)."""

    def __init__(self):
        self.first_bad: int | None = None
        self._pending: list[tuple[int, torch.Tensor, torch.cuda.Event]] = []  # CUDA: (step, pinned flag, event)

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """Record whether ``loss`` (a tensor of any shape, on any device) of optimizer step ``step`` is finite.

        On the CPU (and any device without CUDA events) known at once; on CUDA, known after the next
        :meth:`observe` or :meth:`flush` (see the module docstring).
        """
        finite = torch.isfinite(loss.detach()).all()
        if loss.device.type != "cuda":
            if self.first_bad is None and not bool(finite):
                self.first_bad = step
            return
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(finite, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, flag, event))
        self._read(keep=1)

    def flush(self) -> int | None:
        """Wait for every observed step's flag; returns :attr:`first_bad`."""
        self._read(keep=0)
        return self.first_bad

    def _read(self, keep: int) -> None:
        while len(self._pending) > keep:
            step, flag, event = self._pending.pop(0)
            event.synchronize()  # that step is done; later steps keep running
            if self.first_bad is None and not bool(flag):
                self.first_bad = step


def agreement_code(first_bad: int | None) -> int:
    """This rank's contribution to the MAX all-reduce: ``-first_bad``, or a value below all of them."""
    return _NO_BAD_STEP if first_bad is None else -first_bad


def agreed_bad_step(code: int) -> int | None:
    """The earliest bad step of any rank from the all-reduced (MAX) :func:`agreement_code`, or None."""
    return None if code <= _NO_BAD_STEP else -code


def non_finite_tensors(state) -> tuple[list[str], int]:
    """``(names of the floating-point tensors holding NaN or infinity, number of floating-point tensors)``.

    ``state``: a tensor, or nested dicts/lists/tuples of them (a state_dict, an optimizer state).
    Names are key paths joined by ``/`` (``conv1.weight``, ``state/0/momentum_buffer``). One
    host-device synchronisation per device, not one per tensor.
    """
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex():
                found.append((path, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}" if path else str(key))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}" if path else str(index))

    walk(state, "")
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in found:
        if tensor.device.type != "meta":
            by_device.setdefault(tensor.device, []).append((name, tensor))
    bad = []
    for items in by_device.values():
        finite = torch.stack([torch.isfinite(t).all() for _, t in items]).tolist()
        bad += [name for (name, _), ok in zip(items, finite) if not ok]
    return sorted(bad), len(found)


def describe_non_finite(bad: list[str], total: int) -> str:
    """``"102 of 122 tensors hold NaN or infinity (e.g. conv1.weight, bn1.weight, ...)"``."""
    shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
    return f"{len(bad)} of {total} tensors hold NaN or infinity (e.g. {shown})"


def json_safe(value):
    """``value`` with every non-finite float (NaN, +-inf) inside dicts/lists/tuples replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
