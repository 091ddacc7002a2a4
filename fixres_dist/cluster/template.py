"""A SLURM job's :class:`~fixres_dist.TrainerConfig` template from a main script's options.

Shared by the submitters (:mod:`.cli`: ``slurm/submit.py``, ``slurm/sweep.py``) and by the tasks of
a plain sbatch job (:func:`fixres_dist.cluster.task.main`): the options are parsed by the main
script's own parser, the ranks, job id and rendezvous are left to the tasks (:mod:`.task`).
"""
from __future__ import annotations

from pathlib import Path

from fixres_dist.config import TrainerConfig
from fixres_dist.entry.cli import RANK_FLAGS, build_parser, config_fields
from fixres_dist.errors import FixresError

PATH_FIELDS = ("data_path", "weight_path", "shared_folder_path", "resume")


def config_from_argv(mode: str, argv: list[str], num_tasks: int, device: str | None = None,
                     overrides: dict | None = None) -> TrainerConfig:
    """A job's template from ``main_*.py`` options (ranks left to the tasks; no input checks here).

    ``device``: where the job runs when ``--device`` is not given (the submitter knows whether it
    asked for GPUs; inside a job, None lets the node decide). Everything that follows from the
    device (backend, mixed precision, memory format) is the configuration's own default.
    """
    args = build_parser(mode).parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in RANK_FLAGS if getattr(args, name) is not None]
    if given:
        raise FixresError(f"{', '.join(given)}: SLURM sets the ranks, the job id and the rendezvous; drop these flags")
    if args.device is None and device is not None:
        args.device = device
    fields = {**config_fields(args, mode), **(overrides or {})}
    if args.preempt_signal is None:
        import submitit

        fields["preempt_signal"] = "SIG" + submitit.JobEnvironment.USR_SIG  # what SLURM sends the job
    for name in PATH_FIELDS:
        if fields.get(name):
            fields[name] = str(Path(fields[name]).expanduser().absolute())
    fields.setdefault("shared_folder_path", str(Path("runs").absolute()))
    return TrainerConfig(num_tasks=num_tasks, global_rank=0, local_rank=0, job_id="submit", dist_url="env://",
                         **fields)
