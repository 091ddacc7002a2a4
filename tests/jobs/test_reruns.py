"""Reruns: the same command resumes (job identity), a live job is not launched twice, reruns never go
backwards, rank variables that disagree are refused, and a resume on more ranks always runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST, ROOT, clean_env, free_port, run_main, run_script, start_script, wait_for
from fixres_dist.config import FILE_INDEX_FOLDER, TrainerConfig
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint

# A small model: what these runs show does not depend on it.
TRAIN = ["--input-size", "32", "--batch", "8", "--epochs", "2", "--workers", "0", "--no-progress",
         "--architecture", "resnet20"]
SMALL = [*FAST, "--architecture", "resnet20"]  # one epoch


def job_folders(shared):
    return sorted(p.name for p in shared.iterdir() if p.is_dir() and p.name != FILE_INDEX_FOLDER)


def events(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ job identity
def test_the_same_command_resumes_without_a_job_id_and_another_gets_its_own_folder(tiny_data, tmp_path):
    command = ["--num-tasks", 2, "--shared-folder-path", tmp_path, "--data-path", tiny_data, *TRAIN]
    first = run_script("scratch", *command, env={"FIXRES_FAULT": "signal:rank=0:step=3"})
    assert first.returncode == 3, first.stderr[-3000:]
    [job] = job_folders(tmp_path)
    assert job.startswith("scratch-resnet20-") and f"job {job} (derived from the configuration" in first.stdout
    again = run_script("scratch", *command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "step 4" in again.stdout  # signalled after step 3, acted on after 4
    assert job_folders(tmp_path) == [job]
    assert [(e["event"], e["epoch"]) for e in events(tmp_path / job) if e["event"] != "step_times"] == \
        [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    assert all(isinstance(e["time"], float) for e in events(tmp_path / job))  # kept across the resume's rewrite
    # Another data folder spelling, another world size and loader workers: the same job (nothing to do).
    spelt = os.path.relpath(tiny_data, tmp_path) + "/"
    same = run_script("scratch", "--num-tasks", 1, "--shared-folder-path", tmp_path, "--data-path", spelt,
                      *TRAIN, "--workers", 1, cwd=tmp_path)  # the last --workers counts
    assert same.returncode == 0, same.stderr[-3000:]
    assert "already completed its 2 epochs" in same.stdout and job_folders(tmp_path) == [job]
    # Another configuration: its own job (stopped after its first step: its folder is all this shows).
    other = run_script("scratch", *command, "--seed", 1, env={"FIXRES_FAULT": "signal:rank=0:step=1"})
    assert other.returncode == 3, other.stderr[-3000:]
    assert len(job_folders(tmp_path)) == 2


def test_torchrun_ranks_agree_on_one_job_folder_and_reruns_find_it(tiny_data, tmp_path):
    """Real torchrun launches (its agent, its variables): the 2 ranks of a launch without --job-id
    derive one job folder (2 ranks, env://); a rerun, with torchrun's other rendezvous (a fixed
    --master-port instead of --standalone), finds that job, completed. Rank 0 uses the agent's store
    instead of binding its port a second time."""
    def torchrun(*rendezvous):
        cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", "2",
               str(ROOT / "main_scratch.py"), "--shared-folder-path", str(tmp_path), "--data-path", str(tiny_data),
               *map(str, SMALL)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    first = torchrun("--standalone")
    assert first.returncode == 0, first.stderr[-3000:]
    [job] = job_folders(tmp_path)
    config = TrainerConfig.from_json((tmp_path / job / "config.json").read_text())
    assert config.num_tasks == 2 and config.dist_url == "env://"
    second = torchrun("--master-port", str(free_port()))
    assert second.returncode == 0, second.stderr[-3000:]
    assert job_folders(tmp_path) == [job] and "already completed" in second.stdout
    for proc in (first, second):
        assert "failed to bind" not in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ one live launch per job
def test_a_second_launch_of_a_live_job_is_refused_at_once(tiny_data, tmp_path):
    command = ["--num-tasks", 2, "--job-id", "live", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
               *TRAIN, "--epochs", 30]  # the last --epochs counts
    first = start_script("scratch", *command)
    folder = tmp_path / "live"

    def trained_an_epoch():
        assert first.poll() is None, first.stderr[-3000:]
        return (folder / "metrics.jsonl").exists() and "train" in (folder / "metrics.jsonl").read_text()

    wait_for(trained_an_epoch, 240, "the first job's first epoch")
    for second_command in (command, ["--global-rank", 1, *command]):  # the whole job again, or one rank of it
        second = run_script("scratch", *second_command)
        # refused by the live job's lock, in one line, before any rendezvous (none waits for peers)
        assert second.returncode == 1 and "in use" in second.stderr, second.stderr[-3000:]
        assert len(second.stderr.strip().splitlines()) == 1
    assert not (folder / "rendezvous.json").exists()
    first.send_signal(15)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 3, err[-3000:]  # undisturbed: it trained on and checkpoints as usual
    assert load_checkpoint(folder / CHECKPOINT_FILE)["config"]["num_tasks"] == 2


def test_a_rank_started_twice_is_refused_and_the_job_runs(tiny_data, tmp_path):
    """Two processes started as rank 1 of one job (each in a shell of its own, say): one is refused,
    the job runs with the other, which says when it has met its peers (rank 0 logs the run).
    A 3-rank job whose rank 2 starts only once one rank 1 has been refused: the rendezvous stays open
    for both rank-1 processes, however late either starts (it closes once every rank has met)."""
    common = ["--num-tasks", 3, "--job-id", "twice", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              "--dist-timeout", 120, *SMALL]
    zero = start_script("scratch", "--global-rank", 0, *common)
    ones = [start_script("scratch", "--global-rank", 1, *common) for _ in range(2)]
    refused = wait_for(lambda: next((p for p in ones if p.poll() is not None), None), 150,
                       "one of the two rank-1 processes to end")
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert "already joined this job as rank 1" in refused.stderr or "in use" in refused.stderr, refused.stderr
    two = start_script("scratch", "--global-rank", 2, *common)
    _, err0 = zero.communicate(timeout=240)
    assert zero.returncode == 0, err0[-3000:]
    joined = next(p for p in ones if p is not refused)
    assert (joined.wait(timeout=120), two.wait(timeout=120)) == (0, 0), joined.stderr[-2000:] + two.stderr[-2000:]
    assert "fixres_dist: rank 1 of 3 met its peers (job twice)" in joined.stdout, joined.stdout[-3000:]


# ------------------------------------------------------------------ reruns never go backwards
def test_a_rerun_carrying_resume_continues_from_the_jobs_own_newer_checkpoint(tiny_data, tmp_path):
    old = run_script("scratch", "--num-tasks", 2, "--job-id", "old", "--shared-folder-path", tmp_path,
                     "--data-path", tiny_data, *TRAIN, "--ckpt-every", 1, env={"FIXRES_FAULT": "signal:rank=0:step=2"})
    assert old.returncode == 3, old.stderr[-3000:]
    named = tmp_path / "old" / "checkpoint-00000001.pth"  # the file --resume names, inside the job's own folder
    command = ["--num-tasks", 2, "--job-id", "old", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
               *TRAIN, "--ckpt-every", 1, "--keep-checkpoints", 1, "--resume", named]
    rerun = run_script("scratch", *command, env={"FIXRES_FAULT": "signal:rank=0:step=6"})
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
    command = ["--job-id", "m", "--shared-folder-path", tmp_path, "--data-path", tiny_data, *SMALL, "--batch", 26]
    first = run_script("scratch", *command, env={"FIXRES_FAULT": "signal:rank=0:step=3"})
    assert first.returncode == 3, first.stderr[-3000:]
    assert load_checkpoint(tmp_path / "m" / CHECKPOINT_FILE)["images_in_epoch"] == 78  # of 80
    resumed = run_script("scratch", "--num-tasks", 3, *command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "its last 2 images left out: fewer than 2 per rank after resuming on 3 ranks" in resumed.stdout
    train = [e for e in events(tmp_path / "m") if e["event"] == "train"]
    assert train[0]["left_out_images"] == 2 and train[0]["img_per_s"] > 0


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
