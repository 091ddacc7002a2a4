"""Where a process sits in a job: its ranks, its node's share of the CPU, its GPU.

Rank resolution follows one precedence, highest first (docs/launching.md, "Where a process learns
its rank"):

1. explicit flags ``--global-rank/--local-rank`` with ``--num-tasks``;
2. torchrun's ``RANK / LOCAL_RANK / WORLD_SIZE`` (and ``MASTER_ADDR / MASTER_PORT``);
3. SLURM's ``SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS / SLURM_JOB_ID`` (what submitit's
   ``JobEnvironment`` reports too);
4. none of these and ``--num-tasks N > 1``: spawn N local ranks from this one command;
5. otherwise one process (world size 1, no process group).

A value given by two sources that disagree (``--num-tasks 4`` with ``WORLD_SIZE=2``, ``WORLD_SIZE=2``
with ``SLURM_NTASKS=1``) is an error naming both, as is a partial set of one launcher's variables
(``RANK`` and ``WORLD_SIZE`` without ``LOCAL_RANK``). torchrun started inside a SLURM task (it sets
``TORCHELASTIC_RUN_ID``) takes precedence over that task's SLURM ranks; a shell inside an allocation
that srun did not start (no ``SLURM_PROCID``) is not a SLURM task.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import attrs

from fixres_dist.errors import FixresError

if TYPE_CHECKING:
    import torch


@attrs.frozen
class Placement:
    """Result of rank resolution.

    ``source`` is one of ``flags, torchrun, slurm, spawn, single``; ``job_id`` and ``dist_url`` are
    ``None`` where the source does not fix them (the launcher fills in defaults);
    ``local_world_size`` is the number of ranks on this node (used to share CPU threads).
    """

    source: str
    num_tasks: int
    global_rank: int
    local_rank: int
    local_world_size: int
    job_id: str | None
    dist_url: str | None


def _env_int(environ, name: str) -> int:
    """A rank variable's value: an integer >= 0 (>= 1 for a count); FixresError naming the variable."""
    try:
        value = int(environ[name])
    except ValueError:
        raise FixresError(f"environment variable {name}={environ[name]!r} is not an integer") from None
    least = 1 if name in COUNT_VARIABLES else 0
    if value < least:
        raise FixresError(f"environment variable {name}={value} must be >= {least}")
    return value


COUNT_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS")


def _env_rank(environ, rank_name: str, world_name: str) -> int:
    """``rank_name``'s value, checked against the world size in ``world_name``."""
    rank, world = _env_int(environ, rank_name), _env_int(environ, world_name)
    if rank >= world:
        raise FixresError(f"environment variable {rank_name}={rank} must be < {world_name}={world}")
    return rank


def _slurm_tasks_on_node(environ, ntasks: int) -> int:
    value = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    head = value.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() else ntasks


def _check_agree(flag_name: str, flag_value, env_name: str, env_value) -> None:
    if flag_value is not None and flag_value != env_value:
        raise FixresError(f"{flag_name} {flag_value} (command line) conflicts with {env_name}={env_value} "
                          "(environment); drop the flag or fix the environment")


TORCHRUN_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _torchrun_variables(environ) -> bool:
    """Whether torchrun's rank variables are set; FixresError for a partial set or no store address."""
    present = [k for k in TORCHRUN_RANK_VARIABLES if k in environ]
    if present and len(present) < len(TORCHRUN_RANK_VARIABLES):
        missing = [k for k in TORCHRUN_RANK_VARIABLES if k not in environ]
        raise FixresError(f"partial torchrun variables: {', '.join(f'{k}={environ[k]}' for k in present)} set but "
                          f"{', '.join(missing)} not; start with torchrun, or unset {', '.join(present)}")
    return bool(present)


def _slurm_variables(environ) -> bool:
    """Whether this process is a SLURM task (``SLURM_PROCID`` is set by srun for each task).

    A shell inside an allocation (salloc, the batch script itself) has ``SLURM_JOB_ID`` and maybe
    ``SLURM_NTASKS`` but no ``SLURM_PROCID``: it is not a task, and its SLURM variables are ignored.
    """
    if "SLURM_PROCID" not in environ:
        return False
    if "SLURM_NTASKS" not in environ:
        raise FixresError(f"SLURM_PROCID={environ['SLURM_PROCID']} is set but SLURM_NTASKS is not; start the "
                          "tasks with srun (or sbatch --ntasks N), or unset SLURM_PROCID")
    return True


def _check_torchrun_against_slurm(environ) -> None:
    """torchrun's and SLURM's variables in one process must agree, unless torchrun itself runs inside
    a SLURM task (it sets ``TORCHELASTIC_RUN_ID``; then its ranks are the job's and SLURM's are the nodes')."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return
    for torchrun_name, slurm_name in (("WORLD_SIZE", "SLURM_NTASKS"), ("RANK", "SLURM_PROCID"),
                                      ("LOCAL_RANK", "SLURM_LOCALID")):
        if slurm_name in environ and _env_int(environ, torchrun_name) != _env_int(environ, slurm_name):
            raise FixresError(f"{torchrun_name}={environ[torchrun_name]} (torchrun variables) conflicts with "
                              f"{slurm_name}={environ[slurm_name]} (SLURM); unset the stale ones")


def _slurm_job_id(environ) -> str | None:
    """The SLURM task's job id (it survives a requeue): ``<array job id>_<index>`` for an array task."""
    if "SLURM_ARRAY_JOB_ID" in environ and "SLURM_ARRAY_TASK_ID" in environ:
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def resolve_placement(num_tasks: int | None = None, global_rank: int | None = None,
                      local_rank: int | None = None, job_id: str | None = None,
                      dist_url: str | None = None, environ=None) -> Placement:
    """Decide this process's ranks from flags and environment, with the module's precedence.

    Arguments are the command-line values (``None`` when not given); ``environ`` defaults to
    ``os.environ``. ``job_id`` of the result: the flag, else SLURM's job id (it survives a requeue),
    else None (the launcher derives one from the configuration). Raises :class:`FixresError` for
    incomplete flags, a partial set of one launcher's variables, or sources that disagree; the
    message names both sources.
    """
    environ = os.environ if environ is None else environ
    torchrun = _torchrun_variables(environ)
    slurm = _slurm_variables(environ)
    if num_tasks is not None and num_tasks < 1:
        raise FixresError(f"--num-tasks must be >= 1, got {num_tasks}")
    if torchrun and slurm:
        _check_torchrun_against_slurm(environ)
    if torchrun and dist_url is None and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
        raise FixresError("torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE) without MASTER_ADDR and "
                          "MASTER_PORT: start with torchrun, or give --dist-url")
    slurm_job = _slurm_job_id(environ) if slurm else None

    if global_rank is not None or local_rank is not None:
        if global_rank is None:
            raise FixresError("--local-rank needs --global-rank (and --num-tasks)")
        if num_tasks is None:
            raise FixresError("--global-rank needs --num-tasks")
        launcher = ("WORLD_SIZE", "RANK", "LOCAL_RANK") if torchrun else \
            ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID") if slurm else ()
        for flag_name, flag_value, env_name in zip(("--num-tasks", "--global-rank", "--local-rank"),
                                                   (num_tasks, global_rank, local_rank), launcher):
            if env_name in environ:
                _check_agree(flag_name, flag_value, env_name, _env_int(environ, env_name))
        local = global_rank if local_rank is None else local_rank
        return Placement("flags", num_tasks, global_rank, local, num_tasks, job_id or slurm_job, dist_url)

    if torchrun:
        world = _env_int(environ, "WORLD_SIZE")
        _check_agree("--num-tasks", num_tasks, "WORLD_SIZE", world)
        local_world = {"LOCAL_WORLD_SIZE": str(world), **environ}
        return Placement("torchrun", world, _env_rank(environ, "RANK", "WORLD_SIZE"),
                         _env_rank(local_world, "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                         _env_int(local_world, "LOCAL_WORLD_SIZE"), job_id or slurm_job, dist_url or "env://")

    if slurm:
        world = _env_int(environ, "SLURM_NTASKS")
        _check_agree("--num-tasks", num_tasks, "SLURM_NTASKS", world)
        on_node = _slurm_tasks_on_node(environ, world)
        local = _env_int({"SLURM_LOCALID": "0", **environ}, "SLURM_LOCALID")
        if local >= on_node:
            raise FixresError(f"environment variable SLURM_LOCALID={local} must be < the tasks on this node "
                              f"({on_node}, SLURM_NTASKS_PER_NODE or SLURM_NTASKS)")
        return Placement("slurm", world, _env_rank(environ, "SLURM_PROCID", "SLURM_NTASKS"), local, on_node,
                         job_id or slurm_job, dist_url)

    if num_tasks is not None and num_tasks > 1:
        return Placement("spawn", num_tasks, 0, 0, num_tasks, job_id, dist_url)
    return Placement("single", 1, 0, 0, 1, job_id, dist_url)


def cuda_device(local_rank: int, environ=None) -> torch.device:
    """The GPU of the rank with ``local_rank`` on its node.

    ``cuda:<local_rank>`` among the visible devices; but when a launcher narrowed
    ``CUDA_VISIBLE_DEVICES`` to a single GPU for this task (SLURM ``--gpus-per-task 1``,
    ``--gpu-bind``), that GPU, ``cuda:0``, whatever the local rank. Raises :class:`FixresError` when
    no GPU is visible or the local rank has none.
    """
    import torch  # here, not at the top: rank resolution runs before torch is needed

    environ = os.environ if environ is None else environ
    count = torch.cuda.device_count()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if count == 0:
        raise FixresError(f"--device cuda but no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={visible!r}); "
                          "use --device cpu")
    narrowed = visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1
    if narrowed and count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise FixresError(f"local rank {local_rank} has no GPU: {count} visible (CUDA_VISIBLE_DEVICES={visible!r}); "
                          "start at most one rank per GPU on each node")
    return torch.device("cuda", local_rank)


def threads_per_rank(num_tasks: int, environ=None) -> int:
    """CPU threads for one rank: this process's usable cores shared by the ranks on this node.

    The ranks on a node are ``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NTASKS_PER_NODE`` (SLURM) or
    ``num_tasks``. Without this, N ranks x all cores threads oversubscribe the CPU many times over.
    """
    environ = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0))
    local = int(environ.get("LOCAL_WORLD_SIZE") or 0) or \
        (_slurm_tasks_on_node(environ, num_tasks) if "SLURM_NTASKS" in environ else num_tasks)
    if "SLURM_NTASKS" in environ and "SLURM_CPUS_PER_TASK" in environ:
        return max(1, int(environ["SLURM_CPUS_PER_TASK"]))
    return max(1, cores // max(1, min(local, cores)))


# What torchrun's elastic agent does with a node that joins a running job while the agents share their
# rendezvous store with the workers (torch's default): the agents' next rendezvous waits for an address
# the agents already running never publish again, and after 60 s every agent fails: the job stops
# (its checkpoint kept) instead of growing (measured with torch 2.14).
ELASTIC_SHARED_STORE = ("torchrun --max-restarts with its rendezvous store shared with the workers (the default): "
                        "when a node joins later, every agent fails 60 s after and the job stops (its checkpoint "
                        "kept) instead of growing; start every torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                        "(docs/cluster.md)")


def elastic_shared_store(environ=None) -> bool:
    """Whether this torchrun worker's agent may restart it (``--max-restarts`` > 0) and shares its store
    with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``): :data:`ELASTIC_SHARED_STORE`."""
    environ = os.environ if environ is None else environ
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts.isdigit() and int(restarts) > 0
