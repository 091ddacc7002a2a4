"""Running fixres_dist on a SLURM cluster, one concern per module.

* :mod:`.request`: :class:`SlurmRequest`, what a job asks for (validated on creation);
* :mod:`.inventory`: what the cluster has (``sinfo``) and :func:`check_request`;
* :mod:`.task`: inside the job, the one protocol of submitit jobs and ``slurm/job.sbatch``
  (place, meet, stop, requeue) and :class:`SlurmTask`, what submitit runs;
* :mod:`.submission`: :func:`submit` a :class:`~fixres_dist.TrainerConfig` with a request through
  submitit (:func:`submit_array` for job arrays);
* :mod:`.monitor`: job states (submitit's watcher) and each task's outcome (``Job.exception()``);
* :mod:`.sweep`: a FixRes resolution sweep as one job array, and its table;
* :mod:`.template`: a job's :class:`~fixres_dist.TrainerConfig` template from ``main_*.py`` options;
* :mod:`.cli`: the command lines of ``slurm/submit.py`` and ``slurm/sweep.py``.
"""
from fixres_dist.startup import quiet_native_logs

quiet_native_logs()  # a SLURM task (sbatch or submitit) imports this package before torch

from fixres_dist.cluster.inventory import check_request, read_partitions
from fixres_dist.cluster.monitor import task_outcomes, watch
from fixres_dist.cluster.request import SlurmRequest
from fixres_dist.cluster.submission import submit, submit_array
from fixres_dist.cluster.task import SlurmTask, TaskFailed

__all__ = ["SlurmRequest", "SlurmTask", "TaskFailed", "check_request", "read_partitions", "submit",
           "submit_array", "task_outcomes", "watch"]
