"""What a SLURM job asks for: :class:`SlurmRequest`, validated on creation (one-line FixresError)."""
from __future__ import annotations

import math

import attrs

from fixres_dist.errors import FixresError

TIME_LIMIT_CHECK_S = 30   # slurmctld checks time limits (and sends the warning signal) every 30 s
MIN_RUN_BEFORE_WARNING_S = 30


def _flag(attribute) -> str:
    return "--" + attribute.name.replace("_", "-")


def _at_least(minimum: int):
    def check(instance, attribute, value):
        if value is not None and value < minimum:
            raise FixresError(f"{_flag(attribute)} must be >= {minimum}, got {value}")
    return check


def _positive_number(instance, attribute, value):
    if value is not None and not value > 0:
        raise FixresError(f"{_flag(attribute)} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class SlurmRequest:
    """Nodes, tasks, CPUs, GPUs, memory, partition and time of one job (one task per GPU).

    ``gpus_per_node=0``: CPU tasks, ``tasks_per_node`` of them (default 1). ``None`` fields are
    filled in by :func:`fixres_dist.cluster.inventory.check_request` from the cluster.
    """

    nodes: int = attrs.field(default=1, validator=_at_least(1))
    gpus_per_node: int = attrs.field(default=0, validator=_at_least(0))
    tasks_per_node: int | None = attrs.field(default=None, validator=_at_least(1))
    cpus_per_task: int | None = attrs.field(default=None, validator=_at_least(1))
    mem_gb: float | None = attrs.field(default=None, validator=_positive_number)
    partition: str | None = None
    timeout_min: int = attrs.field(default=60, validator=_at_least(1))
    signal_delay_s: int = attrs.field(default=120, validator=_at_least(0))
    job_name: str | None = None
    max_requeues: int = attrs.field(default=3, validator=_at_least(0))
    array_parallelism: int = attrs.field(default=32, validator=_at_least(1))

    def __attrs_post_init__(self):
        if self.gpus_per_node and self.tasks_per_node not in (None, self.gpus_per_node):
            raise FixresError(f"one task per GPU: --tasks-per-node {self.tasks_per_node} differs from "
                              f"--gpus-per-node {self.gpus_per_node} (drop --tasks-per-node)")
        needed = self.signal_delay_s + TIME_LIMIT_CHECK_S + MIN_RUN_BEFORE_WARNING_S
        if self.timeout_min * 60 < needed:
            raise FixresError(f"--timeout-min {self.timeout_min} is too short for --signal-delay-s "
                              f"{self.signal_delay_s}: SLURM may send the warning signal "
                              f"{self.signal_delay_s + TIME_LIMIT_CHECK_S} s before the limit; use --timeout-min >= "
                              f"{math.ceil(needed / 60)} or a smaller --signal-delay-s")

    @property
    def tasks(self) -> int:
        """Tasks (ranks) per node."""
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def num_tasks(self) -> int:
        """Tasks (ranks) of the whole job."""
        return self.nodes * self.tasks
