"""Against a real SLURM (slurm/start-local-slurm.sh): submitit and sbatch jobs of 2 CPU tasks (gloo).

A submitit job trains (``slurm/submit.py --wait`` reports both ranks) and another finetunes; the
sbatch template trains then finetunes, with the same requeue protocol: SLURM's warning signal
mid-training requeues either job, which resumes to the same parameters as an uninterrupted run; a
rank that raises fails the job at once, with its error in its log; the job-array sweep gives one
row per resolution; bad requests are refused before anything is submitted. Every job uses fresh
folders (SLURM job ids restart at 1 when the cluster's state is wiped, and submitit would find an
old result pickle), a small warning delay (``--signal-delay-s 10``) and polls states (every second,
``--poll-s 1``) instead of asserting once (sacct lags the queue).

The jobs of those tests are submitted together (:func:`submitted`), and each test waits for its
own: the local SLURM runs several at once (its partition oversubscribes its 2 CPUs), so their
starts (a Python with torch in every task) and SLURM's pauses (a requeued job may start again only
11 s later) overlap instead of adding up. Their tracebacks name the job each test checks.

Skipped, with the reason, only where no SLURM can be started: no SLURM commands, not root, or the
start script fails. When the cluster is not up, the tests start it with slurm/start-local-slurm.sh
(no package installation from here: ``LOCAL_SLURM_INSTALL=0``) and stop it afterwards.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest
import torch

import shown_commands as shown
from conftest import ROOT, SCRATCH, clean_env, read_only_folder, wait_for
from fixres_dist import FixresError, Preempted, TrainerConfig
from fixres_dist.cluster import cli, inventory, monitor, submission, task
from fixres_dist.cluster.inventory import Node, Partition
from fixres_dist.cluster.request import SlurmRequest
from fixres_dist.cluster.template import config_from_argv
from fixres_dist.training.checkpoint import load_checkpoint

TIMEOUT_MIN = 5  # every job's time limit
CLUSTER = ["--tasks-per-node", "2", "--timeout-min", str(TIMEOUT_MIN), "--signal-delay-s", "10", "--poll-s", "1"]
POLL_S = 1.0
# sacct looks no further back: SLURM numbers jobs from 1 again once a cluster's state is wiped, and
# its accounting keeps the jobs of earlier runs under the same ids.
SINCE = time.strftime("%Y-%m-%dT%H:%M:%S")
JOB_WAIT = 360  # how long a test waits for its job: with the others running beside it, on a loaded machine
START, STOP = ROOT / "slurm" / "start-local-slurm.sh", ROOT / "slurm" / "stop-local-slurm.sh"


def _sinfo_state() -> str | None:
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return None
    states = out.stdout.split() if out.returncode == 0 else []
    return next((s for s in states if s.rstrip("*~#!%$@^-") in ("idle", "mixed", "allocated", "completing")), None)


@pytest.fixture(scope="module")
def cluster():
    """A SLURM that answers; started here (and stopped afterwards) if it is installed but down."""
    reason = os.environ.get("FIXRES_SLURM_UNAVAILABLE")
    if reason:
        pytest.skip(f"no SLURM: {reason}")
    started = False
    if _sinfo_state() is None:
        if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
            pytest.skip("no SLURM: slurmctld/sbatch not installed (run slurm/start-local-slurm.sh as root "
                        "once; it installs Debian's slurm-wlm packages)")
        if os.geteuid() != 0:
            pytest.skip("no SLURM: the local cluster is down and only root can start it "
                        "(slurm/start-local-slurm.sh)")
        env = {**os.environ, "LOCAL_SLURM_INSTALL": "0"}
        out = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=180, env=env)
        if out.returncode != 0 or _sinfo_state() is None:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"no SLURM: slurm/start-local-slurm.sh failed: {last}")
        started = True
    yield
    if started:
        subprocess.run(["bash", str(STOP)], capture_output=True, timeout=180)


class Command:
    """``python slurm/<script> args`` running in the background (its output in files, read as it
    goes): the submitter a user runs, with ``--wait`` following its job to the end."""

    def __init__(self, folder: Path, name: str, script: str, *args, **env):
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen([sys.executable, str(ROOT / "slurm" / script), *map(str, args)],
                                            stdout=out, stderr=err, cwd=ROOT, env=clean_env(**env))

    def job_id(self) -> str | None:
        """The (array) job id it printed once it submitted; None before."""
        found = re.search(r"submitted SLURM (?:array )?job (\d+)", self.out.read_text())
        return found.group(1) if found else None

    def finish(self, timeout: float = JOB_WAIT) -> tuple[int, str, str]:
        """``(exit status, stdout, stderr)`` once it has ended (killed after ``timeout`` seconds)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"{self.process.args[1]} still running after {timeout} s: "
                                 f"{self.out.read_text()[-2000:]}") from None
        return self.process.returncode, self.out.read_text(), self.err.read_text()


def wait_gone(job_id: str, timeout: float = JOB_WAIT) -> list:
    """Follow the job's state until it has finished; returns the state changes (G3: poll, don't assert once)."""
    watched = monitor.watch([job_id], timeout=timeout, poll_s=POLL_S)
    state = watched.states.get(job_id, "UNKNOWN")
    assert state.split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "UNKNOWN"), \
        f"job {job_id} not finished after {timeout} s: {watched.events}"
    return watched.events


def submit_job(mode: str, request: SlurmRequest, argv: list) -> tuple:
    """What slurm/submit.py does, from Python: a template from main_*.py options, then submit()."""
    config = config_from_argv(mode, [str(a) for a in argv], request.num_tasks)
    return submission.submit(config, request)


def sacct(*args) -> str:
    """``sacct -n -P args`` for the jobs since this module was loaded (:data:`SINCE`)."""
    return subprocess.run(["sacct", "-n", "-P", "-S", SINCE, *args], capture_output=True, text=True,
                          timeout=15).stdout


def sacct_states(job_id: str) -> list[str]:
    """Every run of the job in sacct, oldest first (``-D``: a requeued job shows REQUEUED then its end)."""
    return [line.split()[0] for line in sacct("-X", "-D", "-j", str(job_id), "-o", "State").splitlines()
            if line.strip()]


def read_events(job_folder: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (job_folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def scratch_flags(data: Path, shared: Path) -> list[str]:
    """What conftest.scratch_job trained (2 epochs of 5 steps: 80 images, 2 ranks x 8), with a
    checkpoint every 2 steps: that job is the uninterrupted run the requeued ones must match."""
    return ["--data-path", str(data), "--shared-folder-path", str(shared), *SCRATCH, "--ckpt-every", "2"]


def finetune_flags(data: Path, shared: Path, weights: Path) -> list[str]:
    return ["--data-path", str(data), "--shared-folder-path", str(shared), "--weight-path", str(weights),
            "--input-size", "48", "--batch", "8", "--epochs", "1", "--workers", "0", "--no-progress"]


def preempt_mid_training(job_id, shared: Path, cancelled: threading.Event) -> list[dict] | None:
    """Once the job's first periodic checkpoint is on disk (step 2 of its 10), send it SLURM's
    warning signal (``scancel --signal=USR2``); ``job_id()`` gives its id once known. Returns the
    job's metrics events at that moment (None if ``cancelled`` first)."""
    job = wait_for(lambda: cancelled.is_set() or job_id(), 120, "the job's id")
    folder = shared / str(job)
    wait_for(lambda: cancelled.is_set() or list(folder.glob("checkpoint-*.pth")), JOB_WAIT,
             f"job {job}'s first periodic checkpoint")
    if cancelled.is_set():
        return None
    at_signal = read_events(folder)
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    return at_signal


def sbatch(cwd: Path, *args) -> str:
    """``sbatch ... slurm/job.sbatch ...`` of 2 tasks from ``cwd``; returns the job id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, FIXRES_ROOT=str(ROOT))
    cmd = ["sbatch", "--parsable", "--ntasks-per-node", "2", "--time", str(TIMEOUT_MIN), *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


@attrs.frozen
class Submitted:
    """The jobs of the tests below, running (:func:`submitted`)."""

    submitit: Command               # submit.py scratch --wait, preempted mid-training (``submitit_preempted``)
    submitit_preempted: concurrent.futures.Future
    finetune: tuple                 # (job, config, request): submitit finetune of 2 tasks, from Python
    failing: Command                # submit.py scratch --wait, whose rank 1 raises at step 2
    sweep: Command                  # sweep.py at 32 and 48 px
    shared: dict[str, Path]         # each one's shared folder, by the names above


@pytest.fixture(scope="module")
def submitted(cluster, tiny_data, scratch_job, tmp_path_factory):
    """Submit every job of the tests below at once (but :func:`sbatch_chain`'s), then let each test wait
    for its own; cancels whatever is still running at the end. Finetunes start from
    :func:`conftest.scratch_job`'s checkpoint."""
    shared = {name: tmp_path_factory.mktemp(f"slurm-{name}") for name in ("submitit", "finetune", "failing", "sweep")}
    logs = tmp_path_factory.mktemp("slurm-commands")
    preempter, cancelled = concurrent.futures.ThreadPoolExecutor(2), threading.Event()
    commands, job_ids = [], []
    try:
        commands.append(Command(logs, "submitit", "submit.py", "scratch", *CLUSTER, "--wait", "--",
                                *scratch_flags(tiny_data, shared["submitit"])))
        commands.append(Command(logs, "failing", "submit.py", "scratch", *CLUSTER, "--wait", "--",
                                "--data-path", tiny_data, "--shared-folder-path", shared["failing"],
                                "--input-size", "32", "--batch", "8", "--epochs", "1", "--workers", "0",
                                "--no-progress", "--dist-timeout", 2 * TIMEOUT_MIN * 60,
                                FIXRES_FAULT="raise:rank=1:step=2"))  # the job inherits the variable
        # the warning signal mid-training, as soon as the job can take it
        preempted = preempter.submit(preempt_mid_training, commands[0].job_id, shared["submitit"], cancelled)
        weights = scratch_job / "checkpoint.pth"
        commands.append(Command(logs, "sweep", "sweep.py", "--resolutions", "32,48", "--timeout-min", TIMEOUT_MIN,
                                "--signal-delay-s", "10", "--poll-s", "1", "--", "--weight-path", weights,
                                "--data-path", tiny_data, "--shared-folder-path", shared["sweep"], "--batch", "8",
                                "--workers", "0", "--no-progress"))
        finetune = submit_job("finetune", SlurmRequest(tasks_per_node=2, timeout_min=TIMEOUT_MIN, signal_delay_s=10),
                              finetune_flags(tiny_data, shared["finetune"], weights))
        job_ids.append(finetune[0].job_id)
        submitit, failing, sweep = commands
        yield Submitted(submitit=submitit, submitit_preempted=preempted, finetune=finetune, failing=failing,
                        sweep=sweep, shared=shared)
    finally:
        cancelled.set()
        preempter.shutdown(wait=True, cancel_futures=True)
        for command in commands:
            if command.process.poll() is None:
                command.process.kill()
        job_ids += [command.job_id() for command in commands]
        subprocess.run(["scancel", *filter(None, job_ids)], capture_output=True, timeout=30)


@attrs.frozen
class SbatchChain:
    """job.sbatch main_scratch.py, preempted mid-training (``preempted``: its events at the signal), and
    job.sbatch main_finetune.py of its checkpoint after it (afterok); ``folder``: sbatch's working
    folder (its logs slurm-fixres-<name>-<id>.out)."""

    folder: Path
    scratch: str
    preempted: concurrent.futures.Future
    finetune: str


@pytest.fixture(scope="module")
def sbatch_chain(cluster, tiny_data, tmp_path_factory):
    """Submit :class:`SbatchChain`'s two jobs; cancels whatever is still running at the end."""
    folder, template = tmp_path_factory.mktemp("slurm-sbatch"), ROOT / "slurm" / "job.sbatch"
    preempter, cancelled, job_ids = concurrent.futures.ThreadPoolExecutor(1), threading.Event(), []
    try:
        scratch = sbatch(folder, "--job-name", "fixres-scratch", template, "main_scratch.py",
                         *scratch_flags(tiny_data, folder))
        job_ids.append(scratch)
        preempted = preempter.submit(preempt_mid_training, lambda: scratch, folder, cancelled)
        weights = folder / scratch / "checkpoint.pth"
        job_ids.append(sbatch(folder, "--job-name", "fixres-finetune", f"--dependency=afterok:{scratch}", template,
                              "main_finetune.py", *finetune_flags(tiny_data, folder, weights)))
        yield SbatchChain(folder, scratch, preempted, job_ids[1])
    finally:
        cancelled.set()
        preempter.shutdown(wait=True, cancel_futures=True)
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=30)


TABLE_ROW = re.compile(r"^\|\s+(\d)\s+\|\s+\S+ \|\s+(\d+) \|\s+32 px \|\s+([\d.]+) \|.*\|\s+30 \|$", re.M)


def test_submitit_job_trains_then_finetunes_with_two_ranks(submitted):
    """``submit.py scratch --wait`` (requeued on the way: :func:`test_warning_signal_requeues_...`)
    reports both ranks with the same top-1, its checkpoint knows the job; a submitit finetune of 2
    tasks returns each rank's result."""
    status, stdout, stderr = submitted.submitit.finish()
    assert status == 0, stdout + stderr
    job_id, shared = submitted.submitit.job_id(), submitted.shared["submitit"]
    assert f"logs {shared}/{job_id}/logs/{job_id}_<rank>_log.{{out,err}}" in stdout
    rows = TABLE_ROW.findall(stdout)
    assert [r for r, _, _ in rows] == ["0", "1"] and rows[0][2] == rows[1][2], stdout  # both ranks, same top-1
    checkpoint = load_checkpoint(shared / job_id / "checkpoint.pth")
    assert checkpoint["config"]["num_tasks"] == 2 and checkpoint["config"]["job_id"] == job_id
    assert re.search(rf"/{job_id}/rendezvous-\d\.json$", checkpoint["config"]["dist_url"])
    config = json.loads((shared / job_id / "config.json").read_text())  # the requeued run's: its own rendezvous
    assert config["job_id"] == job_id and config["dist_url"] == f"file://{shared}/{job_id}/rendezvous-1.json"

    job, _, _ = submitted.finetune
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["resolution"] == 48 and r["images"] == 30 and r["job_id"] == job.job_id for r in results)
    assert results[0]["top1"] == results[1]["top1"]
    log = (submitted.shared["finetune"] / job.job_id / "logs" / f"{job.job_id}_0_log.out").read_text()
    assert "test resolution, FixRes finetuned" in log
    wait_gone(job.job_id)
    assert wait_for(lambda: sacct_states(job.job_id) == ["COMPLETED"], 15, "sacct COMPLETED")


def assert_same_parameters(checkpoint: Path, reference: Path) -> None:
    ours, theirs = load_checkpoint(checkpoint), load_checkpoint(reference)
    assert ours["epoch"] == theirs["epoch"] == 2
    different = [k for k in theirs["model"] if not torch.equal(ours["model"][k], theirs["model"][k])]
    assert not different, f"parameters differ from the uninterrupted run's: {different[:5]}"


@pytest.mark.slow
def test_sbatch_template_trains_then_finetunes_with_two_tasks_and_requeues(sbatch_chain, scratch_job):
    """job.sbatch main_scratch.py gets the warning signal mid-training: its ranks checkpoint, rank 0
    requeues the job, which resumes to the uninterrupted run's parameters; job.sbatch
    main_finetune.py then runs after it (afterok). Slow: the requeue of submit.py's job, in the main
    pass, and sbatch on two nodes (tests/jobs/test_multinode.py) cover the same paths."""
    chain = sbatch_chain
    scratch, finetune, shared = chain.scratch, chain.finetune, chain.folder
    at_signal = chain.preempted.result(timeout=JOB_WAIT)
    assert not any(e["event"] == "train" and e["epoch"] == 2 for e in at_signal), "the signal came too late"
    wait_gone(finetune)

    logs = {name: (shared / f"slurm-fixres-{name}-{job_id}.out").read_text()
            for job_id, name in ((scratch, "scratch"), (finetune, "finetune"))}
    assert wait_for(lambda: sacct_states(scratch) == ["REQUEUED", "COMPLETED"], 15, "scratch requeued"), logs
    assert wait_for(lambda: sacct_states(finetune) == ["COMPLETED"], 15, "finetune COMPLETED"), logs
    assert f"job {scratch} preempted, checkpoint written; requeueing (restart 1 of at most 3)" in logs["scratch"]
    assert re.search(rf"job {scratch} restart 1: .*\n(.*\n)*resumed from ", logs["scratch"]), logs["scratch"]
    node = os.uname().nodename.split(".")[0]
    for job_id, name, restart in ((scratch, "scratch", 1), (finetune, "finetune", 0)):
        assert f"2 task(s) on {node}: main_{name}.py" in logs[name], logs[name]
        config = json.loads((shared / job_id / "config.json").read_text())
        assert config["num_tasks"] == 2 and config["job_id"] == job_id
        assert config["dist_url"] == f"file://{shared}/{job_id}/rendezvous-{restart}.json"  # the published file
        evals = [e for e in read_events(shared / job_id) if e["event"] == "eval"]
        assert evals and evals[-1]["images"] == 30
    assert "test resolution, FixRes finetuned" in logs["finetune"]
    steps = sacct("-j", f"{finetune}.0", "-o", "NTasks,State").split()
    assert steps == ["2|COMPLETED"]
    assert_same_parameters(shared / scratch / "checkpoint.pth", scratch_job / "checkpoint.pth")


def test_warning_signal_requeues_and_the_job_resumes_to_the_same_parameters(submitted, scratch_job):
    """The submitit job of ``submit.py --wait`` gets the warning signal mid-training: it is requeued
    (RUNNING, then PENDING, then RUNNING again), its second run says it resumed, both ranks report
    that run's result, and it ends with the parameters of the same job never interrupted
    (:func:`conftest.scratch_job`)."""
    at_signal = submitted.submitit_preempted.result(timeout=JOB_WAIT)
    assert not any(e["event"] == "train" and e["epoch"] == 2 for e in at_signal), "the signal came too late"
    status, stdout, stderr = submitted.submitit.finish()
    assert status == 0, stdout + stderr
    job_id, folder = submitted.submitit.job_id(), submitted.shared["submitit"] / submitted.submitit.job_id()
    states = " ".join(re.findall(rf"job {job_id}: (\S+)", stdout))
    assert re.search(r"RUNNING .*PENDING .*RUNNING", states), stdout  # requeued
    print(stdout)  # the state changes, with their times
    assert [restarts for _, restarts, _ in TABLE_ROW.findall(stdout)] == ["1", "1"], stdout  # the requeued run's result
    assert wait_for(lambda: sacct_states(job_id)[-2:] == ["REQUEUED", "COMPLETED"], 15, "sacct REQUEUED")
    runs = (folder / "logs" / f"{job_id}_0_log.out").read_text().split("Starting with JobEnvironment")
    assert len(runs) == 3 and "resumed from " in runs[2], runs  # submitit logs that line at every start
    assert_same_parameters(folder / "checkpoint.pth", scratch_job / "checkpoint.pth")


def test_a_rank_that_raises_fails_the_job_quickly_with_the_error_in_its_log(submitted):
    """Rank 1 raises at step 2: the job fails at once, FAILED (its --dist-timeout is twice its time
    limit: had rank 0 waited for its peer, the job would have run into the limit, TIMEOUT), and
    ``submit.py --wait`` exits 1 with one line naming rank 1's error and its log."""
    status, stdout, stderr = submitted.failing.finish()
    assert status == 1, stdout + stderr
    job_id, shared = submitted.failing.job_id(), submitted.shared["failing"]
    assert f"logs {shared}/{job_id}/logs/{job_id}_<rank>_log.{{out,err}}" in stdout
    line = stderr.strip().splitlines()[-1]
    failed = re.match(rf"fixres_dist: job {job_id} FAILED after ([\d.]+) s: ", line)
    assert failed, stderr
    assert f"rank 1: RuntimeError: injected fault at step 2 (log: {shared}/{job_id}/logs/{job_id}_1_log.err)" in line
    err = (shared / job_id / "logs" / f"{job_id}_1_log.err").read_text()
    assert "fixres_dist: rank 1: RuntimeError: injected fault" in err
    assert sacct_states(job_id)[-1] == "FAILED"  # not TIMEOUT
    running = re.search(rf"\+\s*([\d.]+) s  job {job_id}: RUNNING", stdout)  # when it started (it may pend)
    assert running and float(failed.group(1)) - float(running.group(1)) < TIMEOUT_MIN * 60, stdout + line


def test_job_array_sweep_gives_one_result_per_resolution(submitted):
    status, stdout, stderr = submitted.sweep.finish()
    assert status == 0, stdout + stderr
    array_id = submitted.sweep.job_id()
    rows = json.loads((submitted.shared["sweep"] / f"sweep-{array_id}.json").read_text())
    assert [r["resolution"] for r in rows] == [32, 48]
    assert [r["job_id"] for r in rows] == [f"{array_id}_{i}" for i in range(2)]
    assert all(r["error"] is None and r["images"] == 30 and 0 <= r["top1"] <= 100 for r in rows), rows
    assert all(r["top1_before"] is not None for r in rows), rows
    assert "1-epoch finetune at each test resolution" in stdout
    assert len(re.findall(r"^\|\s+(32|48) px \|", stdout, re.M)) == 2, stdout


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot write to (a read-only mount for root, mode 0500 otherwise)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    yield from read_only_folder(folder)


@pytest.mark.parametrize("case, cluster_args, main_args, message", [
    ("partition", ["--partition", "nosuch"], [], "partition 'nosuch' does not exist (partitions: "),
    ("tasks", ["--tasks-per-node", "64"], [], "cannot run 1 node(s) with 64 task(s)"),
    ("gpus", ["--gpus-per-node", "2"], [], "2 GPU(s)"),
    ("nodes", ["--nodes", "16"], [], "cannot run 16 node(s)"),
    ("cpus", ["--cpus-per-task", "512"], [], "x 512 CPU(s)"),
    ("memory", ["--mem-gb", "100000"], [], "100000 GB"),
    ("timeout", ["--timeout-min", "1", "--signal-delay-s", "90"], [],
     "--timeout-min 1 is too short for --signal-delay-s 90"),
    ("missing shared", [], ["--shared-folder-path", "MISSING"], "does not exist"),
    ("unwritable shared", [], ["--shared-folder-path", "UNWRITABLE"], "writable"),
    ("rank flags", [], ["--num-tasks", "2"], "--num-tasks: SLURM sets the ranks"),
])
def test_bad_requests_are_refused_in_seconds(cluster, tiny_data, tmp_path, request, capsys,
                                             case, cluster_args, main_args, message):
    """Refused by the submitter itself, in one line, before anything is submitted (a job that
    could never run would pend forever)."""
    if "UNWRITABLE" in main_args:
        main_args = ["--shared-folder-path", str(request.getfixturevalue("unwritable"))]
    main_args = [str(tmp_path / "missing") if a == "MISSING" else a for a in main_args]
    if "--shared-folder-path" not in main_args:
        main_args += ["--shared-folder-path", str(tmp_path)]
    status = cli.submit_main(["scratch", *cluster_args, "--", "--data-path", str(tiny_data), *main_args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1 and err[0].startswith("fixres_dist: submit: "), err
    assert message in err[0], err
    assert not list(tmp_path.glob("*/logs")), "nothing may be submitted"


# ----------------------------------------------------------------- without a cluster (always run)
@pytest.mark.parametrize("text, minutes", [("infinite", None), ("UNLIMITED", None), ("30", 30), ("30:00", 30),
                                           ("2:00:00", 120), ("1-00:00:00", 1440), ("2-12", 3600),
                                           ("1-01:30", 1530)])
def test_slurm_time_limits_parse(text, minutes):
    assert inventory.parse_time_limit(text) == minutes


@pytest.mark.parametrize("gres, gpus", [("(null)", 0), ("gpu:8", 8), ("gpu:a100:4(S:0-1)", 4),
                                        ("gpu:a100:4,gpu:v100:2", 6), ("shard:8,gpu:2", 2)])
def test_sinfo_gres_gives_the_gpu_count(gres, gpus):
    assert inventory.parse_gpus(gres) == gpus


GPU_CLUSTER = {
    "gpu": Partition("gpu", True, True, 72 * 60, (
        Node("g1", 80, 512000, 8, "idle"), Node("g2", 80, 512000, 8, "mixed"),
        Node("g3", 80, 512000, 8, "drained"))),
    "cpu": Partition("cpu", False, True, None, (Node("c1", 32, 64000, 0, "idle"),)),
}


def test_a_gpu_request_gets_one_task_per_gpu_and_the_cpus_shared_out():
    checked = inventory.check_request(SlurmRequest(nodes=2, gpus_per_node=8, timeout_min=60), GPU_CLUSTER)
    assert (checked.partition, checked.tasks, checked.cpus_per_task, checked.num_tasks) == ("gpu", 8, 10, 16)


@pytest.mark.parametrize("request_fields, message", [
    ({"nodes": 3, "gpus_per_node": 8}, "only 2 of the 3 node(s) that fit are usable (g1 idle, g2 mixed, g3 drained)"),
    ({"gpus_per_node": 8, "tasks_per_node": 4}, "one task per GPU"),
    ({"partition": "cpu", "gpus_per_node": 1}, "cannot run 1 node(s) with 1 task(s) x 32 CPU(s), 1 GPU(s)"),
    ({"timeout_min": 73 * 60}, "exceeds the time limit of partition 'gpu' (4320 minutes)"),
    ({"timeout_min": 2, "signal_delay_s": 120}, "use --timeout-min >= 3 or a smaller --signal-delay-s"),
    ({"partition": "a100"}, "partition 'a100' does not exist (partitions: gpu, cpu)"),
    ({"nodes": 0}, "--nodes must be >= 1, got 0"),
    ({"gpus_per_node": -1}, "--gpus-per-node must be >= 0, got -1"),
    ({"mem_gb": 0}, "--mem-gb must be > 0, got 0"),
    ({"max_requeues": -1}, "--max-requeues must be >= 0, got -1"),
])
def test_impossible_requests_are_refused_against_the_partition(request_fields, message):
    with pytest.raises(FixresError, match=re.escape(message)) as raised:
        inventory.check_request(SlurmRequest(**{"timeout_min": 60, **request_fields}), GPU_CLUSTER)
    assert "\n" not in str(raised.value)


def test_each_restart_of_a_job_meets_at_its_own_rendezvous_file(tmp_path):
    template = TrainerConfig(num_tasks=4, shared_folder_path=str(tmp_path))
    first = task.task_config(template, task.TaskPlace("1234", 3, 1, 4, restart=0))
    again = task.task_config(template, task.TaskPlace("1234", 3, 1, 4, restart=1))
    assert (again.global_rank, again.local_rank, again.num_tasks, again.job_id) == (3, 1, 4, "1234")
    assert first.dist_url == f"file://{tmp_path}/1234/rendezvous-0.json"
    assert again.dist_url == f"file://{tmp_path}/1234/rendezvous-1.json"
    with pytest.raises(FixresError, match="SLURM started 2 tasks but the job was submitted for 4"):
        task.task_config(template, task.TaskPlace("1234", 0, 0, 2, restart=0))


def test_the_job_template_takes_device_defaults_from_the_configuration(tmp_path):
    """The submitter only says where the job runs; backend, precision and layout follow from the config."""
    gpu = config_from_argv("scratch", ["--shared-folder-path", str(tmp_path)], 16, device="cuda")
    cpu = config_from_argv("scratch", ["--shared-folder-path", str(tmp_path)], 2, device="cpu")
    assert (gpu.device, gpu.dist_backend, gpu.amp, gpu.channels_last) == ("cuda", "nccl", "bf16", True)
    assert (cpu.device, cpu.dist_backend, cpu.amp, cpu.channels_last) == ("cpu", "gloo", "off", False)
    assert gpu.preempt_signal == "SIGUSR2" and gpu.num_tasks == 16
    with pytest.raises(FixresError, match="--job-id, --dist-url: SLURM sets the ranks"):
        config_from_argv("scratch", ["--job-id", "x", "--dist-url", "env://"], 2)


def test_a_failed_task_is_reported_by_its_one_line_cause():
    from submitit.core.utils import FailedJobError, UncompletedJobError

    trace = ("Traceback (most recent call last):\n  ...\nRuntimeError: injected fault at step 2\n\nThe above "
             "exception was the direct cause of the following exception:\n\n  ...\n"
             "fixres_dist.cluster.task.TaskFailed: RuntimeError: injected fault at step 2\n")
    assert monitor.failure_cause(FailedJobError(f"Job failed with trace:\n{trace}see the logs")) == \
        (True, "RuntimeError: injected fault at step 2")
    raised, cause = monitor.failure_cause(
        UncompletedJobError("Job 7 (task: 1) with path x\nhas not produced any output"))
    assert not raised and cause.startswith("ended without a result")


@pytest.mark.parametrize("signum, restart, expected", [
    (signal.SIGUSR2, 3, "not requeued: requeued 3 time(s) already (max 3); run the job again to resume"),
    (signal.SIGTERM, 0, 3),  # scancel or SLURM's own preemption: stop with status 3, SLURM decides
    (signal.SIGUSR2, 0, ["scontrol", "requeue", "77"]),
])
def test_after_a_preemption_checkpoint_rank_0_requeues_only_on_the_warning_signal(monkeypatch, signum, restart,
                                                                                  expected):
    ran = []
    monkeypatch.setattr(task, "run_command", lambda cmd, timeout=15: ran.append(cmd))

    class Preempting:
        """A Trainer stopped by ``signum``: after its checkpoint it calls the handler it replaced (the
        task's, with no frame: records the signal, does not raise), then raises Preempted."""

        def __init__(self, config, inputs=None):
            pass

        def __call__(self):
            signal.getsignal(signum)(signum, None)
            raise Preempted(f"stopped by {signum.name}; checkpoint written")

    monkeypatch.setattr(task, "Trainer", Preempting)
    config = TrainerConfig(num_tasks=2, job_id="77", preempt_signal="SIGUSR2")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    if isinstance(expected, str):
        with pytest.raises(task.TaskFailed, match=re.escape(expected)):
            task.run_task(config, restart, max_requeues=3)
    else:
        with pytest.raises(SystemExit) as exited:
            task.run_task(config, restart, max_requeues=3)
        assert exited.value.code == 3
    assert ran == ([expected] if isinstance(expected, list) else [])
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the task's handlers are gone again


@pytest.mark.slow
@pytest.mark.parametrize("how", ["scancel --signal=TERM", "time limit"])
def test_sigterm_to_every_process_of_an_srun_job_checkpoints_without_a_traceback(cluster, tiny_data, tmp_path, how):
    """SLURM signals every process of a step (loader workers too): at the time limit, and with
    ``scancel --signal=TERM``. Both ranks checkpoint and exit 3 with one line each; no traceback.

    The job leaves squeue, its state already TIMEOUT (or FAILED), while its step still ends: the
    ranks checkpoint and print their lines after that, so the test waits for them. The network is
    a ResNet-20 (2 MB checkpoints) and each rank has one loader worker (the fewest that shows the
    workers signalled too): the ranks must be done within KillWait (5 s on the local SLURM) on a
    2-core machine, which a ResNet-18's 90 MB checkpoint written just after an epoch's own did not
    always manage. (On a machine busy with other work, the ranks may print their lines and still
    be killed before they exit: the step then ends CANCELLED|0:9.)
    """
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    main = f"{sys.executable} -u {ROOT / 'main_scratch.py'} --data-path {tiny_data} --shared-folder-path {shared} " \
           "--architecture resnet20 --input-size 32 --batch 8 --epochs 10000 --workers 1 --no-progress"
    out = subprocess.run(["sbatch", "--parsable", "--ntasks", "2", "--time", "1" if how == "time limit" else "5",
                          "--output", str(tmp_path / "job.out"), "--wrap", f"srun {main}"],
                         capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    folder = shared / job_id
    wait_for(lambda: any(e["event"] == "train" for e in read_events(folder)), 240, "the first epoch")
    if how == "scancel --signal=TERM":
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=30)
    wait_gone(job_id, timeout=300)
    expected = "TIMEOUT" if how == "time limit" else "FAILED"
    assert wait_for(lambda: sacct_states(job_id) == [expected], 15, f"sacct {expected}"), sacct_states(job_id)
    # The step's state in sacct: TIMEOUT|0:0 until its ranks have exited, then FAILED|3:0.
    def step():
        return sacct("-j", f"{job_id}.0", "-o", "State,ExitCode").split()

    try:
        wait_for(lambda: step() == ["FAILED|3:0"], 60, "every rank's exit status 3 in sacct")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the step's state: {step()}") from None
    lines = [f"fixres_dist: rank {rank}: preempted by SIGTERM; " for rank in (0, 1)]
    log_path = tmp_path / "job.out"
    try:  # srun relays the ranks' last lines, then ends
        wait_for(lambda: all(line in log_path.read_text() for line in lines), 30, "both ranks' lines in the log")
    finally:
        log = log_path.read_text()
        print(log[-3000:])
    assert "Traceback" not in log and "DataLoader worker" not in log, log[-3000:]
    state = load_checkpoint(folder / "checkpoint.pth")
    assert len(state["ranks"]) == 2 and state["global_step"] > 0


# ------------------------------------------ docs/cluster.md's GPU cluster examples (tests/jobs/test_readme.py)

def test_the_gpu_cluster_examples_are_refused_in_one_line_by_a_cluster_without_gpus(cluster, tiny_data, tmp_path):
    """The 8-GPU examples (docs/cluster.md and job.sbatch's comment), on the local SLURM, which has no `gpu`
    partition and no GPUs: each is refused at once, in one line that says why. They run at the
    same time (each a shell, and a Python for the submitters)."""
    home = shown.sandbox(tmp_path / "clone")
    shared = tmp_path / "shared"
    shared.mkdir()
    examples = [shown.command("python slurm/submit.py finetune --nodes 2 --gpus-per-node 8 --partition gpu"),
                *shown.block("sbatch --nodes 2 --ntasks-per-node 8 --gpus-per-node 8"),
                shown.command("python slurm/sweep.py --resolutions 160,224,288"),
                shown.command("sbatch --nodes 4 --ntasks-per-node 8 --gpus-per-node 8")]
    shells = [subprocess.Popen(["bash", "-c", shown.filled(example, **{"/checkpoint/$USER/fixres": shared,
                                                                       "/datasets/imagenet": tiny_data})],
                               cwd=home, env=shown.shell_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for example in examples]
    for example, shell in zip(examples, shells):
        stdout, stderr = shell.communicate(timeout=240)
        lines = stderr.strip().splitlines()
        assert shell.returncode != 0 and len(lines) == 1, (example, stdout, stderr)
        assert re.search(r"partition|gpu|GPU|generic resource|node configuration", lines[0]), (example, lines[0])
