"""Where a training step's time goes, on every rank, always on; and who holds the others back.

Each optimizer step of an epoch is cut by five marks into these phases (milliseconds per step):

* ``data``: from the end of the previous step's work (or the epoch's start) until the batch is in
  hand: the wait for the loader. On a GPU: the device idle between the two (the host was late).
* ``compute``: from the batch to the last gradient bucket handed to DDP's all-reduce: forward and
  backward (with one rank or ``--sharding``, to the end of backward: FSDP's all-gathers and
  reduce-scatters and SyncBatchNorm's all-reduces are inside it).
* ``collectives``: from the last bucket to the end of backward: the gradient all-reduce that the
  backward did not hide, waiting for slower ranks included (None without DDP).
* ``optimizer``: gradient clipping, the optimizer and fp16 scaler steps.
* ``after_step``: the EMA update, the stop agreement, periodic checkpoints, the step's curve point.

Cost: a mark is a ``time.perf_counter()`` on the CPU, a recorded ``torch.cuda.Event`` on a GPU (read
once per epoch, one synchronisation per epoch, none per step); the bucket mark comes from
post-accumulate-grad hooks on the model's first trainable parameters, whose gradients are the last
of the backward (:meth:`~fixres_dist.distributed.ddp_strategy.Replicated.time_gradient_reduction`; DDP keeps its
own all-reduce). ``benchmarks/step_times.py`` measures it against the same run without it
(``--no-step-times``).

Per epoch, every rank's summary (and peak memory: CUDA ``max_memory_allocated`` on a GPU, the
process' peak resident set, ``VmHWM``, on the CPU) is gathered to rank 0 (one collective on the
control group), which records a ``step_times`` event and draws :func:`findings`: a straggler (a
rank persistently slower than the median of the others, named with its host and the phase its
time went to) and a loader-bound job (the median rank waits for data for a quarter of its step or
more), with the number of loader workers that would keep up.
"""
from __future__ import annotations

import math
import socket
import statistics
import time
from pathlib import Path

import torch

from fixres_dist.distributed import collectives

PHASES = ("data", "compute", "collectives", "optimizer", "after_step")
MARKS = ("batch", "backward", "optimizer", "done")  # the marks of a step, in order; "bucket" from DDP
WORDS = {"data": "waiting for data", "compute": "in forward and backward", "optimizer": "in the optimizer step",
         "after_step": "in the work after the step (EMA, stop agreement, checkpoints)"}
SLOWER = 1.2  # a straggler's busy time per step over the other ranks' median, in total ...
PERSISTENT = 0.75  # ... and in at least this share of the epoch's steps
MIN_STEPS = 4  # fewer steps say nothing about persistence
LOADER_BOUND = 0.25  # the median rank's share of step time spent waiting for data


class StepTimes:
    """This rank's step marks of the current epoch on ``device`` (module docstring); a no-op when
    ``enabled`` is False. :meth:`start_epoch`, then per step :meth:`mark` of each of :data:`MARKS`
    in order (and :meth:`bucket_ready` from DDP's hook), then :meth:`summary`."""

    def __init__(self, device: torch.device, rank: int, enabled: bool = True):
        self.device, self.rank, self.enabled = device, rank, enabled
        self.cuda = device.type == "cuda"
        self.steps: list[dict] = []
        self.begun = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_epoch(self) -> None:
        """An epoch's first step is next: forget the last epoch's marks; reset the peak memory."""
        if not self.enabled:
            return
        self.steps, self.begun = [], self._now()
        reset_peak_memory(self.device)

    def mark(self, point: str) -> None:
        """``point`` (one of :data:`MARKS`) of the current step is reached; ``batch`` opens a step.
        Marks outside an epoch's steps (a test's lone step) are ignored."""
        if not self.enabled or self.begun is None:
            return
        if point == "batch":
            self.steps.append({"batch": self._now()})
        elif self.steps and point not in self.steps[-1]:
            self.steps[-1][point] = self._now()

    def bucket_ready(self) -> None:
        """DDP hands a gradient bucket to its all-reduce (the last call of a step marks the end of
        this rank's own backward work)."""
        if self.enabled and self.begun is not None and self.steps and "backward" not in self.steps[-1]:
            self.steps[-1]["bucket"] = self._now()

    def _between(self, a, b) -> float:
        """Milliseconds from mark ``a`` to mark ``b``."""
        return a.elapsed_time(b) if self.cuda else 1000 * (b - a)

    def summary(self) -> dict | None:
        """This rank's epoch: ``steps``; ``ms_per_step`` (phase: mean milliseconds, None where not
        measured); ``busy_ms`` (per step: its time less the collectives' wait); ``peak_memory_gib``
        and ``memory`` (what was measured); ``rank``, ``host``. None when disabled or without a
        complete step."""
        steps = [s for s in self.steps if all(m in s for m in MARKS)] if self.enabled else []
        if not steps:
            return None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        totals = dict.fromkeys(PHASES, 0.0)
        busy, before, hooked = [], self.begun, all("bucket" in s for s in steps)
        for step in steps:
            own_end = step["bucket"] if hooked else step["backward"]
            phases = {"data": self._between(before, step["batch"]), "compute": self._between(step["batch"], own_end),
                      "collectives": self._between(own_end, step["backward"]) if hooked else 0.0,
                      "optimizer": self._between(step["backward"], step["optimizer"]),
                      "after_step": self._between(step["optimizer"], step["done"])}
            for phase, ms in phases.items():
                totals[phase] += ms
            busy.append(sum(phases.values()) - phases["collectives"])
            before = step["done"]
        self.steps, self.begun = [], None
        peak, memory = peak_memory(self.device)
        return {"rank": self.rank, "host": socket.gethostname(), "steps": len(steps),
                "ms_per_step": {p: (None if p == "collectives" and not hooked else round(totals[p] / len(steps), 3))
                                for p in PHASES},
                "busy_ms": [round(ms, 3) for ms in busy], "peak_memory_gib": round(peak / 2**30, 4), "memory": memory}


    def gather(self, group=None) -> list[dict | None] | None:
        """Every rank's :meth:`summary` on rank 0 (in rank order), None on the others: a collective
        on ``group`` (the control group), every rank calls it; None everywhere when disabled."""
        if not self.enabled:
            return None
        return collectives.gather_object(self.summary(), group)


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak memory of ``device`` afresh: CUDA's allocator statistics on a GPU, else this
    process' peak resident set (:func:`reset_peak_resident_set`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_resident_set()


def peak_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, what was measured)``: CUDA ``max_memory_allocated`` on a GPU, else this process' peak
    resident set (:func:`peak_resident_set`), each since :func:`reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    return peak_resident_set(), "peak resident set (VmHWM)"


def reset_peak_resident_set() -> None:
    """Start this process' peak resident set afresh (Linux: ``5`` into ``/proc/self/clear_refs``);
    where that is refused, :func:`peak_resident_set` is the peak since the start."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_resident_set() -> int:
    """This process' peak resident set in bytes (``VmHWM``; ``ru_maxrss`` where /proc has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def workers_to_keep_up(data_ms: float, other_ms: float, workers: int) -> int:
    """Loader workers per rank that would deliver a batch every ``other_ms`` (the step's time not
    spent waiting for data) when this rank waits ``data_ms`` per step with ``workers`` now.

    Each worker takes T ms per batch: with 0 workers the main process loads while the step waits,
    so T = ``data_ms``; with n, a batch arrives every T / n = ``data_ms + other_ms``. Keeping up takes
    ceil(T / ``other_ms``) workers, at least one more than now (given the cores to run them)."""
    per_batch = data_ms if workers == 0 else workers * (data_ms + other_ms)
    return max(workers + 1, math.ceil(per_batch / max(other_ms, 1e-3)))


def findings(ranks: list[dict], epoch: int, workers: int) -> list[str]:
    """The warnings of epoch ``epoch`` (1-based) from every rank's :meth:`StepTimes.summary` (in rank
    order, None for a rank without one): each straggler, then a loader-bound job; one line each."""
    ranks = [r for r in ranks if r is not None]
    lines, slow = [], set()
    steps = min((len(r["busy_ms"]) for r in ranks), default=0)
    if len(ranks) >= 2 and steps >= MIN_STEPS:
        for rank in ranks:
            others = [r for r in ranks if r is not rank]
            medians = [statistics.median(r["busy_ms"][i] for r in others) for i in range(steps)]
            slower = sum(rank["busy_ms"][i] > SLOWER * medians[i] for i in range(steps))
            ratio = sum(rank["busy_ms"][:steps]) / max(sum(medians), 1e-9)
            if ratio < SLOWER or slower < PERSISTENT * steps:
                continue
            slow.add(rank["rank"])
            excess = {p: rank["ms_per_step"][p] - statistics.median(r["ms_per_step"][p] for r in others)
                      for p in WORDS}
            phase = max(excess, key=excess.get)
            waits = [r["ms_per_step"]["collectives"] for r in others if r["ms_per_step"]["collectives"] is not None]
            line = (f"straggler: rank {rank['rank']} ({rank['host']}) was {ratio:.1f}x slower than the median of the "
                    f"other ranks, in {slower} of {steps} steps of epoch {epoch}: +{excess[phase]:.0f} ms per step "
                    f"{WORDS[phase]}"
                    + (f"; the other ranks waited a median {statistics.median(waits):.0f} ms per step in the "
                       "gradient all-reduce" if waits else ""))
            if phase == "data":
                line += "; its loader is the bottleneck: " + _loader_advice(rank, workers)
            lines.append(line)
    fast = [r for r in ranks if r["rank"] not in slow] or ranks
    if fast:
        median = sorted(fast, key=lambda r: r["ms_per_step"]["data"])[len(fast) // 2]
        step_ms = sum(v for v in median["ms_per_step"].values() if v is not None)
        if median["steps"] >= MIN_STEPS and median["ms_per_step"]["data"] >= LOADER_BOUND * step_ms:
            lines.append(f"loader-bound: in epoch {epoch} the ranks waited {median['ms_per_step']['data']:.0f} ms of "
                         f"each {step_ms:.0f} ms step for data "
                         f"({100 * median['ms_per_step']['data'] / step_ms:.0f} %, median rank); the loaders are the "
                         "bottleneck: " + _loader_advice(median, workers))
    return lines


def line(ranks: list[dict]) -> str:
    """The epoch's step times in one log line: each phase's median over ``ranks`` (their
    :meth:`StepTimes.summary`) in ms per step, and the largest peak memory."""
    names = {"data": "data", "compute": "compute", "collectives": "all-reduce", "optimizer": "optimizer",
             "after_step": "after"}
    parts = [f"{names[p]} {statistics.median(values):.1f}" for p in PHASES
             if (values := [r["ms_per_step"][p] for r in ranks if r["ms_per_step"][p] is not None])]
    peak = max(ranks, key=lambda r: r["peak_memory_gib"])
    return (f"  step times (ms per step, median of {len(ranks)} rank{'s' if len(ranks) > 1 else ''}): "
            f"{', '.join(parts)}; peak memory {peak['peak_memory_gib']:.2f} GiB (rank {peak['rank']})")


def _loader_advice(rank: dict, workers: int) -> str:
    times = rank["ms_per_step"]
    other = sum(v for p, v in times.items() if v is not None and p != "data")
    need = workers_to_keep_up(times["data"], other, workers)
    return f"about --workers {need} per rank would keep up (now {workers}), given the cores to run them"
