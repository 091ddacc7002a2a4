"""Never lose work: atomic checkpoints, resume (bit-identical), preemption, dead ranks, hostile inputs."""
from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import stat

import pytest
import torch

from conftest import FAST, SCRATCH, make_subset, run_script, start_script, wait_for
from fixres_dist.entry.launch import main
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint

TRAIN = SCRATCH  # what conftest.scratch_job trained: the runs here are compared with it
SHORT = [*FAST, "--architecture", "resnet20"]  # one epoch of a small model: where the model plays no part


def train(tmp_path, data, job, *extra, fault=None):
    """A 2-rank job of :data:`TRAIN` and ``extra`` flags, with fault ``fault`` (fixres_dist.training.faults)."""
    return run_script("scratch", "--num-tasks", 2, "--job-id", job, "--shared-folder-path", tmp_path,
                      "--data-path", data, *TRAIN, *extra, env={"FIXRES_FAULT": fault} if fault else None)


def final_model(tmp_path, job):
    return load_checkpoint(tmp_path / job / CHECKPOINT_FILE)


def events(job_folder):
    return [json.loads(line) for line in (job_folder / "metrics.jsonl").read_text().splitlines()]


def assert_same_parameters(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def straight(scratch_job):
    """The final checkpoint of two epochs on two ranks with loader workers, never interrupted: the
    session's :func:`conftest.scratch_job`, which trains exactly :data:`TRAIN`."""
    return load_checkpoint(scratch_job / CHECKPOINT_FILE)


STOPPED = re.compile(r"^fixres_dist: rank (\d): preempted by SIGUSR2; stopped at epoch (\d+), image (\d+), step (\d+): "
                     r"(checkpoint written in |its checkpoint of step \4 in .* is up to date)", re.M)


# One job stopped again and again, each stop resumed by the next run: (the fault, that run's extra
# flags, the step after which every rank stops).
STOPS = [
    ("signal:rank=0:step=2", ["--ckpt-every", 2], 2),  # a checkpoint step agrees at once
    ("signal:rank=1:step=3", [], 4),  # mid-epoch: the ranks agree in the background, one step late
    ("signal:rank=1:step=5", [], 5),  # the epoch's last step: the epoch's end agrees at once
]


def assert_resumed_at(run, epoch, image):
    """``run`` resumed from a checkpoint taken at image ``image`` of epoch ``epoch`` (1-based)."""
    assert "resumed from" in run.stdout and f"epoch {epoch}, image {image} of the epoch" in run.stdout, \
        run.stdout[-3000:]


@pytest.mark.numeric
def test_a_job_stopped_and_killed_at_known_steps_resumes_each_time_and_ends_bit_identical(
        straight, tiny_data, tmp_path):
    """The preemption signal on one rank after step S: every rank stops after the same step, S or
    S + 1 (the bound of the pipelined stop check), writes one checkpoint of it, and the rerun resumes
    there (:data:`STOPS`). Then rank 1 is killed after step 7: the launcher stops the other rank, and
    the rerun resumes from the periodic checkpoint of step 6 (--ckpt-every 3). The job ends with
    exactly the parameters of a run never stopped (80 images, 16 a step: 5 steps an epoch); its
    metrics hold each epoch's events once, in order (the killed run's epoch 2 is not repeated), each
    epoch's loss over all its images, and every epoch's speed, also epoch 1's, resumed at its last image."""
    images = None  # where the last stop left epoch 1
    for fault, extra, stop_step in STOPS:
        stopped = train(tmp_path, tiny_data, "job", *extra, fault=fault)
        assert stopped.returncode == 3, stopped.stderr[-3000:]
        if images is not None:
            assert_resumed_at(stopped, 1, images)
        ranks = {int(m.group(1)): tuple(map(int, m.group(2, 3, 4))) for m in STOPPED.finditer(stopped.stderr)}
        images = 16 * stop_step
        assert ranks == {0: (1, images, stop_step), 1: (1, images, stop_step)}, stopped.stderr[-3000:]
        signalled = int(fault.rsplit("=", 1)[1])
        assert signalled <= stop_step <= signalled + 1
        state = load_checkpoint(tmp_path / "job" / CHECKPOINT_FILE)
        assert (state["epoch"], state["global_step"], state["images_in_epoch"]) == (0, stop_step, images)
        assert len(state["ranks"]) == 2 and state["ranks"][0]["rng"]["torch"].dtype == torch.uint8
    killed = train(tmp_path, tiny_data, "job", "--ckpt-every", 3, fault="kill:rank=1:step=7")
    assert killed.returncode == 1
    # the launcher saw the death and stopped the survivor (which would otherwise wait --dist-timeout)
    assert "fixres_dist: rank 1 was killed by SIGKILL; stopped the other ranks" in killed.stderr, killed.stderr[-3000:]
    assert_resumed_at(killed, 1, 80)
    assert load_checkpoint(tmp_path / "job" / CHECKPOINT_FILE)["global_step"] == 6
    kept = sorted(p.name for p in (tmp_path / "job").glob("checkpoint-*.pth"))
    assert kept == ["checkpoint-00000005.pth", "checkpoint-00000006.pth"], kept  # the last K=2 of 2, 4, 5, 6
    last = train(tmp_path, tiny_data, "job", "--ckpt-every", 3)
    assert last.returncode == 0, last.stderr[-3000:]
    assert_resumed_at(last, 2, 16)  # step 6
    end = final_model(tmp_path, "job")
    assert_same_parameters(end["model"], straight["model"])
    assert end["global_step"] == straight["global_step"] == 10
    # metrics.jsonl holds each epoch's events once, in order, across the restarts
    logged = events(tmp_path / "job")
    assert [(e["event"], e["epoch"]) for e in logged if e["event"] in ("train", "eval")] == \
        [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    # each interrupted epoch's loss covers all its images, before and after the stops
    straight_losses = [e["loss"] for e in straight["metrics"] if e["event"] == "train"]
    assert [e["loss"] for e in logged if e["event"] == "train"] == straight_losses  # exact float64 sums
    assert all(e["img_per_s"] > 0 for e in logged if e["event"] == "train")


def test_separate_ranks_survivor_names_the_killed_rank(tiny_data, tmp_path):
    common = ["--num-tasks", 2, "--job-id", "k", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              "--dist-timeout", 120, *SHORT]
    env = {"FIXRES_FAULT": "kill:rank=1:step=2"}
    rank0 = start_script("scratch", "--global-rank", 0, *common, env=env)
    rank1 = start_script("scratch", "--global-rank", 1, *common, env=env)
    assert rank1.wait(timeout=120) == -signal.SIGKILL
    _, err0 = rank0.communicate(timeout=90)  # < --dist-timeout 120: it saw the loss, it did not time out
    assert rank0.returncode == 1
    last = err0.strip().splitlines()[-1]
    assert last.startswith("fixres_dist: rank 0: lost rank 1"), err0[-2000:]
    assert "Traceback" not in err0


def test_a_rank_that_raises_shows_its_traceback_once_and_the_others_stop(tiny_data, tmp_path):
    proc = train(tmp_path, tiny_data, "r", "--architecture", "resnet20", fault="raise:rank=1:step=2")
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback") == 1 and "injected fault at step 2" in proc.stderr
    assert "fixres_dist: rank 1: RuntimeError: injected fault at step 2" in proc.stderr
    assert "fixres_dist: rank 0: lost rank 1, which failed: RuntimeError: injected fault at step 2" in proc.stderr


def test_sigterm_to_one_separately_started_rank_checkpoints_both(tiny_data, tmp_path):
    common = ["--num-tasks", 2, "--job-id", "t", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
              "--dist-timeout", 120, *SHORT, "--epochs", 30]  # the last --epochs counts
    rank0 = start_script("scratch", "--global-rank", 0, *common)
    rank1 = start_script("scratch", "--global-rank", 1, *common)
    metrics = tmp_path / "t" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and '"train"' in metrics.read_text(), 240, "epoch 1's train event")
    rank1.send_signal(signal.SIGTERM)
    _, err1 = rank1.communicate(timeout=60)
    _, err0 = rank0.communicate(timeout=60)
    assert (rank0.returncode, rank1.returncode) == (3, 3), err0[-2000:] + err1[-2000:]
    assert "preempted by SIGTERM" in err1
    state = load_checkpoint(tmp_path / "t" / CHECKPOINT_FILE)
    assert state["epoch"] * 80 + state["images_in_epoch"] >= 80 and len(state["ranks"]) == 2  # epoch 1 trained


@pytest.fixture(scope="module")
def preempted_at_step_3(tiny_data, tmp_path_factory):
    """A 2-rank job folder (:data:`SHORT`: 1 epoch of 5 steps) signalled after step 2 and stopped
    after step 3 (checkpoint inside), copied by each test that resumes it."""
    folder = tmp_path_factory.mktemp("preempted")
    first = run_script("scratch", "--num-tasks", 2, "--job-id", "w", "--shared-folder-path", folder,
                       "--data-path", tiny_data, *SHORT, env={"FIXRES_FAULT": "signal:rank=0:step=2"})
    assert first.returncode == 3, first.stderr[-3000:]
    return folder / "w"


@pytest.mark.parametrize("world", [1, 3, 8])
def test_resume_on_another_world_size(tiny_data, tmp_path, world, preempted_at_step_3):
    """A 2-rank checkpoint resumes on 1 rank, on 3 (which do not divide 80 images) and on 8, which
    complete on 2 cores: the checkpoint written is the 8-rank job's."""
    shutil.copytree(preempted_at_step_3, tmp_path / "w")
    proc = run_script("scratch", "--num-tasks", world, "--job-id", "w", "--shared-folder-path", tmp_path,
                      "--data-path", tiny_data, *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    host = socket.gethostname()
    assert f"world change: 2 ranks on {host} -> {world} rank{'s' * (world > 1)} on {host}: " in proc.stdout
    assert "epoch 1 continues at image 48 of 80" in proc.stdout  # the stop was acted on after step 3
    assert final_model(tmp_path, "w")["config"]["num_tasks"] == world


def test_another_configuration_is_refused_and_files_are_owner_only(scratch_job, tiny_data, tmp_path):
    """A finished job's folder and checkpoint are owner-only; a run of another configuration in it is
    refused and changes none of its files (on a copy of the session's :func:`conftest.scratch_job`)."""
    assert stat.S_IMODE(scratch_job.stat().st_mode) == 0o700
    assert stat.S_IMODE((scratch_job / CHECKPOINT_FILE).stat().st_mode) == 0o600
    shutil.copytree(scratch_job, tmp_path / "c")
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
    proc = train(tmp_path, tiny_data, "f", "--ckpt-every", 2, "--architecture", "resnet20",
                 fault="ckpt-write:rank=0:step=4")
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
    common = ["--data-path", data, "--shared-folder-path", tmp_path / "s", *SHORT]
    proc = run_script("scratch", "--job-id", "bad", *common)
    assert proc.returncode == 1
    assert f"unreadable image {victim}" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script("scratch", "--job-id", "skip", "--skip-bad-images", *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [e.get("skipped_images") for e in events(tmp_path / "s" / "skip") if e["event"] == "train"] == [1]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_ckpt_every_must_be_positive(tmp_path, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main("scratch", ["--ckpt-every", value, "--shared-folder-path", str(tmp_path / "s")])
    assert exit_info.value.code == 1 and "--ckpt-every must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_sigterm_while_waiting_for_peers_exits_promptly(tiny_data, tmp_path):
    proc = start_script("scratch", "--num-tasks", 2, "--global-rank", 0, "--job-id", "wait", "--shared-folder-path",
                        tmp_path, "--data-path", tiny_data, "--dist-timeout", 120, *SHORT)
    rendezvous = tmp_path / "wait" / "rendezvous.json"
    waiting = tmp_path / "wait" / "rendezvous.json.rank0"  # rank 0 announced itself and waits for rank 1's
    wait_for(waiting.exists, 240, "rank 0 to wait for its peers")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)  # < --dist-timeout 120: the signal, not the timeout, ended the wait
    assert proc.returncode == 3 and "nothing to checkpoint yet" in err, err[-2000:]
    assert not rendezvous.exists() and not waiting.exists()


def test_a_second_run_of_the_same_job_is_refused(tiny_data, tmp_path):
    import fcntl
    (tmp_path / "busy").mkdir(mode=0o700)
    with open(tmp_path / "busy" / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running rank 0 holds it
        proc = run_script("scratch", "--job-id", "busy", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                          *SHORT)
    assert proc.returncode == 1 and "in use by another run" in proc.stderr
