"""Reruns: the same command resumes (job identity), a live job is not launched twice, reruns never go
backwards, rank variables that disagree are refused, and a resume on more ranks always runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import FAST, ROOT, clean_env, run_main, run_script, start_script
from fixres_dist.checkpoint import CHECKPOINT_FILE, load_checkpoint
from fixres_dist.config import FILE_INDEX_FOLDER

TRAIN = ["--input-size", "32", "--batch", "8", "--epochs", "2", "--workers", "0", "--no-progress"]


def job_folders(shared):
    return sorted(p.name for p in shared.iterdir() if p.is_dir() and p.name != FILE_INDEX_FOLDER)


def events(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ job identity
def test_the_same_command_resumes_without_a_job_id_and_another_gets_its_own_folder(tiny_data, tmp_path):
    command = ["--num-tasks", 2, "--shared-folder-path", tmp_path, "--data-path", tiny_data, *TRAIN]
    first = run_script("scratch", *command, env=clean_env(FIXRES_FAULT="signal:rank=0:step=3"))
    assert first.returncode == 3, first.stderr[-3000:]
    [job] = job_folders(tmp_path)
    assert job.startswith("scratch-resnet18-") and f"job {job} (derived from the configuration" in first.stdout
    again = run_script("scratch", *command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "step 4" in again.stdout  # signalled after step 3, acted on after 4
    assert job_folders(tmp_path) == [job]
    assert [(e["event"], e["epoch"]) for e in events(tmp_path / job)] == [("train", 1), ("eval", 1), ("train", 2),
                                                                          ("eval", 2)]
    assert all(isinstance(e["time"], float) for e in events(tmp_path / job))  # kept across the resume's rewrite
    # Another data folder spelling, another world size and loader workers: the same job (nothing to do).
    spelt = os.path.relpath(tiny_data, tmp_path) + "/"
    same = run_script("scratch", "--num-tasks", 1, "--shared-folder-path", tmp_path, "--data-path", spelt,
                      *TRAIN[:-3], "--workers", 1, "--no-progress", cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "already completed its 2 epochs" in same.stdout and job_folders(tmp_path) == [job]
    other = run_script("scratch", *command, "--seed", 1)  # another configuration: its own job
    assert other.returncode == 0, other.stderr[-3000:]
    assert len(job_folders(tmp_path)) == 2


def test_torchrun_reruns_find_the_same_job(tiny_data, tmp_path):
    def torchrun():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "main_scratch.py"), "--shared-folder-path", str(tmp_path), "--data-path", str(tiny_data),
               *map(str, FAST)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    first, second = torchrun(), torchrun()
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    assert len(job_folders(tmp_path)) == 1 and "already completed" in second.stdout
    for proc in (first, second):  # rank 0 uses the agent's store instead of binding its port a second time
        assert "failed to bind" not in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ one live launch per job
def test_a_second_launch_of_a_live_job_is_refused_at_once(tiny_data, tmp_path):
    command = ["--num-tasks", 2, "--job-id", "live", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
               "--input-size", 32, "--batch", 8, "--epochs", 30, "--workers", 0, "--no-progress"]
    first = start_script("scratch", *command)
    folder = tmp_path / "live"
    deadline = time.monotonic() + 180
    while not ((folder / "metrics.jsonl").exists() and "train" in (folder / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.2)
    for second_command in (command, ["--global-rank", 1, *command]):  # the whole job again, or one rank of it
        started = time.monotonic()
        second = run_script("scratch", *second_command, timeout=60)
        assert second.returncode == 1 and "in use" in second.stderr, second.stderr[-3000:]
        assert len(second.stderr.strip().splitlines()) == 1 and time.monotonic() - started < 30
    assert not (folder / "rendezvous.json").exists()
    first.send_signal(15)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 3, err[-3000:]  # undisturbed: it trained on and checkpoints as usual
    assert load_checkpoint(folder / CHECKPOINT_FILE)["config"]["num_tasks"] == 2


def test_a_rank_started_twice_is_refused_and_the_job_runs(tiny_data, tmp_path):
    common = ["--num-tasks", 2, "--job-id", "twice", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              "--dist-timeout", 120, *FAST]
    ones = [start_script("scratch", "--global-rank", 1, *common) for _ in range(2)]
    zero = start_script("scratch", "--global-rank", 0, *common)
    _, err0 = zero.communicate(timeout=240)
    results = [(p.wait(timeout=120), p.stderr.read()) for p in ones]
    assert zero.returncode == 0, err0[-3000:]
    assert sorted(code for code, _ in results) == [0, 1], results
    refused = next(err for code, err in results if code == 1)
    assert "already joined this job as rank 1" in refused or "in use" in refused, refused


# ------------------------------------------------------------------ reruns never go backwards
def test_a_rerun_carrying_resume_continues_from_the_jobs_own_newer_checkpoint(tiny_data, tmp_path):
    old = run_script("scratch", "--num-tasks", 2, "--job-id", "old", "--shared-folder-path", tmp_path,
                     "--data-path", tiny_data, *TRAIN, "--ckpt-every", 1, env=clean_env(FIXRES_FAULT="signal:rank=0:step=2"))
    assert old.returncode == 3, old.stderr[-3000:]
    named = tmp_path / "old" / "checkpoint-00000001.pth"  # the file --resume names, inside the job's own folder
    command = ["--num-tasks", 2, "--job-id", "old", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
               *TRAIN, "--ckpt-every", 1, "--keep-checkpoints", 1, "--resume", named]
    rerun = run_script("scratch", *command, env=clean_env(FIXRES_FAULT="signal:rank=0:step=6"))
    assert rerun.returncode == 3, rerun.stderr[-3000:]
    assert f"--resume {named} not used" in rerun.stdout and "step 2" in rerun.stdout
    assert named.exists(), "keep-last-K deleted the checkpoint that --resume names"
    again = run_script("scratch", *command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step 6" in again.stdout and named.exists()
    assert sorted(p.name for p in (tmp_path / "old").glob("checkpoint-*.pth")) == \
        ["checkpoint-00000001.pth", "checkpoint-00000010.pth"]


# ------------------------------------------------------------------ resume on more ranks
def test_a_one_rank_checkpoint_with_two_images_left_resumes_on_three_ranks(tiny_data, tmp_path):
    command = ["--job-id", "m", "--shared-folder-path", tmp_path, "--data-path", tiny_data, "--input-size", 32,
               "--batch", 26, "--epochs", 2, "--workers", 0, "--no-progress"]
    first = run_script("scratch", *command, env=clean_env(FIXRES_FAULT="signal:rank=0:step=3"))
    assert first.returncode == 3, first.stderr[-3000:]
    assert load_checkpoint(tmp_path / "m" / CHECKPOINT_FILE)["images_in_epoch"] == 78  # of 80
    resumed = run_script("scratch", "--num-tasks", 3, *command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "its last 2 images left out: fewer than 2 per rank after resuming on 3 ranks" in resumed.stdout
    train = [e for e in events(tmp_path / "m") if e["event"] == "train"]
    assert train[0]["left_out_images"] == 2 and train[0]["img_per_s"] > 0


def test_resuming_at_the_last_image_of_an_epoch_reports_the_epochs_speed(tiny_data, tmp_path):
    command = ["--num-tasks", 2, "--job-id", "end", "--shared-folder-path", tmp_path, "--data-path", tiny_data, *TRAIN]
    first = run_script("scratch", *command, env=clean_env(FIXRES_FAULT="signal:rank=1:step=5"))
    assert first.returncode == 3, first.stderr[-3000:]
    assert load_checkpoint(tmp_path / "end" / CHECKPOINT_FILE)["images_in_epoch"] == 80
    second = run_script("scratch", *command)
    assert second.returncode == 0, second.stderr[-3000:]
    train = [e for e in events(tmp_path / "end") if e["event"] == "train"]
    assert [e["epoch"] for e in train] == [1, 2] and train[0]["img_per_s"] > 0


# ------------------------------------------------------------------ rank variables
@pytest.mark.parametrize("env, args, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--num-tasks", 4], "partial torchrun variables: RANK=0, WORLD_SIZE=2 set"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, [], "but LOCAL_RANK not"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
      "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, [], "WORLD_SIZE=2 (torchrun variables) conflicts with SLURM_NTASKS=1"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, ["--num-tasks", 2, "--global-rank", 0],
     "--global-rank 0 (command line) conflicts with SLURM_PROCID=1"),
])
def test_rank_variables_that_disagree_are_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, env, args,
                                                                          message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = run_main(capsys, "scratch", *args, "--shared-folder-path", tmp_path / "s")
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def test_a_separately_started_rank_says_when_it_has_met_its_peers(tiny_data, tmp_path):
    common = ["--num-tasks", 2, "--job-id", "say", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              *FAST]
    rank1 = start_script("scratch", "--global-rank", 1, *common)
    rank0 = start_script("scratch", "--global-rank", 0, *common)
    out1, err1 = rank1.communicate(timeout=240)
    rank0.communicate(timeout=60)
    assert rank1.returncode == 0, err1[-3000:]
    assert "fixres_dist: rank 1 of 2 met its peers (job say)" in out1
