"""CUDA only (``pytest -m gpu tests/jobs/test_gpu.py``; benchmarks/gpu_check.sh runs it): every test is
skipped, with its reason, where no GPU is visible.

Real runs of ``main_scratch.py`` on the GPU(s): NCCL with 2 ranks on 2 GPUs; bf16 autocast with
channels-last; fp16 with its GradScaler saved in ``checkpoint.pth`` and restored on resume;
``--compile`` (no silent fall-back to eager); ``--sync-bn`` (ranks hold the same BatchNorm
statistics mid-epoch); a local rank without a GPU refused in one line; a rank whose
``CUDA_VISIBLE_DEVICES`` was narrowed to one GPU (SLURM's GPU binding) working with local rank 1.
With one GPU, the 2-rank tests put both ranks on it (each narrowed to it) and use gloo, as NCCL
refuses two ranks on one device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import FAST, clean_env, run_script, start_script
from fixres_dist import Trainer, TrainerConfig
from fixres_dist.data import pipeline
from fixres_dist.entry.cli import build_parser, config_fields
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
CUDA = ["--device", "cuda"]


def _events(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _output(proc) -> str:
    return proc.stdout + proc.stderr


def _visible_ids() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(GPUS)]
    return [v.strip() for v in visible.split(",") if v.strip()][:GPUS]


def _two_ranks(tmp_path, data_path, job, *extra, timeout=300):
    """Two separately started ranks, each with CUDA_VISIBLE_DEVICES narrowed to one GPU (local ranks 0
    and 1): their own GPUs and NCCL with 2+ GPUs; both on the one GPU with gloo otherwise."""
    ids = _visible_ids()
    backend = "nccl" if len(ids) >= 2 else "gloo"
    common = ["--num-tasks", 2, "--job-id", job, "--shared-folder-path", tmp_path, "--data-path", data_path,
              *FAST, *CUDA, "--dist-backend", backend, "--dist-timeout", 120, *extra]
    procs = [start_script("scratch", "--global-rank", rank, "--local-rank", rank, *common,
                          env=clean_env(CUDA_VISIBLE_DEVICES=ids[rank] if len(ids) >= 2 else ids[0]))
             for rank in (0, 1)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, out, err))
    return results


# ------------------------------------------------------------------------------ in-process
def test_cuda_defaults_bf16_channels_last_nccl():
    fields = config_fields(build_parser("scratch").parse_args([]), "scratch")
    assert fields["device"] == "cuda" and fields["dist_backend"] == "nccl"
    assert fields["amp"] == "bf16" and fields["channels_last"] is True
    assert fields.get("compile") is None and not fields.get("sync_bn")


def test_trainer_takes_its_gpu_and_turns_on_cudnn_benchmark(tmp_path):
    trainer = Trainer(TrainerConfig(device="cuda", shared_folder_path=str(tmp_path), job_id="setup", progress=False))
    try:
        trainer.session.open()
        assert trainer.session.device == torch.device("cuda", 0)
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = False


def test_to_device_normalises_into_channels_last():
    images = torch.randint(0, 256, (4, 3, 40, 40), dtype=torch.uint8)
    moved = pipeline.to_device(images.pin_memory(), torch.device("cuda", 0), channels_last=True)
    assert moved.is_cuda and moved.dtype == torch.float32
    assert moved.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(moved.cpu(), pipeline.normalize(images))


# ------------------------------------------------------------------------------ real runs
@TWO_GPUS
def test_nccl_two_ranks_one_gpu_each(tiny_data, tmp_path):
    proc = run_script("scratch", "--num-tasks", 2, "--job-id", "nccl", "--shared-folder-path", tmp_path,
                      "--data-path", tiny_data, *FAST, *CUDA, "--dist-backend", "nccl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "nccl" / "config.json").read_text())
    assert config["dist_backend"] == "nccl" and config["device"] == "cuda" and config["num_tasks"] == 2
    evals = [e for e in _events(tmp_path / "nccl") if e["event"] == "eval"]
    assert evals[-1]["images"] == 30  # every validation image once over both ranks
    assert len(load_checkpoint(tmp_path / "nccl" / CHECKPOINT_FILE)["ranks"]) == 2


def test_bf16_channels_last_run(tiny_data, tmp_path):
    proc = run_script("scratch", "--job-id", "bf16", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                      *FAST, *CUDA, "--amp", "bf16", "--channels-last")
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["amp"] == "bf16" and config["channels_last"] is True
    train = [e for e in _events(tmp_path / "bf16") if e["event"] == "train"]
    assert len(train) == 1 and 0 < train[0]["loss"] < 10  # finite, sane
    assert load_checkpoint(tmp_path / "bf16" / CHECKPOINT_FILE)["scaler"] is None  # no GradScaler for bf16
    [times] = [e for e in _events(tmp_path / "bf16") if e["event"] == "step_times"]  # from CUDA events
    [rank] = times["ranks"]
    assert rank["memory"] == "cuda max_memory_allocated" and 0 < rank["peak_memory_gib"] < 4
    assert rank["ms_per_step"]["collectives"] is None and all(
        v >= 0 for k, v in rank["ms_per_step"].items() if k != "collectives")


def test_fp16_grad_scaler_is_checkpointed_and_restored(tiny_data, tmp_path):
    args = ["scratch", "--job-id", "fp16", "--shared-folder-path", tmp_path, "--data-path", tiny_data, *FAST,
            "--epochs", 2, *CUDA, "--amp", "fp16"]  # 80 images / batch 8: 10 steps per epoch, 20 in all
    first = run_script(*args, env=clean_env(FIXRES_FAULT="signal:rank=0:step=13"))
    assert first.returncode == 3, first.stderr[-3000:]
    path = tmp_path / "fp16" / CHECKPOINT_FILE
    state = load_checkpoint(path)
    assert state["global_step"] == 13
    scaler = state["scaler"]
    assert isinstance(scaler, dict) and scaler["scale"] > 0 and "_growth_tracker" in scaler
    # Mark the saved scaler: a scale no fresh GradScaler has (65536 at the start, only halving within
    # 7 steps) and a growth interval that stops it growing. Only a restored scaler ends with these.
    state["scaler"] = {**scaler, "scale": 32.0, "growth_interval": 1_000_000}
    torch.save(state, path)
    second = run_script(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in _output(second)
    final = load_checkpoint(path)
    assert final["global_step"] == 20
    assert final["scaler"]["growth_interval"] == 1_000_000 and final["scaler"]["scale"] <= 32.0
    assert all(0 < e["loss"] < 10 for e in _events(tmp_path / "fp16") if e["event"] == "train")


@pytest.mark.timeout(900)  # inductor compiles forward and backward first
def test_compile_runs_compiled(tiny_data, tmp_path):
    proc = run_script("scratch", "--job-id", "compiled", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                      *FAST, *CUDA, "--compile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "uncompiled" not in _output(proc), _output(proc)[-3000:]  # the Trainer's fall-back warning
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["compile"] == "inductor"


def test_sync_bn_gives_all_ranks_the_same_statistics_mid_epoch(tiny_data, tmp_path):
    """Mid-epoch (before the epoch-end averaging of --dist-bn reduce), ranks that saw different
    images hold the same BatchNorm running statistics only if they were synchronised."""
    results = _two_ranks(tmp_path, tiny_data, "syncbn", "--sync-bn", "--ckpt-every", 2, "--keep-checkpoints", 10)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
    first = sorted((tmp_path / "syncbn").glob("checkpoint-*.pth"))[0]
    state = load_checkpoint(first)
    assert state["global_step"] == 2 and state["config"]["sync_bn"] is True
    ranks = state["ranks"]
    assert len(ranks) == 2
    keys = [k for k in ranks[0]["buffers"] if k.endswith(("running_mean", "running_var"))]
    assert keys
    for key in keys:
        torch.testing.assert_close(ranks[0]["buffers"][key], ranks[1]["buffers"][key], rtol=1e-4, atol=1e-6, msg=key)


def test_local_rank_without_a_gpu_is_refused_in_one_line(tiny_data, tmp_path):
    env = clean_env()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1:
        del env["CUDA_VISIBLE_DEVICES"]  # a single narrowed GPU serves any local rank: not this case
    count = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, env=env, check=True).stdout)
    proc = run_script("scratch", "--num-tasks", count + 1, "--global-rank", count, "--job-id", "nogpu",
                      "--shared-folder-path", tmp_path, "--data-path", tiny_data, *FAST, *CUDA,
                      "--dist-timeout", 30, env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"fixres_dist: rank {count}:") and f"local rank {count} has no GPU" in lines[0]


def test_narrowed_visible_devices_let_local_rank_one_run(tiny_data, tmp_path):
    results = _two_ranks(tmp_path, tiny_data, "narrowed")
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
    evals = [e for e in _events(tmp_path / "narrowed") if e["event"] == "eval"]
    assert evals[-1]["images"] == 30


def test_loss_watch_reads_cuda_flags_a_step_late_without_syncing():
    """Issue 13: the non-finite check adds no host-device synchronisation to the step; a step's flag
    is known once the next step was observed (or at a flush)."""
    from fixres_dist.finite import LossWatch
    watch = LossWatch()
    losses = [torch.tensor(v, device="cuda") for v in (1.0, float("nan"), 2.0)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit synchronisation in observe() raises
    try:
        watch.observe(1, losses[0])
        watch.observe(2, losses[1])
        assert watch.first_bad is None  # step 2 is read one step later
        watch.observe(3, losses[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert watch.first_bad == 2 and watch.flush() == 2


def test_divergence_on_cuda_stops_with_the_last_good_checkpoint(tiny_data, tmp_path):
    proc = run_script("scratch", "--job-id", "nan", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                      *FAST, *CUDA, "--learning-rate", "1e6", "--warmup-epochs", "0", "--epochs", "2",
                      "--ckpt-every", "1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    # the loss at a step is finite when the weights it was computed from were; the update after it may
    # not be: then the checkpoint's own guard stops the run, naming the weights
    assert line.startswith(("fixres_dist: rank 0: non-finite loss (NaN or infinity) at epoch 1, step ",
                            "fixres_dist: rank 0: non-finite weights after epoch 1, step ")), line
    state = load_checkpoint(tmp_path / "nan" / CHECKPOINT_FILE)  # refuses non-finite weights
    assert f"(step {state['global_step']}) is kept" in line
    for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda token: pytest.fail(f"not strict JSON: {token}"))
