"""The speed options on CPU: bf16 autocast, channels-last, --sync-bn, --compile, and their bad input.

The CUDA side (fp16 with a GradScaler, nccl, one GPU per rank) is in tests/jobs/test_gpu.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_subset, run_main, run_script, run_two_ranks_and_one
from fixres_dist import FixresError
from fixres_dist.distributed import placement
from fixres_dist.training.checkpoint import load_checkpoint
from numeric import assert_near_reference, assert_settled_ranking, assert_within_spread, evaluation, floating

# resnet20 at 16 px, 1 epoch on few_data (20 images): what the speed options change is not the network;
# 4 images per rank divide the 20, so a compiled step sees one batch shape (no recompilation for a last one)
SMALL = ["--architecture", "resnet20", "--input-size", "16", "--batch", "4", "--epochs", "1", "--workers", "0",
         "--no-progress"]


def _evals(folder):
    return [e for e in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if e["event"] == "eval"]


def test_bf16_autocast_trains_on_cpu(few_data, tmp_path):
    result = run_script("scratch", "--num-tasks", 2, "--amp", "bf16", "--job-id", "bf16", "--shared-folder-path",
                        tmp_path, "--data-path", few_data, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    state = load_checkpoint(tmp_path / "bf16" / "checkpoint.pth")
    assert state["config"]["amp"] == "bf16" and state["scaler"] is None  # no GradScaler for bf16
    assert all(v.dtype == torch.float32 for k, v in state["model"].items() if k.endswith("weight"))
    evals = _evals(tmp_path / "bf16")
    assert evals and all(e["images"] == 10 and 0 <= e["top1"] <= 100 for e in evals)


@pytest.mark.numeric
def test_channels_last_gives_the_same_evaluation(few_data, tmp_path):
    """The same weights evaluated in both memory formats: the same top-1 (no image of these is within
    rounding of changing class) and losses within rounding of the contiguous run's, both measured
    against the same evaluation in float64 (:mod:`numeric`)."""
    weights = tmp_path / "w.pth"
    from fixres_dist.models import architectures
    torch.manual_seed(0)
    model = architectures.build_model("resnet20", 10)
    torch.save(model.state_dict(), weights)
    results = {}
    for flag in ("--channels-last", "--no-channels-last"):
        job = flag.strip("-")
        result = run_script("scratch", "--eval-only", "--architecture", "resnet20", "--weight-path", weights, flag,
                            "--test-sizes", "32,48", "--job-id", job, "--shared-folder-path", tmp_path,
                            "--data-path", few_data,
                            "--workers", 0, "--no-progress")
        assert result.returncode == 0, result.stderr[-3000:]
        results[flag] = _evals(tmp_path / job)
    sizes = [e["resolution"] for e in results["--no-channels-last"]]
    assert sizes == [32, 48]
    reference = [evaluation(model, "resnet20", few_data, "val", size, torch.float64) for size in sizes]
    baseline = [evaluation(model, "resnet20", few_data, "val", size, torch.float32) for size in sizes]
    for size, ours, theirs in zip(sizes, reference, baseline):
        assert_settled_ranking(ours["logits"], theirs["logits"], f"{size} px")
    for a, b, expected in zip(results["--channels-last"], results["--no-channels-last"], reference):
        assert a["top1"] == b["top1"] == expected["top1"] and a["top5"] == b["top5"] == expected["top5"]
    assert_near_reference(*({"loss": [e["loss"] for e in run]} for run in
                            (results["--channels-last"], results["--no-channels-last"], reference)), "losses")


@pytest.mark.numeric
def test_sync_bn_two_ranks_equal_one_process_on_the_union(tmp_path):
    """Scratch training, every BatchNorm synchronised: a step of 2 ranks x 8 images == 1 process x 16, to
    rounding: within :data:`numeric.FACTOR` of the spread of the one process in two summation orders
    (its two memory formats).

    Compared after the first optimizer step (checkpoint-00000001.pth), the only step on these 16 images.
    """
    data = make_subset(tmp_path / "data", 2, 1, classes=8)
    common = ["--data-path", data, "--input-size", 16, "--epochs", 1, "--workers", 0, "--no-progress",
              "--shared-folder-path", tmp_path, "--sync-bn", "--warmup-epochs", 0, "--ckpt-every", 1,
              "--keep-checkpoints", 5]
    two, _ = run_two_ranks_and_one("scratch", *common)
    assert "--sync-bn: 20 BatchNorm layers synchronised over 2 ranks" in two.stdout
    a, b, other = (load_checkpoint(tmp_path / job / "checkpoint-00000001.pth") for job in ("two", "one", "one-other"))
    assert_within_spread(*(floating(state["model"]) for state in (a, b, other)), "2 ranks vs 1")
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items() if not v.is_floating_point())
    var = "bn1.running_var"
    for rank in a["ranks"]:  # both ranks hold the union's BatchNorm statistics
        assert_within_spread({var: rank["buffers"][var]}, {var: b["model"][var]}, {var: other["model"][var]},
                             "a rank's statistics vs 1 process's")


def test_compile_runs_the_step_through_torch_compile(few_data, tmp_path):
    # the "eager" backend traces with TorchDynamo but skips code generation: fast enough for CPU CI
    result = run_script("scratch", "--compile", "eager", "--job-id", "c", "--shared-folder-path", tmp_path,
                        "--data-path", few_data, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.compile failed" not in result.stdout + result.stderr
    assert load_checkpoint(tmp_path / "c" / "checkpoint.pth")["config"]["compile"] == "eager"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # inductor's C++ compilation on 2 CPU cores: minutes
def test_compile_with_inductor_on_cpu(few_data, tmp_path):
    result = run_script("scratch", "--compile", "--job-id", "ci", "--shared-folder-path", tmp_path,
                        "--data-path", few_data, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.compile failed" not in result.stdout + result.stderr


@pytest.mark.parametrize("args, message", [
    (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs --device cuda"),
    (["--compile", "no_such_backend"], "--compile 'no_such_backend' is not a torch.compile backend; known: "),
])
def test_bad_speed_options_fail_in_seconds_with_one_line(args, message, tmp_path, capsys):
    code, err = run_main(capsys, "scratch", *args, "--shared-folder-path", tmp_path)
    assert code == 1 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    code, err = run_main(capsys, "scratch", "--device", "cuda", "--shared-folder-path", tmp_path)
    assert code == 1 and "--device cuda but no CUDA GPU is visible" in err
    assert len(err.strip().splitlines()) == 1


def test_gpu_choice_respects_a_launcher_narrowing_cuda_visible_devices():
    if torch.cuda.device_count() == 0:
        with pytest.raises(FixresError, match="no CUDA GPU is visible"):
            placement.cuda_device(1, {"CUDA_VISIBLE_DEVICES": "3"})
        return
    assert placement.cuda_device(0, {}) == torch.device("cuda", 0)
    if torch.cuda.device_count() == 1:
        assert placement.cuda_device(3, {"CUDA_VISIBLE_DEVICES": "5"}) == torch.device("cuda", 0)
        with pytest.raises(FixresError, match="local rank 1 has no GPU: 1 visible"):
            placement.cuda_device(1, {})
