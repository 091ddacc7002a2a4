"""TensorBoard event files (fixres_dist.reporting.tensorboard_events): real files written by SummaryWriter,
read back with TensorBoard's own loader, including a run interrupted after its checkpoint and resumed."""
from __future__ import annotations

import json
import multiprocessing
import os
import resource
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator

from fixres_dist.entry.launch import start_method
from fixres_dist.errors import FixresError
from fixres_dist.reporting.metrics import MetricsLog
from fixres_dist.reporting.tensorboard_events import (
    FOLDER,
    TensorBoardLog,
    check_available,
    check_folder,
    event_scalars,
)


def load(job) -> EventAccumulator:
    """Every value TensorBoard's Python loader shows for the job folder ``job`` (no sampling)."""
    acc = EventAccumulator(str(job / FOLDER), size_guidance={SCALARS: 0, IMAGES: 0})
    acc.Reload()
    return acc


def curve(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(s.step, s.value) for s in acc.Scalars(tag)]


def train(epoch, loss):
    return MetricsLog.event("train", epoch=epoch, loss=loss, lr=0.1 * epoch, img_per_s=1000.0 + epoch)


def evaluation(epoch, top1, resolution=32, label="", event="eval"):
    return MetricsLog.event(event, epoch=epoch, resolution=resolution, top1=top1, top5=top1 + 1, loss=2.0,
                            images=100, **({"label": label} if label else {}))


def test_tags_and_steps(tmp_path):
    with TensorBoardLog(tmp_path, images_per_epoch=50) as log:
        log.event(evaluation(0, 10.0, 32, "train-resolution"))
        log.event(evaluation(0, 11.0, 48, "before"))
        for images in range(0, 50, 10):
            log.step_scalars(images, loss=3.0 - images / 100, lr=0.01 * images)
        log.event(train(1, 2.5))
        log.event(evaluation(1, 20.0, 48))
        log.event(evaluation(1, 21.0, 48, event="ema_eval"))
        log.event(evaluation(1, 22.0, 64, "after", event="ema_eval"))
        log.event(MetricsLog.event("sweep", run="x", best_resolution=48))  # no scalars: ignored
        log.event({**evaluation(2, 30.0), "top5": None})  # null (non-finite) in metrics.jsonl: left out
    acc = load(tmp_path)
    assert set(acc.Tags()["scalars"]) == {
        "train/loss_step", "train/lr_step", "train/loss", "train/lr", "train/img_per_s",
        *(f"{group}/{name}/{res}" for group, res in [("eval_train_resolution", "32px"), ("eval_before", "48px"),
                                                      ("eval", "48px"), ("eval_ema", "48px"),
                                                      ("eval_ema_after", "64px"), ("eval", "32px")]
          for name in ("top1", "top5", "loss"))} - {"eval/top5/32px"}
    assert curve(acc, "train/loss_step") == [(i, pytest.approx(3.0 - i / 100)) for i in range(0, 50, 10)]
    assert curve(acc, "train/loss") == [(50, 2.5)]
    assert curve(acc, "train/img_per_s") == [(50, 1001.0)]
    assert curve(acc, "eval_before/top1/48px") == [(0, 11.0)]
    assert curve(acc, "eval/top1/48px") == [(50, 20.0)]
    assert curve(acc, "eval_ema/top5/48px") == [(50, 22.0)]
    assert curve(acc, "eval_ema_after/top1/64px") == [(50, 22.0)]
    assert curve(acc, "eval/top1/32px") == [(100, 30.0)]


def test_event_scalars_ignores_events_without_scalars():
    assert event_scalars(MetricsLog.event("input_size", resolution=64, rule="best"), 10) is None
    assert event_scalars(MetricsLog.event("diverged", epoch=1, step=3, reason="nan"), 10) is None
    step, scalars = event_scalars(evaluation(3, 50.0, 40, "sweep"), 10)
    assert step == 30 and dict(scalars) == {"eval_sweep/top1/40px": 50.0, "eval_sweep/top5/40px": 51.0,
                                            "eval_sweep/loss/40px": 2.0}


def test_resume_hides_what_the_interrupted_run_wrote_after_its_checkpoint(tmp_path):
    """3 images an epoch, one image a step. Run 1 logs steps 0..10 and epochs 1-3 (ends at 3, 6, 9),
    checkpoints at 6 after epoch 2's events, and dies at 10. Run 2 resumes at 6: replays the history's
    events at >= 6 (epoch 2's) and logs steps 6..12 and epochs 3-4 with its own values (200 + x)."""
    history = [evaluation(0, 5.0, label="before")]
    first = TensorBoardLog(tmp_path, images_per_epoch=3)
    first.event(history[0])
    for images in range(11):
        first.step_scalars(images, loss=100.0 + images, lr=1.0)
        if (images + 1) % 3 == 0:
            epoch = (images + 1) // 3
            events = [train(epoch, 100.0 + epoch), evaluation(epoch, 100.0 + epoch)]
            for e in events:
                first.event(e)
            if epoch <= 2:  # recorded before the checkpoint at 6
                history += events
    first.close()  # killed at step 10: what it wrote after 6 is stale

    second = TensorBoardLog(tmp_path, images_per_epoch=3, resume_at=6)
    assert second.replay(history, since=6) == 2
    for images in range(6, 13):
        second.step_scalars(images, loss=200.0 + images, lr=2.0)
        if (images + 1) % 3 == 0:
            epoch = (images + 1) // 3
            second.event(train(epoch, 200.0 + epoch))
            second.event(evaluation(epoch, 200.0 + epoch))
    second.close()

    files = sorted(p.name for p in (tmp_path / FOLDER).iterdir())
    assert len(files) == 2 and files[0].split(".")[3] < files[1].split(".")[3]  # the resumed run's sorts last
    acc = load(tmp_path)
    for tag in acc.Tags()["scalars"]:
        steps = [s for s, _ in curve(acc, tag)]
        assert steps == sorted(set(steps)), tag  # strictly increasing: nothing twice
    assert curve(acc, "train/loss_step") == [(i, 100.0 + i) for i in range(6)] + [(i, 200.0 + i) for i in range(6, 13)]
    assert curve(acc, "train/lr_step") == [(i, 1.0 if i < 6 else 2.0) for i in range(13)]
    # epoch 2 (at 6) is the checkpoint's, written again by replay; epochs 3 and 4 are the resumed run's
    assert curve(acc, "train/loss") == [(3, 101.0), (6, 102.0), (9, 203.0), (12, 204.0)]
    assert curve(acc, "eval/top1/32px") == [(3, 101.0), (6, 102.0), (9, 203.0), (12, 204.0)]
    assert curve(acc, "eval_before/top1/32px") == [(0, 5.0)]
    replayed = acc.Scalars("train/loss")[1]
    assert replayed.wall_time == pytest.approx(history[3]["time"])  # at its recorded time


def test_restart_without_checkpoint_hides_the_earlier_attempt(tmp_path):
    with TensorBoardLog(tmp_path, images_per_epoch=4) as log:
        for images in range(8):
            log.step_scalars(images, loss=1.0, lr=0.1)
    with TensorBoardLog(tmp_path, images_per_epoch=4) as log:  # resume_at 0: nothing of the first kept
        log.step_scalars(0, loss=2.0, lr=0.1)
    assert curve(load(tmp_path), "train/loss_step") == [(0, 2.0)]


def test_figure_is_stored_as_an_image(tmp_path):
    fig = Figure(figsize=(4, 3), dpi=50)
    fig.add_subplot().plot([32, 48, 64], [20.0, 30.0, 25.0], marker="o")
    with TensorBoardLog(tmp_path, images_per_epoch=10) as log:
        log.figure("resolution_sweep", fig, 40)
    [image] = load(tmp_path).Images("resolution_sweep")
    assert (image.step, image.width, image.height) == (40, 200, 150)
    assert image.encoded_image_string.startswith(b"\x89PNG")
    assert fig.axes  # still the owner's figure


def test_missing_package_is_one_line(tmp_path, monkeypatch):
    check_available()
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an import of a missing package sees
    for attempt in (check_available, lambda: TensorBoardLog(tmp_path, images_per_epoch=10)):
        with pytest.raises(FixresError) as info:
            attempt()
        assert "\n" not in str(info.value) and "pip install -e '.[tensorboard]'" in str(info.value)
    assert not (tmp_path / FOLDER).exists()


def test_broken_torch_tensorboard_import_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(FixresError, match=r"cannot import tensorboard .*pip install -e '\.\[tensorboard\]'$"):
        TensorBoardLog(tmp_path, images_per_epoch=10)


def test_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "job"
    blocker.write_text("a file where the job folder should be")
    with pytest.raises(FixresError, match="cannot write TensorBoard events in"):
        TensorBoardLog(blocker, images_per_epoch=10)


@pytest.mark.parametrize("make, message", [
    (lambda folder: folder.write_text("not a folder"), "it is a file, not a folder"),
    (lambda folder: folder.symlink_to(folder.parent / "gone"), "which does not exist"),
])
def test_a_tensorboard_path_that_cannot_hold_events_is_refused_before_anything_starts(tmp_path, make, message):
    job = tmp_path / "job"
    job.mkdir()
    check_folder(job)  # absent: the run makes it
    (job / FOLDER).mkdir()
    check_folder(job)  # a folder: used
    (job / FOLDER).rmdir()
    make(job / FOLDER)
    with pytest.raises(FixresError, match=message):
        check_folder(job)


def _write_until_the_disk_is_full(folder: Path, report: Path) -> None:
    """In a process of its own (its stderr: ``report``.err): a TensorBoard log whose files may not
    grow past 4 KiB once it is open, written and flushed 2,000 times; ``report`` gets what it saw."""
    err = os.open(f"{report}.err", os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(err, 2)
    failures = []
    log = TensorBoardLog(folder, images_per_epoch=10, flush_secs=0.01, on_failure=failures.append)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # from here on, a file cannot grow past 4 KiB
    for step in range(2000):
        log.step_scalars(step, loss=1.0, lr=0.1)
        log.flush()
    log.close()
    sys.stderr.flush()
    report.write_text(json.dumps({"failures": failures, "failed": log.failed is not None}))


def test_a_write_that_fails_mid_run_stops_the_log_once_without_a_traceback(tmp_path):
    """A full disk (here: a file-size limit, EFBIG, in a process of its own) while the run goes on:
    on_failure is told once, in one line, every later call does nothing, and neither the writer's
    thread nor the caller shows a traceback."""
    report = tmp_path / "report.json"
    process = multiprocessing.get_context(start_method()).Process(target=_write_until_the_disk_is_full,
                                                                  args=(tmp_path / "job", report))
    process.start()
    process.join(120)
    if process.is_alive():  # hung: it does not outlive the test
        process.kill()
        process.join()
    assert process.exitcode == 0, Path(f"{report}.err").read_text()[-3000:]
    seen, stderr = json.loads(report.read_text()), Path(f"{report}.err").read_text()
    assert len(seen["failures"]) == 1 and seen["failed"]
    assert seen["failures"][0].startswith("TensorBoard events stopped (File too large) in ")
    assert "\n" not in seen["failures"][0]
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr
