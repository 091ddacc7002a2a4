"""The preflight's memory check: a training run's estimated peak memory per rank
(:func:`fixres_dist.training.memory_estimate.estimate`, bytes) against its budget (:func:`budget_bytes`:
``--memory-budget`` in GiB, else on CUDA the GPU's memory), and when it exceeds it, the cheapest
change that fits (:func:`find_fit`: activation checkpointing, full sharding, the model split over
tensor groups or pipeline stages, then halving the batch). The estimate is the one every layout gets
(the most loaded rank's: a pipeline's largest stage, a tensor group's rank).
:func:`check_budget` says the estimate in one line on stderr and raises a one-line
:class:`~fixres_dist.errors.FixresError` for a run over its budget.

A fake process group lives in its process until destroyed, and the launcher must keep none: the
preflight (:func:`check_budget`) runs every estimate that needs one in a short-lived child process
(``python -m fixres_dist.training.memory_budget``, :func:`main`: one JSON request on stdin, the
:class:`Check` as one JSON line on stdout; internal, not a command: ``--help`` says so, and a terminal or
a request that is not JSON on stdin is refused in one line).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs

from fixres_dist import arguments
from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout
from fixres_dist.errors import FixresError, first_line, say
from fixres_dist.training.memory_estimate import (
    GIB,
    METHOD,
    MemoryEstimate,
    estimate,
    fake_process_group,
    gib,
    needs_process_group,
    setting_line,
    setting_words,
)

MODULE = "fixres_dist.training.memory_budget"  # the child process: python -m MODULE
CHILD_TIMEOUT_S = 600  # the child process of the preflight's estimates
SPLITS = (2, 4, 8)  # the tensor groups and pipeline stages (ranks) a refusal tries


@attrs.frozen
class Fit:
    """The cheapest change of a run that fits a memory budget: ``change`` (its flags, e.g.
    ``--activation-checkpointing``) and ``estimate`` (what it needs); or ``change`` None and in
    ``estimate`` the least that was found, ``at`` that setting in words (``"batch 2 with full shard
    over 4 ranks and activation checkpointing"``), or None when nothing could be estimated."""

    change: str | None
    estimate: MemoryEstimate | None
    at: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> "Fit":
        return cls(data["change"], MemoryEstimate(**data["estimate"]) if data["estimate"] else None, data["at"])


@attrs.frozen
class Check:
    """What the preflight found: ``first``, the estimate of the run as asked, and when that exceeds the
    budget, ``fit`` (:func:`find_fit`)."""

    first: MemoryEstimate
    fit: Fit | None = None

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Check":
        return cls(MemoryEstimate(**data["first"]), Fit.from_dict(data["fit"]) if data["fit"] else None)


def alternatives(config: TrainerConfig) -> list[tuple[str, TrainerConfig]]:
    """The changes that lower the memory without changing the training, cheapest first, with their
    flags: activation checkpointing, full sharding (more than one rank), both; then the model split
    over N = 2, 4, 8 ranks (:func:`split_alternatives`). Those the configuration refuses (e.g. a
    torchvision ViT sharded, a split with sharding) are left out."""
    changes = []
    if not config.activation_checkpointing:
        changes.append(("--activation-checkpointing", {"activation_checkpointing": True}))
    if config.num_tasks > 1 and config.sharding != "full":
        changes.append(("--sharding full", {"sharding": "full", "shard_group_size": None}))
        if not config.activation_checkpointing:
            changes.append(("--sharding full --activation-checkpointing",
                            {"sharding": "full", "shard_group_size": None, "activation_checkpointing": True}))
    changes += split_alternatives(config)
    found = []
    for flags, fields in changes:
        with contextlib.suppress(FixresError):
            found.append((flags, attrs.evolve(config, **fields)))
    return found


def split_alternatives(config: TrainerConfig) -> list[tuple[str, dict]]:
    """``(flags, fields)`` of the model split over N = 2, 4, 8 ranks that divide ``--num-tasks``, by
    tensor groups then by pipeline stages, for a run not split yet: each with ``--batch`` times N, so
    that the global batch (and the training) stays the same on N times fewer data-parallel ranks."""
    if layout.of(config).split:
        return []
    found = []
    for axis in ("tensor", "pipeline"):
        for ranks in SPLITS:
            if ranks <= config.num_tasks and config.num_tasks % ranks == 0:
                split = layout.Layout.of_world(config.num_tasks, **{axis: ranks})
                flag, fields = ((f"--tensor-parallel {split.tensor}", {"tensor_parallel": split.tensor})
                                if split.tensor_enabled else
                                (f"--pipeline-stages {split.pipeline}", {"pipeline_stages": split.pipeline}))
                found.append((f"{flag} --batch {config.batch * ranks}",
                              {**fields, "batch": config.batch * ranks, "sharding": "ddp", "shard_group_size": None}))
    return found


def find_fit(config: TrainerConfig, num_classes: int, budget: int, first: MemoryEstimate) -> Fit:
    """The cheapest change of ``config`` (whose estimate ``first`` exceeds ``budget`` bytes) that fits:
    the :func:`alternatives` in order, then halving the batch with the one that needed the least
    memory (a batch whose estimate, predicted from the activations' share, is still too large is
    not estimated; batch 2 always is). In this process: a sharded alternative on more than one rank
    needs its fake process group (:func:`fake_process_group`)."""
    least, least_flags, least_config = first, "", config
    for flags, candidate in alternatives(config):
        found = estimate(candidate, num_classes)
        if found.fits(budget):
            return Fit(flags, found)
        if found.known and (not least.known or found.peak < least.peak):
            least, least_flags, least_config = found, flags, candidate
    if not least.known:
        return Fit(None, None)
    fixed = least.parameters + least.gradients + least.optimizer
    per_image = least.activations / least_config.batch
    batch = least_config.batch // 2
    while batch >= 2:
        if batch == 2 or fixed + per_image * batch <= budget:
            with contextlib.suppress(FixresError):  # a batch the layout refuses (a pipeline's micro-batches)
                smaller = attrs.evolve(least_config, batch=batch)
                least = estimate(smaller, num_classes)
                if least.fits(budget):
                    return Fit(" ".join(f"--batch {batch} {re.sub('--batch [0-9]+', '', least_flags)}".split()), least)
                least_config = smaller
        batch //= 2
    return Fit(None, least, f"batch {least_config.batch} with {setting_words(least_config)}")


def checked(config: TrainerConfig, num_classes: int, budget: int) -> Check:
    """Estimate ``config``; when it exceeds ``budget`` bytes, :func:`find_fit`. In this process (see there)."""
    first = estimate(config, num_classes)
    if not first.known or first.fits(budget):
        return Check(first)
    return Check(first, find_fit(config, num_classes, budget, first))


def check_run(config: TrainerConfig, num_classes: int, budget: int) -> Check:
    """:func:`checked`, leaving this process without a process group: on one rank here; on more, where
    the run or the search for a change needs a fake process group, in a short-lived child process
    (a DDP run that fits is estimated here). A child that fails gives an estimate without a peak,
    with the reason."""
    if config.num_tasks == 1:
        return checked(config, num_classes, budget)
    if not needs_process_group(config):
        first = estimate(config, num_classes)
        if not first.known or first.fits(budget):
            return Check(first)
    answer = _in_child({"config": config.to_dict(), "num_classes": num_classes, "budget": budget})
    if "error" in answer:
        return Check(MemoryEstimate(setting_line(config), None, reason=answer["error"]))
    return Check.from_dict(answer)


def budget_bytes(config: TrainerConfig) -> tuple[int, str] | None:
    """The memory a rank may use (bytes) and its source in words: ``--memory-budget`` (GiB), else on
    CUDA the GPU's memory (``torch.cuda.get_device_properties(device).total_memory``), else None (a
    CPU run without ``--memory-budget`` is not checked)."""
    if config.memory_budget is not None:
        return int(config.memory_budget * GIB), f"the budget of {config.memory_budget:g} GiB per rank (--memory-budget)"
    if config.device != "cuda":
        return None
    import torch

    from fixres_dist.distributed import placement

    device = placement.cuda_device(config.local_rank)
    properties = torch.cuda.get_device_properties(device)
    return properties.total_memory, f"the {gib(properties.total_memory)} of {device} ({properties.name})"


def check_budget(config: TrainerConfig, num_classes: int) -> MemoryEstimate | None:
    """The preflight's check: estimate a training run of ``config`` against :func:`budget_bytes` (None,
    and nothing estimated, for ``--eval-only`` or a CPU run without ``--memory-budget``). Says the
    estimate in one line on stderr; raises a one-line :class:`FixresError` when it exceeds the budget,
    naming the cheapest change that fits (:func:`find_fit`) or saying that none does. Without an
    estimate (the fake route failed), says why and lets the run start."""
    budget = None if config.eval_only else budget_bytes(config)
    if budget is None:
        return None
    limit, source = budget
    found = check_run(config, num_classes, limit)
    first, fit = found.first, found.fit
    if not first.known:
        say(f"fixres_dist: warning: {first.describe()}; starting without checking {source}")
        return first
    if fit is None:
        say(f"fixres_dist: memory: an estimated {first.describe()}, within {source} ({METHOD})")
        return first
    needs = f"{config.architecture} needs an estimated {gib(first.peak)} per rank ({first.breakdown()}) " \
            f"at batch {config.batch} with {setting_words(config)}"
    if fit.change is not None:
        raise FixresError(f"{needs}, more than {source}; the cheapest change that fits: {fit.change} "
                          f"({gib(fit.estimate.peak)} per rank; {METHOD})")
    if fit.estimate is None or not fit.estimate.known:
        raise FixresError(f"{needs}, more than {source}; no other setting could be estimated")
    raise FixresError(f"no change of batch, sharding, split or checkpointing meets {source}: {needs}, and still "
                      f"{gib(fit.estimate.peak)} even at {fit.at} ({METHOD}); give it more memory, more ranks to "
                      "shard over or a smaller --input-size")


def _in_child(request: dict) -> dict:
    """``request`` answered by ``python -m fixres_dist.training.memory_budget`` (JSON in, JSON out), or
    ``{"error": line}``. The child sees no GPU: everything it runs is fake."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", MODULE], input=json.dumps(request), env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the estimate took more than {CHILD_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the estimating process failed (exit status {done.returncode}): {tail}"[:300]}
    return json.loads(lines[-1])


HELP = ("Internal: the child process of the preflight's memory check (fixres_dist.training.memory_budget."
        "check_budget), not a command to run by hand. It reads one JSON request on stdin (a training run's "
        "configuration, its number of classes and a memory budget in bytes), estimates the run's peak memory per "
        "rank on a fake process group of its ranks (and, over the budget, the cheapest change that fits), and "
        "writes the answer as one JSON line on stdout. To size a layout by hand: python -m "
        "fixres_dist.training.dry_run; to check a run against a budget: the scripts' --memory-budget.")


def serve(config: TrainerConfig, num_classes: int, budget: int) -> None:
    """The child process of :func:`check_run`: ``config``, its number of classes and a budget in bytes,
    answered with the :class:`Check` as one JSON line on stdout."""
    with fake_process_group(config.num_tasks):
        found = checked(config, num_classes, budget)
    sys.stdout.write(json.dumps(found.to_dict()) + "\n")


def read_request() -> dict:
    """The request on stdin (:func:`serve`); FixresError (one line) for a terminal or what is not one."""
    if sys.stdin is None or sys.stdin.isatty():
        raise FixresError("this is the preflight's internal child process: it reads a JSON request on "
                          "stdin, not a terminal (see --help)")
    text = sys.stdin.read()
    try:
        request = json.loads(text)
    except ValueError as exc:
        raise FixresError(f"it reads a JSON request on stdin (see --help); that is not JSON: {exc}") from None
    if not isinstance(request, dict) or not {"config", "num_classes", "budget"} <= request.keys():
        raise FixresError("it reads a JSON object with config, num_classes and budget on stdin (see --help)")
    return request


def main(argv: list[str] | None = None) -> int:
    """``python -m fixres_dist.training.memory_budget``: :func:`serve` the request on stdin; exit status 0,
    2 with one line on stderr for a request it cannot read."""
    arguments.OneLineParser(prog=f"python -m {MODULE}", description=HELP,
                            formatter_class=arguments.Formatter).parse_args(argv)
    try:
        request = read_request()
        config = TrainerConfig.from_dict(request["config"])
    except FixresError as exc:
        say(f"fixres_dist: memory_budget: {first_line(exc)}")
        return 2
    except (KeyError, TypeError, ValueError) as exc:
        say(f"fixres_dist: memory_budget: the request's config is not a run's configuration: "
            f"{type(exc).__name__}: {first_line(exc)}"[:400])
        return 2
    serve(config, request["num_classes"], request["budget"])
    return 0

if __name__ == "__main__":
    sys.exit(main())
