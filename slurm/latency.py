"""Measure SLURM latencies of a real submitit job: submit -> running -> ranks met, and requeue -> resumed.

    python slurm/latency.py --tasks-per-node 2 --timeout-min 5 --signal-delay-s 10 --repeat 3 \
        -- --data-path DIR --shared-folder-path DIR --input-size 32 --batch 8 --epochs 2 --workers 0

States come from sacct every ``--poll-s`` seconds (default 5; pass ``--poll-s 0.5`` here for
sub-second figures). Each repetition submits one scratch job (``--ckpt-every 2`` is added), and times, from the moment
``submit()`` returns: the job RUNNING in squeue, and rank 0's first Trainer line (the ranks have
met). Once the first periodic checkpoint is on disk it sends the warning signal
(``scancel --signal=USR2``) and times, from then: the preemption checkpoint, the job PENDING
(requeued), RUNNING again, and the "resumed from" line of the restarted run.
"""
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing

from fixres_dist.cluster import cli, monitor, submission, template


def first_time(predicate, started: float, timeout: float = 600, poll: float = 0.05) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return time.time() - started
        time.sleep(poll)
    return float("nan")


def log_has(path: Path, pattern: str, run: int):
    """Whether the ``run``-th start (0-based) logged in ``path`` contains ``pattern``."""
    def check():
        try:
            runs = path.read_text().split("Starting with JobEnvironment")[1:]
        except OSError:
            return False
        return len(runs) > run and re.search(pattern, runs[run]) is not None
    return check


def one(request, argv, poll_s: float) -> dict:
    config = template.config_from_argv("scratch", argv + ["--ckpt-every", "2"], request.num_tasks,
                                       device="cuda" if request.gpus_per_node else "cpu")
    job, config, _ = submission.submit(config, request)
    submitted = time.time()
    states = {}

    def poll():
        for t, _, state in monitor.watch([job.job_id], started=submitted, timeout=600, poll_s=poll_s).events:
            states.setdefault(state, []).append(t)
    watcher = threading.Thread(target=poll)
    watcher.start()
    folder = submission.job_folder(config, job.job_id)
    log = folder / "logs" / f"{job.job_id}_0_log.out"
    row = {"job": job.job_id}
    row["met"] = first_time(log_has(log, rf"job {job.job_id}: scratch", 0), submitted)
    first_time(lambda: any(folder.glob("checkpoint-*.pth")), submitted)
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
    row["checkpointed"] = first_time(log_has(log, r"preempted by SIGUSR2", 0), signalled)
    row["resumed"] = first_time(log_has(log, r"resumed from ", 1), signalled)
    job.results()
    watcher.join()
    running = states.get("RUNNING", [])
    row["running"] = running[0] if running else float("nan")
    pending_again = [t for t in states.get("PENDING", []) if running and t > running[0]]
    row["requeued"] = pending_again[0] - (signalled - submitted) if pending_again else float("nan")
    row["running_again"] = (running[1] - (signalled - submitted)) if len(running) > 1 else float("nan")
    return row


def main() -> int:
    own, argv = cli.split_argv(sys.argv[1:])
    parser = cli.request_parser("Measure submit->running and requeue->resumed latencies.", None)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(own)
    request = cli.request_from_args(args)
    rows = [one(request, argv, args.poll_s) for _ in range(args.repeat)]
    columns = [("running", "submit -> RUNNING"), ("met", "submit -> ranks met"),
               ("checkpointed", "USR2 -> checkpoint written"), ("requeued", "USR2 -> PENDING (requeued)"),
               ("running_again", "USR2 -> RUNNING again"), ("resumed", "USR2 -> resumed (log)")]
    print(f"| seconds ({len(rows)} jobs: {', '.join(r['job'] for r in rows)}) | min | median | max |")
    print("|---|---|---|---|")
    for key, name in columns:
        values = [r[key] for r in rows]
        print(f"| {name} | {min(values):.1f} | {statistics.median(values):.1f} | {max(values):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
