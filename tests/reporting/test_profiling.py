"""--profile (issue 27, in part): a torch.profiler trace of a window of training steps on every rank,
readable as a Chrome trace, with each rank's top operators, owner-only; a window beyond the run refused;
a disk that fills up as the traces are written costs the profile, not the run."""
from __future__ import annotations

import json
import re
import shutil
import stat

import pytest

import shown_commands as shown
from conftest import SCRATCH, run_main, run_script, tmpfs
from fixres_dist import FixresError, TrainerConfig
from fixres_dist.reporting import profiling


def test_each_rank_writes_the_trace_of_its_window_and_its_top_operators(tiny_data, tmp_path):
    """docs/profiling.md's command on tiny_data (10 steps of 8 images on each of 2 ranks): 3 steps after
    5, as a Chrome trace per rank that json reads (torch.profiler's own format: traceEvents), three
    ProfilerStep spans in it, and the top operators as text."""
    shown_command = shown.command("python main_scratch.py --num-tasks 2 --architecture resnet20 --epochs 1 --profile")
    command = shown.argv(shown_command)
    result = run_script("scratch", *command[2:], "--data-path", tiny_data, "--shared-folder-path", tmp_path,
                        "--batch", 4, "--input-size", 32, "--workers", 0, "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "profiled" / "profile"
    assert f"profile: {folder} (a Chrome trace and the top operators of each rank" in result.stdout
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert len(modes) == 4 and set(modes.values()) == {0o600}, modes  # as every file of the job folder
    for rank in (0, 1):
        [trace] = folder.glob(f"rank{rank}.*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#5", "ProfilerStep#6", "ProfilerStep#7"], steps
        assert any(e.get("name") == "aten::convolution" for e in events)
        table = (folder / f"rank{rank}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
    profiling.draw_trace(trace, tmp_path / "timeline.png", "rank 1")  # docs/profiling.md's picture, of this trace
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FixresError, match="not a torch.profiler Chrome trace"):
        profiling.draw_trace(folder / "rank1.txt", tmp_path / "no.png")


def test_a_resumed_run_counts_the_steps_it_has_left(scratch_job, tiny_data, tmp_path, capsys):
    """The shared 2-epoch job (10 steps, finished) run again: no step left, not 10."""
    shutil.copytree(scratch_job, tmp_path / "straight")
    status, err = run_main(capsys, "scratch", "--num-tasks", 2, "--job-id", "straight", "--shared-folder-path",
                           tmp_path, "--data-path", tiny_data, *SCRATCH, "--profile", 1, "--profile-after", 0)
    assert status == 1 and err.count("\n") == 1, err
    assert ("the window ends at step 1, but this run has 0 optimizer steps left (10 were done before this resume)"
            in err), err


def test_a_window_beyond_the_run_and_one_without_training_are_refused(tiny_data, tmp_path, capsys):
    status, err = run_main(capsys, "scratch", "--data-path", tiny_data, "--shared-folder-path", tmp_path,
                           "--num-tasks", 2, "--batch", 8, "--epochs", 1, "--profile", 3, "--job-id", "j")
    assert status == 1 and err.count("\n") == 1, err
    assert ("--profile 3 after --profile-after 5: the window ends at step 8, but this run has 5 optimizer steps; "
            "lower --profile-after or --profile") in err
    assert not (tmp_path / "j").exists()
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "profile").write_text("a file where the traces would go")
    status, err = run_main(capsys, "scratch", "--data-path", tiny_data, "--shared-folder-path", tmp_path,
                           "--num-tasks", 2, "--batch", 8, "--epochs", 1, "--profile", 1, "--profile-after", 0,
                           "--job-id", "blocked")
    assert status == 1 and err.count("\n") == 1, err
    assert f"--profile: cannot write the traces into {tmp_path / 'blocked' / 'profile'}: not a folder" in err
    assert (tmp_path / "blocked" / "profile").read_text() == "a file where the traces would go"
    with pytest.raises(FixresError, match="--profile records training steps, and --eval-only trains none"):
        TrainerConfig(mode="finetune", eval_only=True, weight_path=str(tmp_path / "w.pth"), profile=2)


@pytest.fixture
def full_disk(tmp_path):
    """``tmp_path/full/profile``, where the traces of job ``full`` go: a 64 KiB filesystem (a trace of
    this run's window takes about 1 MB)."""
    folder = tmp_path / "full" / "profile"
    folder.mkdir(parents=True, mode=0o700)
    yield from tmpfs(folder, "size=64k,mode=0700", "a small filesystem that fills up")


def test_a_disk_that_fills_up_costs_the_trace_in_one_line_and_the_run_goes_on(full_disk, tiny_data, tmp_path):
    result = run_script("scratch", "--job-id", "full", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                        "--architecture", "resnet20", "--input-size", 16, "--batch", 8, "--epochs", 1, "--workers", 0,
                        "--profile", 2, "--profile-after", 1, "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("fixres_dist")]
    assert len(lines) == 1 and re.fullmatch(
        rf"fixres_dist: rank 0: warning: --profile: cannot write {full_disk}/rank0\.\d+\.pt\.trace\.json \(No space "
        rf"left on device\): nothing partial is kept, and training goes on without this rank's trace; free space in "
        rf"{full_disk}, or run without --profile", lines[0]), result.stderr
    assert list(full_disk.iterdir()) == []  # no partial trace, no temporary file
    assert "profile: " not in result.stdout
    events = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("train", "eval")] == ["train", "eval"]
    assert (tmp_path / "full" / "checkpoint.pth").is_file()
