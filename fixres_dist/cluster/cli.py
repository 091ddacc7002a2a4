"""The command lines ``slurm/submit.py`` and ``slurm/sweep.py``: options, configuration, reports.

``[cluster options] -- [main_*.py options]``: the cluster options make a
:class:`~fixres_dist.cluster.request.SlurmRequest`, the main script's options (parsed by its own
parser) a :class:`~fixres_dist.TrainerConfig` template (:mod:`.template`); :mod:`.submission`
submits them and :mod:`.monitor` follows the job with ``--wait``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fixres_dist.cluster.monitor import POLL_S, first_failure, task_outcomes, watch
from fixres_dist.cluster.request import SlurmRequest
from fixres_dist.cluster.submission import job_folder, log_files, submit, submit_array
from fixres_dist.cluster.sweep import gather_sweep, sweep_configs, sweep_table
from fixres_dist.cluster.template import config_from_argv
from fixres_dist.config import TrainerConfig
from fixres_dist.entry.cli import build_parser
from fixres_dist.errors import FixresError


def request_parser(description: str, modes: list[str] | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                usage="%(prog)s " + ("{" + ",".join(modes) + "} " if modes else "")
                                + "[cluster options] -- [main_*.py options]")
    if modes:
        p.add_argument("mode", choices=modes, help="main_scratch.py or main_finetune.py")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="one task per GPU; 0: CPU tasks (default)")
    p.add_argument("--tasks-per-node", type=int, help="CPU tasks per node (with --gpus-per-node 0; default 1)")
    p.add_argument("--cpus-per-task", type=int, help="default: the smallest node's CPUs / tasks per node")
    p.add_argument("--mem-gb", type=float, help="memory per node (default: the partition's default)")
    p.add_argument("--partition", help="default: the cluster's default partition")
    p.add_argument("--timeout-min", type=int, default=60, help="time limit in minutes (default 60)")
    p.add_argument("--signal-delay-s", type=int, default=120,
                   help="SLURM sends the warning signal this many seconds before the limit (default 120)")
    p.add_argument("--max-requeues", type=int, default=3, help="requeues on the warning signal (default 3)")
    p.add_argument("--job-name", help="default: fixres-<mode>")
    p.add_argument("--wait", action="store_true", help="wait for the job and report each rank's result")
    p.add_argument("--poll-s", type=float, default=POLL_S,
                   help=f"seconds between two state queries (sacct) while waiting (default {POLL_S:g})")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def request_from_args(args) -> SlurmRequest:
    """The request the options ask for (raises FixresError with one line for impossible values)."""
    return SlurmRequest(nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
                        cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb, partition=args.partition,
                        timeout_min=args.timeout_min, signal_delay_s=args.signal_delay_s,
                        job_name=args.job_name, max_requeues=args.max_requeues,
                        array_parallelism=getattr(args, "parallel", None) or 32)


def _say(out):
    def say(event):
        seconds, jid, state = event
        print(f"  +{seconds:6.1f} s  job {jid}: {state}", file=out, flush=True)
    return say


def report(job, config: TrainerConfig, started: float, poll_s: float = POLL_S, out=None) -> int:
    """Wait for ``job``, print its state changes and per-rank results; returns an exit status."""
    out = out or sys.stdout
    watched = watch([job], _say(out), started, poll_s=poll_s)
    outcomes = task_outcomes(job)
    failed = first_failure(outcomes)
    elapsed = time.time() - started
    if failed:
        # the tasks' results can be there before accounting says how the job ended (sacct lags)
        state = watch([job.job_id], started=time.time(), timeout=10, poll_s=1).states.get(job.job_id, "FAILED")
        rank, cause = failed
        err = log_files(config, job.job_id, rank)[1]
        print(f"fixres_dist: job {job.job_id} {state} after {elapsed:.1f} s: rank {rank}: {cause} (log: {err})",
              file=sys.stderr, flush=True)
        return 1
    running = watched.running_after
    print(f"job {job.job_id} COMPLETED in {elapsed:.1f} s"
          + (f" (running {running:.1f} s after submission)" if running is not None else ""), file=out)
    print("| rank | host | restarts | resolution | top-1 % | top-5 % | images |", file=out)
    print("|------|------|----------|------------|---------|---------|--------|", file=out)
    for rank, result, _ in sorted(outcomes, key=lambda o: o[0]):
        print(f"| {rank:4d} | {result.get('host', '?')} | {result.get('restart', 0):8d} | "
              f"{result['resolution']:7d} px | {result['top1']:7.2f} | {result['top5']:7.2f} | "
              f"{result['images']:6d} |", file=out)
    return 0


def submit_main(argv: list[str] | None = None) -> int:
    """``python slurm/submit.py {scratch,finetune} [cluster options] -- [main_*.py options]``."""
    own, main_argv = split_argv(sys.argv[1:] if argv is None else argv)
    args = request_parser("Submit main_scratch.py or main_finetune.py to SLURM through submitit.",
                          ["scratch", "finetune"]).parse_args(own)
    started = time.time()
    try:
        request = request_from_args(args)
        config = config_from_argv(args.mode, main_argv, request.num_tasks,
                                  device="cuda" if request.gpus_per_node else "cpu")
        job, config, request = submit(config, request)
    except FixresError as exc:
        print(f"fixres_dist: submit: {exc}", file=sys.stderr, flush=True)
        return 1
    out, _ = log_files(config, job.job_id)
    print(f"submitted SLURM job {job.job_id}: {args.mode}, {request.nodes} node(s) x {request.tasks} task(s) x "
          f"{request.cpus_per_task} CPU(s){f' + {request.gpus_per_node} GPU(s)' if request.gpus_per_node else ''}"
          f", partition {request.partition}, {request.timeout_min} min", flush=True)
    print(f"job folder {job_folder(config, job.job_id)}; logs {out.parent}/{job.job_id}_<rank>_log.{{out,err}}",
          flush=True)
    if not args.wait:
        return 0
    try:
        return report(job, config, started, args.poll_s)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {job.job_id} goes on (scancel {job.job_id} stops it)", file=sys.stderr)
        return 130


def sweep_main(argv: list[str] | None = None) -> int:
    """``python slurm/sweep.py --resolutions 32,48,64 [cluster options] -- --weight-path CKPT [...]``."""
    own, main_argv = split_argv(sys.argv[1:] if argv is None else argv)
    p = request_parser("FixRes-finetune one checkpoint at several test resolutions as one SLURM job array "
                       "and gather the table (1 epoch each unless --epochs is given).", None)
    p.add_argument("--resolutions", required=True, help="comma-separated test resolutions, e.g. 32,48,64")
    p.add_argument("--parallel", type=int, help="array tasks running at once (default 32)")
    p.add_argument("--output", help="also write the rows as JSON here (default <shared>/sweep-<array id>.json)")
    args = p.parse_args(own)
    try:
        resolutions = [int(x) for x in args.resolutions.split(",") if x.strip()]
    except ValueError:
        print(f"fixres_dist: sweep: --resolutions {args.resolutions!r}: give sizes like 32,48,64", file=sys.stderr)
        return 1
    started = time.time()
    try:
        main_args = build_parser("finetune").parse_args(main_argv)
        if main_args.input_size is not None:
            raise FixresError("--input-size: the sweep sets it to each of --resolutions; drop it")
        request = request_from_args(args)
        template = config_from_argv("finetune", main_argv, request.num_tasks,
                                    device="cuda" if request.gpus_per_node else "cpu",
                                    overrides={} if main_args.epochs is not None else {"epochs": 1})
        jobs, configs, request = submit_array(sweep_configs(template, resolutions), request)
    except FixresError as exc:
        print(f"fixres_dist: sweep: {exc}", file=sys.stderr, flush=True)
        return 1
    array_id = str(jobs[0].job_id).split("_")[0]
    print(f"submitted SLURM array job {array_id}: {len(jobs)} finetune(s) at {', '.join(map(str, resolutions))} px, "
          f"each {request.nodes} node(s) x {request.tasks} task(s); job folders "
          f"{configs[0].shared_folder_path}/{array_id}_<i>/ (logs in their logs/)", flush=True)
    try:
        watch(jobs, _say(sys.stdout), started, poll_s=args.poll_s)
        rows = gather_sweep(jobs, configs)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; array job {array_id} goes on (scancel {array_id} stops it)", file=sys.stderr)
        return 130
    print(sweep_table(rows, configs[0].weight_path, configs[0].epochs))
    output = Path(args.output) if args.output else Path(configs[0].shared_folder_path) / f"sweep-{array_id}.json"
    output.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"rows written to {output}")
    return 1 if any(row["error"] for row in rows) else 0
