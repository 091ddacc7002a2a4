"""Never lose work: atomic checkpoints, resume (bit-identical), preemption, dead ranks, hostile inputs."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import time

import pytest
import torch

from conftest import clean_env, make_subset, run_script, start_script
from fixres_dist.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from fixres_dist.launch import main

TRAIN = ["--input-size", "32", "--batch", "8", "--epochs", "2", "--workers", "1", "--no-progress"]


def train(tmp_path, data, job, *extra, fault=None, timeout=300):
    env = clean_env(**({"FIXRES_FAULT": fault} if fault else {}))
    return run_script("scratch", "--num-tasks", 2, "--job-id", job, "--shared-folder-path", tmp_path,
                      "--data-path", data, *TRAIN, *extra, env=env, timeout=timeout)


def final_model(tmp_path, job):
    return load_checkpoint(tmp_path / job / CHECKPOINT_FILE)


def assert_same_parameters(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """Two epochs, two ranks, loader workers, never interrupted."""
    folder = tmp_path_factory.mktemp("straight")
    proc = train(folder, tiny_data, "straight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_model(folder, "straight")


STOPPED = re.compile(r"^fixres_dist: rank (\d): preempted by SIGUSR2; stopped at epoch (\d+), image (\d+), step (\d+): "
                     r"(checkpoint written in |its checkpoint of step \4 in .* is up to date)", re.M)


@pytest.mark.parametrize("fault, extra, stop_step", [
    ("signal:rank=1:step=3", [], 4),  # mid-epoch: the ranks agree in the background, one step late
    ("signal:rank=0:step=2", ["--ckpt-every", 2], 2),  # a checkpoint step agrees at once
    ("signal:rank=1:step=5", [], 5),  # the epoch's last step: the epoch's end agrees at once
])
def test_a_stop_at_a_known_step_is_acted_on_by_all_ranks_together_and_resumes_bit_identical(
        straight, tiny_data, tmp_path, fault, extra, stop_step):
    """The preemption signal on one rank after step S: every rank stops after the same step, S or
    S + 1 (the bound of the pipelined stop check), writes one checkpoint of it, and the rerun ends
    with exactly the parameters of a run never stopped (80 images, 16 a step: 5 steps an epoch)."""
    signalled = int(fault.rsplit("=", 1)[1])
    first = train(tmp_path, tiny_data, "job", *extra, fault=fault)
    assert first.returncode == 3, first.stderr[-3000:]
    ranks = {int(m.group(1)): tuple(map(int, m.group(2, 3, 4))) for m in STOPPED.finditer(first.stderr)}
    images = 16 * stop_step
    assert ranks == {0: (1, images, stop_step), 1: (1, images, stop_step)}, first.stderr[-3000:]
    assert signalled <= stop_step <= signalled + 1
    state = load_checkpoint(tmp_path / "job" / CHECKPOINT_FILE)
    assert (state["epoch"], state["global_step"], state["images_in_epoch"]) == (0, stop_step, images)
    assert len(state["ranks"]) == 2 and state["ranks"][0]["rng"]["torch"].dtype == torch.uint8
    second = train(tmp_path, tiny_data, "job", *extra)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and f"epoch 1, image {images}" in second.stdout
    end = final_model(tmp_path, "job")
    assert_same_parameters(end["model"], straight["model"])
    assert end["global_step"] == straight["global_step"] == 10
    # metrics.jsonl holds each epoch's events once, in order, across the restart
    events = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["epoch"]) for e in events if e["event"] in ("train", "eval")] == \
        [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    # the interrupted epoch's loss covers all its images, before and after the stop
    straight_losses = [e["loss"] for e in straight["metrics"] if e["event"] == "train"]
    assert [e["loss"] for e in events if e["event"] == "train"] == pytest.approx(straight_losses, rel=1e-9)


def test_killed_rank_then_rerun_resumes_from_periodic_checkpoint_bit_identical(straight, tiny_data, tmp_path):
    start = time.monotonic()
    first = train(tmp_path, tiny_data, "job", "--ckpt-every", 3, fault="kill:rank=1:step=7")
    assert first.returncode == 1
    assert "rank 1 was killed by SIGKILL" in first.stderr
    assert time.monotonic() - start < 120
    assert load_checkpoint(tmp_path / "job" / CHECKPOINT_FILE)["global_step"] == 6
    assert len(list((tmp_path / "job").glob("checkpoint-*.pth"))) == 2  # keep the last K=2
    second = train(tmp_path, tiny_data, "job", "--ckpt-every", 3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_parameters(final_model(tmp_path, "job")["model"], straight["model"])
    events = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["epoch"]) for e in events if e["event"] in ("train", "eval")] == \
        [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]  # the killed run's epoch 2 is not repeated


def test_separate_ranks_survivor_names_the_killed_rank(tiny_data, tmp_path):
    common = ["--num-tasks", 2, "--job-id", "k", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              "--dist-timeout", 120, *TRAIN]
    env = clean_env(FIXRES_FAULT="kill:rank=1:step=2")
    rank0 = start_script("scratch", "--global-rank", 0, *common, env=env)
    rank1 = start_script("scratch", "--global-rank", 1, *common, env=env)
    assert rank1.wait(timeout=120) == -signal.SIGKILL
    killed_at = time.monotonic()
    _, err0 = rank0.communicate(timeout=90)
    assert rank0.returncode == 1
    assert time.monotonic() - killed_at < 60
    last = err0.strip().splitlines()[-1]
    assert last.startswith("fixres_dist: rank 0: lost rank 1"), err0[-2000:]
    assert "Traceback" not in err0


def test_a_rank_that_raises_shows_its_traceback_once_and_the_others_stop(tiny_data, tmp_path):
    start = time.monotonic()
    proc = train(tmp_path, tiny_data, "r", fault="raise:rank=1:step=2")
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback") == 1 and "injected fault at step 2" in proc.stderr
    assert "fixres_dist: rank 1: RuntimeError: injected fault at step 2" in proc.stderr
    assert "fixres_dist: rank 0: lost rank 1, which failed: RuntimeError: injected fault at step 2" in proc.stderr
    assert time.monotonic() - start < 120


def test_sigterm_to_one_separately_started_rank_checkpoints_both(tiny_data, tmp_path):
    common = ["--num-tasks", 2, "--job-id", "t", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              "--dist-timeout", 120, *TRAIN[:-3], "--epochs", "30", "--workers", "0", "--no-progress"]
    rank0 = start_script("scratch", "--global-rank", 0, *common)
    rank1 = start_script("scratch", "--global-rank", 1, *common)
    metrics = tmp_path / "t" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"train"' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    rank1.send_signal(signal.SIGTERM)
    _, err1 = rank1.communicate(timeout=60)
    _, err0 = rank0.communicate(timeout=60)
    assert (rank0.returncode, rank1.returncode) == (3, 3), err0[-2000:] + err1[-2000:]
    assert "preempted by SIGTERM" in err1
    state = load_checkpoint(tmp_path / "t" / CHECKPOINT_FILE)
    assert state["epoch"] * 80 + state["images_in_epoch"] >= 80 and len(state["ranks"]) == 2  # epoch 1 trained


@pytest.fixture(scope="module")
def preempted_at_step_3(tiny_data, tmp_path_factory):
    """A 2-rank job folder signalled after step 2 and stopped after step 3 (checkpoint inside), copied by each
    test that resumes it."""
    folder = tmp_path_factory.mktemp("preempted")
    first = train(folder, tiny_data, "w", fault="signal:rank=0:step=2")
    assert first.returncode == 3, first.stderr[-3000:]
    return folder / "w"


@pytest.mark.parametrize("world", [1, 3])
def test_resume_on_another_world_size(tiny_data, tmp_path, world, preempted_at_step_3):
    shutil.copytree(preempted_at_step_3, tmp_path / "w")
    proc = run_script("scratch", "--num-tasks", world, "--job-id", "w", "--shared-folder-path", tmp_path,
                      "--data-path", tiny_data, *TRAIN, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: resuming a 2-rank checkpoint on {world} rank{'s' * (world > 1)}:" in proc.stdout
    assert "epoch 1 continues at image 48 of 80" in proc.stdout  # the stop was acted on after step 3
    assert final_model(tmp_path, "w")["config"]["num_tasks"] == world


def test_another_configuration_is_refused_and_files_are_owner_only(tiny_data, tmp_path):
    assert train(tmp_path, tiny_data, "c", "--epochs", 1).returncode == 0
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "c" / CHECKPOINT_FILE).stat().st_mode) == 0o600
    files = ("checkpoint.pth", "config.json", "metrics.jsonl")
    before = {name: (tmp_path / "c" / name).read_bytes() for name in files}
    proc = train(tmp_path, tiny_data, "c", "--architecture", "resnet34")
    assert proc.returncode == 1
    assert "holds a checkpoint of another configuration (architecture: 'resnet18' -> 'resnet34'" in proc.stderr
    assert {name: (tmp_path / "c" / name).read_bytes() for name in files} == before


# ------------------------------------------------------------------ hostile inputs
@pytest.mark.parametrize("content, message", [
    (b"", "is empty (0 bytes)"),
    ("truncated", "truncated or corrupt"),
    ("future", "checkpoint format 99, newer than this fixres_dist reads"),
])
def test_bad_checkpoint_in_job_folder(tiny_data, tmp_path, content, message, capsys):
    job = tmp_path / "h"
    job.mkdir()
    if content == "truncated":
        torch.save({"model": {"w": torch.zeros(1000)}}, job / CHECKPOINT_FILE)
        data = (job / CHECKPOINT_FILE).read_bytes()
        content = data[: len(data) // 2]
    elif content == "future":
        save_checkpoint(job, {"model": {}, "format_version": 99}, 1)
        content = (job / CHECKPOINT_FILE).read_bytes()
    (job / CHECKPOINT_FILE).write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:  # in this process: preflight refuses before spawning
        main("scratch", ["--num-tasks", "2", "--job-id", "h", "--shared-folder-path", str(tmp_path),
                         "--data-path", str(tiny_data), *TRAIN])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and len(err.splitlines()) == 1
    assert message in err and err.startswith("fixres_dist: rank 0:")
    assert (job / CHECKPOINT_FILE).read_bytes() == content


def test_failed_checkpoint_write_keeps_the_previous_one(tiny_data, tmp_path):
    proc = train(tmp_path, tiny_data, "f", "--ckpt-every", 2, fault="ckpt-write:rank=0:step=4")
    assert proc.returncode == 1
    assert "cannot write checkpoint" in proc.stderr and "No space left on device" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert load_checkpoint(tmp_path / "f" / CHECKPOINT_FILE)["global_step"] == 2
    assert not list((tmp_path / "f").glob(".*tmp"))


@pytest.mark.parametrize("bad", ["zero-byte", "not-an-image"])
def test_unreadable_image_is_named_or_skipped(tmp_path, bad):
    data = make_subset(tmp_path / "data", 4, 2, classes=3)
    victim = data / "train" / "1_trouser" / "broken.png"
    victim.write_bytes(b"" if bad == "zero-byte" else b"this is text, not a PNG")
    common = ["--data-path", data, "--shared-folder-path", tmp_path / "s", *TRAIN[:-5], "--epochs", "1",
              "--workers", "0", "--no-progress"]
    proc = run_script("scratch", "--job-id", "bad", *common)
    assert proc.returncode == 1
    assert f"unreadable image {victim}" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script("scratch", "--job-id", "skip", "--skip-bad-images", *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "s" / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [e.get("skipped_images") for e in events if e["event"] == "train"] == [1]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_ckpt_every_must_be_positive(tmp_path, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main("scratch", ["--ckpt-every", value, "--shared-folder-path", str(tmp_path / "s")])
    assert exit_info.value.code == 1 and "--ckpt-every must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_eight_ranks_on_two_cores_complete(tiny_data, tmp_path):
    proc = run_script("scratch", "--num-tasks", 8, "--job-id", "eight", "--shared-folder-path", tmp_path,
                      "--data-path", tiny_data, "--input-size", 32, "--batch", 4, "--epochs", 1, "--workers", 0,
                      "--no-progress", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_checkpoint(tmp_path / "eight" / CHECKPOINT_FILE)["config"]["num_tasks"] == 8


def test_sigterm_while_waiting_for_peers_exits_promptly(tiny_data, tmp_path):
    proc = start_script("scratch", "--num-tasks", 2, "--global-rank", 0, "--job-id", "wait", "--shared-folder-path",
                        tmp_path, "--data-path", tiny_data, "--dist-timeout", 120, *TRAIN)
    rendezvous = tmp_path / "wait" / "rendezvous.json"
    deadline = time.monotonic() + 60
    while not rendezvous.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "nothing to checkpoint yet" in err
    assert time.monotonic() - sent < 10
    assert not rendezvous.exists()


def test_a_second_run_of_the_same_job_is_refused(tiny_data, tmp_path):
    import fcntl
    (tmp_path / "busy").mkdir(mode=0o700)
    with open(tmp_path / "busy" / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running rank 0 holds it
        proc = run_script("scratch", "--job-id", "busy", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                          *TRAIN, timeout=120)
    assert proc.returncode == 1 and "in use by another run" in proc.stderr
