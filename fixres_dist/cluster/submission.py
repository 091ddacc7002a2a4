"""Submitting through submitit: :func:`submit` one job, :func:`submit_array` a job array.

Both take :class:`~fixres_dist.TrainerConfig` templates (ranks, job id and rendezvous are filled
in per task, see :mod:`fixres_dist.cluster.task`) and a
:class:`~fixres_dist.cluster.request.SlurmRequest`, check both against the cluster and the inputs,
and return submitit jobs. Each job's folder is ``<shared>/<job id>/``, its logs in ``logs/`` there.
"""
from __future__ import annotations

from pathlib import Path

import attrs

from fixres_dist.cluster.inventory import check_request, check_shared_folder, read_partitions
from fixres_dist.cluster.request import SlurmRequest
from fixres_dist.cluster.task import SlurmTask
from fixres_dist.config import TrainerConfig
from fixres_dist.errors import FixresError
from fixres_dist.training.inputs import preflight

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def job_folder(config: TrainerConfig, job_id: str) -> Path:
    return Path(config.shared_folder_path) / job_id


def log_files(config: TrainerConfig, job_id: str, rank: int | str = "<rank>") -> tuple[Path, Path]:
    """``(stdout, stderr)`` of one task of a submitit job."""
    logs = job_folder(config, job_id) / "logs"
    return logs / f"{job_id}_{rank}_log.out", logs / f"{job_id}_{rank}_log.err"


def make_executor(request: SlurmRequest, shared: Path, mode: str):
    """A submitit executor for ``request``; logs go to ``<shared>/<job id>/logs``."""
    import submitit

    executor = submitit.AutoExecutor(folder=shared / "%j" / "logs", cluster="slurm")
    params = dict(nodes=request.nodes, tasks_per_node=request.tasks, cpus_per_task=request.cpus_per_task,
                  timeout_min=request.timeout_min, slurm_partition=request.partition,
                  slurm_signal_delay_s=request.signal_delay_s, name=request.job_name or f"fixres-{mode}",
                  slurm_array_parallelism=request.array_parallelism,
                  # one failing task ends the job at once instead of its peers waiting for it
                  slurm_srun_args=["--kill-on-bad-exit=1"],
                  slurm_additional_parameters={"requeue": True},
                  # the job imports this package from where the submitter found it (a checkout works)
                  slurm_setup=[f"export PYTHONPATH={PACKAGE_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"])
    if request.gpus_per_node:
        params["gpus_per_node"] = request.gpus_per_node
    if request.mem_gb is not None:
        params["mem_gb"] = request.mem_gb
    executor.update_parameters(**params)
    return executor


def _checked(configs: list[TrainerConfig], request: SlurmRequest) -> tuple[list[TrainerConfig], SlurmRequest]:
    """The request completed from ``sinfo``, the templates sized to it and their inputs checked."""
    request = check_request(request, read_partitions())
    # Before the preflights: they write the data's file index into it (creating it if missing).
    check_shared_folder(Path(configs[0].shared_folder_path), request.nodes)
    import submitit

    usr = "SIG" + submitit.JobEnvironment.USR_SIG  # what SLURM sends (--signal); SUBMITIT_PREEMPT_SIGNAL changes it
    placed = []
    for config in configs:
        if config.device == "cuda" and not request.gpus_per_node:
            raise FixresError("--device cuda needs --gpus-per-node > 0")
        if config.preempt_signal != usr:
            raise FixresError(f"--preempt-signal {config.preempt_signal}: SLURM sends the jobs {usr} "
                              "(set SUBMITIT_PREEMPT_SIGNAL to change it); drop the flag")
        config = attrs.evolve(config, num_tasks=request.num_tasks, global_rank=0, local_rank=0)
        preflight(config)
        placed.append(config)
    return placed, request


def submit(config: TrainerConfig, request: SlurmRequest):
    """Check everything, submit one job of ``request.num_tasks`` tasks running ``config``.

    Returns ``(job, config, request)``: the submitit job, the template as submitted and the request
    completed from the cluster. Raises :class:`FixresError` (one line) before submitting anything.
    """
    (config,), request = _checked([config], request)
    executor = make_executor(request, Path(config.shared_folder_path), config.mode)
    job = executor.submit(SlurmTask(config, request.max_requeues))
    return job, config, request


def submit_array(configs: list[TrainerConfig], request: SlurmRequest):
    """Submit one job per config as one SLURM job array; returns ``(jobs, configs, request)``."""
    if not configs:
        raise FixresError("nothing to submit")
    configs, request = _checked(configs, request)
    executor = make_executor(request, Path(configs[0].shared_folder_path), configs[0].mode)
    with executor.batch():
        jobs = [executor.submit(SlurmTask(config, request.max_requeues)) for config in configs]
    return jobs, configs, request
