"""Experiment trackers in whole jobs (fixres_dist.reporting.trackers): a job stopped by the preemption signal and
run again, as a SLURM requeue does, keeps one MLflow run (the default SQLite store in its folder) whose steps are
continuous and each logged once, its best checkpoint, and one W&B run id; a broken tracking URI is one warning and
the job ends with exit status 0. The sinks themselves: tests/reporting/test_trackers.py."""
from __future__ import annotations

import pytest

from conftest import job_events, run_script
from fixres_dist.config import TrainerConfig
from fixres_dist.reporting import trackers
from fixres_dist.training.checkpoint import BEST_FILE, CHECKPOINT_FILE, load_checkpoint

# 2 ranks of 8 images on tiny_data's 80: 5 steps of 16 images an epoch, 2 epochs.
TRACKED = ["--architecture", "resnet20", "--input-size", "32", "--batch", "8", "--epochs", "2", "--workers", "0",
           "--no-progress", "--best-metric", "top1", "--tracker", "mlflow,wandb"]


def train(folder, data, **env):
    return run_script("scratch", "--num-tasks", 2, "--job-id", "tracked", "--shared-folder-path", folder,
                      "--data-path", data, *TRACKED, env={"WANDB_SILENT": "true", **env})


@pytest.mark.slow  # two job launches, the first creating the SQLite store's tables: about 25 s on 2 cores
def test_a_requeued_job_keeps_one_tracker_run_with_continuous_steps(tiny_data, tmp_path):
    pytest.importorskip("wandb")
    MlflowClient = pytest.importorskip("mlflow").MlflowClient
    stopped = train(tmp_path, tiny_data, FIXRES_FAULT="signal:rank=1:step=7")  # mid-epoch 2
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    job = tmp_path / "tracked"
    runs = load_checkpoint(job / CHECKPOINT_FILE)["trackers"]
    assert set(runs) == {"mlflow", "wandb"}
    done = train(tmp_path, tiny_data)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "warning" not in done.stdout + done.stderr
    final = load_checkpoint(job / CHECKPOINT_FILE)
    assert final["trackers"] == runs

    uri = trackers.mlflow_uri(TrainerConfig.from_json((job / "config.json").read_text()))
    assert uri == f"sqlite:///{job.absolute()}/mlflow.db"  # the default store, in the job folder
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(trackers.DEFAULT_EXPERIMENT)
    (run,) = client.search_runs([experiment.experiment_id])  # one run for both attempts
    assert run.info.run_id == runs["mlflow"] and run.info.status == "FINISHED"

    def steps(tag: str) -> list[int]:
        return [m.step for m in sorted(client.get_metric_history(run.info.run_id, tag), key=lambda m: m.step)]
    assert steps("train/loss_step") == list(range(0, 160, 16))  # every step once, the 7 before the stop included
    assert steps("train/loss") == steps("eval/top1/32px") == [80, 160]
    evals = [e for e in job_events(job) if e["event"] == "eval"]
    assert [m.value for m in sorted(client.get_metric_history(run.info.run_id, "eval/top1/32px"),
                                    key=lambda m: m.step)] == [e["top1"] for e in evals]

    best = max(evals, key=lambda e: (e["top1"], -e["epoch"]))  # the first epoch reaching the highest top-1
    assert final["best"]["epoch"] == best["epoch"] and final["best"]["value"] == best["top1"]
    assert load_checkpoint(job / BEST_FILE)["epoch"] == best["epoch"]

    attempts = sorted((job / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and {a.name.split("-")[3] for a in attempts} == {runs["wandb"]}


@pytest.mark.slow  # a job launch: over the test command's budget
def test_a_broken_tracking_uri_is_one_warning_and_the_job_ends_normally(few_data, tmp_path):
    pytest.importorskip("mlflow")
    (tmp_path / "a-file").write_text("")
    result = run_script("scratch", "--job-id", "broken", "--shared-folder-path", tmp_path, "--data-path", few_data,
                        "--architecture", "resnet20", "--input-size", 32, "--batch", 4, "--epochs", 1, "--workers", 0,
                        "--no-progress", "--warmup-epochs", 0, "--tracker", "mlflow",
                        "--mlflow-tracking-uri", f"sqlite:///{tmp_path}/a-file/mlflow.db")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    warnings = [line for line in log.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "MLflow tracking could not start" in warnings[0], log[-3000:]
    assert [e["epoch"] for e in job_events(tmp_path / "broken") if e["event"] == "eval"] == [1]
