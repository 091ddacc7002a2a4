"""Sharded training (FSDP2 full and hybrid shard) on real gloo ranks: equal to DDP at the same seed,
stopped and resumed under another strategy and world size, FixRes-finetuned, and its bad input."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import shown_commands as shown
from conftest import make_subset, run_main, run_script
from fixres_dist.deploy import export, exported
from fixres_dist.distributed.blocks import blocks
from fixres_dist.distributed.sharding import checkpoint_activations
from fixres_dist.models.architectures import build_model
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint
from jobs_fixtures import VIT
from jobs_fixtures import vit_run as run
from numeric import assert_near_reference, assert_settled_ranking, evaluation
from split_models import assert_same_run, events, full


@pytest.mark.numeric
def test_full_shard_trains_as_ddp(vit_jobs):
    """Same seed, same data: the sharded run's losses, top-1, EMA and weights are DDP's."""
    assert_same_run(vit_jobs / "full", vit_jobs / "ddp", vit_jobs / "ddp-other")
    config = json.loads((vit_jobs / "full" / "config.json").read_text())
    assert config["sharding"] == "full"


@pytest.mark.numeric
@pytest.mark.slow
def test_hybrid_shard_on_4_ranks_with_activation_checkpointing_trains_as_ddp_on_2(vit_jobs, tiny_data, tmp_path):
    """A 2 x 2 mesh (shard within pairs, replicate across them), 4 images a rank and every block
    recomputed in the backward: the 16-image global batch of the 2-rank DDP run, the same run."""
    result = run(tmp_path, tiny_data, "hybrid", "--sharding", "hybrid", "--shard-group-size", 2,
                 "--activation-checkpointing", "--batch", 4, world=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--sharding hybrid: 6 blocks and the root sharded over a mesh of 2 replicate x 2 shard ranks" \
        in result.stdout
    assert "activation checkpointing: 6 blocks" in result.stdout
    assert_same_run(tmp_path / "hybrid", vit_jobs / "ddp", vit_jobs / "ddp-other")


@pytest.fixture(scope="module")
def stopped_sharded(tiny_data, tmp_path_factory):
    """The sharded ViT job stopped after step 3 of 5 on 2 ranks (its folder; copy it to resume it)."""
    folder = tmp_path_factory.mktemp("stopped")
    stopped = run(folder, tiny_data, "s", "--sharding", "full", fault="signal:rank=1:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    return folder / "s"


@pytest.mark.numeric
def test_a_sharded_job_stopped_mid_epoch_resumes_under_ddp_as_if_uninterrupted(vit_jobs, stopped_sharded, tiny_data,
                                                                               tmp_path):
    """Stopped after step 3 of 5 fully sharded on 2 ranks, resumed under DDP on 2 ranks: it ends as the
    uninterrupted run, weights included."""
    shutil.copytree(stopped_sharded, tmp_path / "s")
    resumed = run(tmp_path, tiny_data, "s", "--sharding", "ddp")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "image 48 of the epoch" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_run(tmp_path / "s", vit_jobs / "ddp", vit_jobs / "ddp-other")


@pytest.mark.slow
def test_a_sharded_job_stopped_mid_epoch_resumes_hybrid_on_4_ranks(stopped_sharded, tiny_data, tmp_path):
    """The same stop resumed hybrid on 4 ranks continues the epoch at the same image, none left out."""
    shutil.copytree(stopped_sharded, tmp_path / "s")
    on_four = run(tmp_path, tiny_data, "s", "--sharding", "hybrid", "--shard-group-size", 2, world=4)
    assert on_four.returncode == 0, on_four.stderr[-3000:]
    assert "epoch 1 continues at image 48 of 80" in on_four.stdout
    assert "left out" not in on_four.stdout and events(tmp_path / "s", "eval")[-1]["images"] == 30


@pytest.fixture(scope="module")
def sharded_finetune(vit_jobs, tmp_path_factory):
    """main_finetune.py on the sharded run's checkpoint.pth, sharded at 48 px on 4 ranks for a 3-class
    task with 3 validation images (rank 3 has no batch); its folder and output."""
    folder = tmp_path_factory.mktemp("finetune")
    data = make_subset(folder / "data", 6, 1, classes=3)
    result = run_script("finetune", "--num-tasks", 4, "--job-id", "ft", "--shared-folder-path", folder,
                        "--data-path", data, "--weight-path", vit_jobs / "full" / CHECKPOINT_FILE,
                        "--sharding", "full", "--architecture", "timm/test_vit", "--input-size", 48, "--batch", 2,
                        "--epochs", 1, "--workers", 0, "--no-progress", "--dist-timeout", 60)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result.stdout


def test_fixres_finetune_of_a_sharded_checkpoint_trains_the_head_and_last_norm_only(vit_jobs, sharded_finetune):
    """The frozen weights come out exactly as they went in (the position embedding resampled to 48 px,
    the head's rows those of the 3 classes kept, found by the class names that the sharded checkpoint's
    ``.pth`` records). The model is sharded before the evaluations that precede finetuning, and rank 3,
    without a validation batch, runs blank forwards so that every rank gathers each block as often
    (else the others would wait for it until the timeout)."""
    folder, stdout = sharded_finetune
    assert "classifier rows of head mapped by class name: 3 kept, 7 dropped (3_dress, 4_coat, 5_sandal and 4 " \
           "more)" in stdout
    sharded_at = stdout.index("--sharding full: 6 blocks")
    assert sharded_at < stdout.index("eval train-resolution @32px") < stdout.index("eval before @48px"), stdout
    before, after = full(vit_jobs / "full" / CHECKPOINT_FILE)["model"], full(folder / "ft" / CHECKPOINT_FILE)["model"]
    resized = {k for k in after if after[k].shape != before[k].shape}
    assert resized == {"pos_embed", "head.weight", "head.bias"}  # a 3 x 3 patch grid at 48 px; 3 classes
    trained = {k for k in after if k not in resized and not torch.equal(after[k], before[k])}
    assert trained and all(k.startswith(("fc_norm.", "norm.")) for k in trained), trained
    assert [(e["resolution"], e["images"]) for e in events(folder / "ft", "eval")][-1] == (48, 3)


@pytest.mark.numeric
def test_eval_only_of_a_sharded_checkpoint_runs_sharded_and_agrees(sharded_finetune):
    """``--eval-only --sharding full`` on 2 ranks evaluates the finetuned shards without ever
    building the model unsharded for a forward, and measures what the finetune's last evaluation (on 4
    ranks) did: the same top-1 (a count: exact, and the float64 evaluation's, no image being within
    rounding of changing class) and the same loss to rounding (:func:`numeric.assert_near_reference`)."""
    folder, _ = sharded_finetune
    result = run_script("finetune", "--eval-only", "--num-tasks", 2, "--job-id", "ev", "--shared-folder-path",
                        folder, "--data-path", folder / "data", "--weight-path", folder / "ft" / CHECKPOINT_FILE,
                        "--sharding", "full", "--architecture", "timm/test_vit", "--test-sizes", 48,
                        "--workers", 0, "--no-progress", "--dist-timeout", 60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.index("--sharding full: 6 blocks") < result.stdout.index("eval sweep @48px")
    ours, finetuned = events(folder / "ev", "eval")[-1], events(folder / "ft", "eval")[-1]
    assert (ours["resolution"], ours["images"], ours["top1"]) == (48, 3, finetuned["top1"])
    model = build_model("timm/test_vit", 3, image_size=48)
    model.load_state_dict(full(folder / "ft" / CHECKPOINT_FILE)["model"])
    exact, plain = (evaluation(model, "timm/test_vit", folder / "data", "val", 48, dtype)
                    for dtype in (torch.float64, torch.float32))
    assert_settled_ranking(exact["logits"], plain["logits"], "3 images at 48 px", ks=(1,))
    assert finetuned["top1"] == exact["top1"]
    assert_near_reference({"loss": ours["loss"]}, {"loss": finetuned["loss"]}, {"loss": exact["loss"]}, "loss")


@pytest.mark.parametrize("damage, message", [
    ("metadata", "has no .metadata (incomplete or damaged"),
    ("missing", "is missing the shard __1_0.distcp"),
    ("truncated", "__0_0.distcp is truncated ("),
    ("folder", "of this sharded checkpoint is missing: its .pth holds no weights without it"),
    ("changed", "__0_0.distcp changed since it was written (its SHA-256 differs"),
])
def test_a_damaged_sharded_checkpoint_is_refused_before_start(vit_jobs, tmp_path, capsys, damage, message):
    """A missing .metadata, shards folder or shard file, a truncated shard or one whose bytes changed:
    one line naming it; nothing written."""
    copy = tmp_path / "copy"
    shutil.copytree(vit_jobs / "full", copy)
    shards = copy / load_checkpoint(copy / CHECKPOINT_FILE)["shards"]
    if damage == "metadata":
        (shards / ".metadata").unlink()
    elif damage == "folder":
        shutil.rmtree(shards)
    elif damage == "changed":  # the same length: DCP itself would read it
        (shards / "__0_0.distcp").write_bytes(bytes(64) + (shards / "__0_0.distcp").read_bytes()[64:])
    elif damage == "missing":
        (shards / "__1_0.distcp").unlink()
    else:
        (shards / "__0_0.distcp").write_bytes((shards / "__0_0.distcp").read_bytes()[:5000])
    before = sorted(p.name for p in copy.rglob("*"))
    status, err = run_main(capsys, "scratch", "--shared-folder-path", tmp_path / "runs", "--job-id", "new",
                           "--resume", copy / CHECKPOINT_FILE, *VIT[:4])
    assert status == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in copy.rglob("*")) == before and not (tmp_path / "runs" / "new").exists()


def test_activation_checkpointing_leaves_batchnorm_statistics_as_one_forward_does():
    """The recomputation in the backward runs each block's forward again in train mode: the BatchNorms'
    running statistics stay those of the one forward (they were updated twice per step); the gradients are
    the same, bit for bit (the same kernels on the same inputs)."""
    torch.manual_seed(0)
    plain = build_model("resnet20", 10)
    checkpointed = build_model("resnet20", 10)
    checkpointed.load_state_dict(plain.state_dict())
    assert checkpoint_activations(checkpointed) == 9
    images = torch.randn(4, 3, 32, 32)
    for model in (plain, checkpointed):
        model.train()
        model(images).square().sum().backward()
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(checkpointed.state_dict()[key], value), key
    assert plain.state_dict()["layer1.0.bn1.num_batches_tracked"].item() == 1
    for (name, param), other in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(param.grad, other.grad), name


def test_blocks_of_each_family():
    """The units sharded and checkpointed: residual blocks, outermost only."""
    for name, count, kind in (("resnet20", 9, "BasicBlock"), ("resnet50", 16, "Bottleneck"),
                              ("convnext_tiny", 18, "CNBlock"), ("timm/test_vit", 6, "Block"),
                              ("efficientnet_b0", 16, "MBConv"), ("alexnet", 0, None)):
        found = blocks(build_model(name, 10))
        assert len(found) == count and all(type(m).__name__ == kind for _, m in found), name


@pytest.mark.parametrize("flags, message", [
    (["--cpu-offload"], "--cpu-offload applies to a sharded model: add --sharding full or hybrid"),
    (["--sharding", "full", "--cpu-offload"], "--cpu-offload moves a sharded model's parameters from the GPU"),
    (["--no-reshard-after-forward"], "--no-reshard-after-forward applies to a sharded model"),
    (["--sharding", "full", "--shard-group-size", 2], "--shard-group-size applies to --sharding hybrid"),
    (["--sharding", "hybrid", "--shard-group-size", 3, "--num-tasks", 4],
     "--sharding hybrid: 4 ranks do not split into shard groups of --shard-group-size 3"),
    (["--sharding", "full", "--dist-bn", "broadcast"], "with --sharding full use --dist-bn reduce"),
    (["--sharding", "full", "--architecture", "vit_b_16"], "use a timm ViT (e.g. timm/vit_base_patch16_224)"),
    (["--sharding", "zero3"], "invalid choice: 'zero3'"),
])
def test_bad_sharding_options_are_one_line_errors(flags, message, tmp_path, capsys):
    status, err = run_main(capsys, "scratch", "--shared-folder-path", tmp_path, *flags)
    assert status != 0 and message in err, err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_the_sharded_commands_shown(tmp_path, capsys):
    """docs/sharding.md's commands: train on the embedded data (4,000 training images: about a
    minute), then export it (docs/models.md, "Exporting a model")."""
    train, export_weights = (shown.argv(c, **{"/tmp/runs": tmp_path})
                             for c in shown.block("python main_scratch.py --num-tasks 2 --sharding full"))
    result = run_script("scratch", *train[2:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--sharding full: 6 blocks and the root sharded over a mesh of 2 shard ranks; 150,565 of 300,746" \
        in result.stdout
    assert events(tmp_path / "vit-sharded", "eval")[-1]["images"] == 1000
    assert export.main(export_weights[3:]) == 0
    build = json.loads((tmp_path / "vit-sharded-export" / export.DESCRIPTION_FILE).read_text())["build"]
    assert build == {"name": "timm/test_vit", "num_classes": 10, "image_size": 32, "low_res_stem": False}
    build_model(**build).load_state_dict(load_file(tmp_path / "vit-sharded-export" / export.WEIGHTS_FILE))


def test_a_sharded_checkpoint_is_a_model_to_predict_with(vit_jobs):
    """fixres_dist.deploy.exported reads a sharded checkpoint (here, where a sharded job's is at hand): the
    network built from it holds the checkpoint's full tensors, its EMA's too, at the resolution it trained at."""
    source = vit_jobs / "full" / CHECKPOINT_FILE
    saved = full(source)
    for key in ("model", "model_ema"):
        model = exported.from_checkpoint(source, key)
        assert (model.architecture, model.input_size, model.weights, len(model.class_names)) == \
            ("timm/test_vit", 32, key, 10)
        state = model.build().state_dict()
        assert state.keys() == saved[key].keys() and all(torch.equal(state[k], saved[key][k]) for k in state)
