"""--profile (issue 27, in part): a torch.profiler trace of a window of training steps on every rank,
readable as a Chrome trace, with each rank's top operators; a window beyond the run refused."""
from __future__ import annotations

import json
import shutil

import pytest

import shown_commands as shown
from conftest import SCRATCH, run_main, run_script
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
