"""The recipe options users bring from torchvision's references, DeiT and timm (issue 16): optimizers,
schedules, gradient clipping and accumulation, EMA, presets, and the combinations refused."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision

from conftest import make_subset, run_main, run_script
from fixres_dist import FixresError, TrainerConfig
from fixres_dist.data.pipeline import normalize
from fixres_dist.entry.cli import build_parser, config_fields
from fixres_dist.models.ema import ModelEMA
from fixres_dist.training import engine, optim, recipes
from numeric import U, assert_near_reference


# ------------------------------------------------------------------ optimizers and schedules
@pytest.mark.parametrize("name, kind", [("sgd", torch.optim.SGD), ("sgd-nesterov", torch.optim.SGD),
                                        ("adamw", torch.optim.AdamW), ("rmsprop", torch.optim.RMSprop)])
def test_each_optimizer_keeps_the_weight_decay_groups(name, kind):
    model = torchvision.models.resnet18(num_classes=3)
    opt = optim.build_optimizer(name, optim.parameter_groups(model, 1e-4, 0.0), lr=0.1, momentum=0.9)
    assert type(opt) is kind
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
    if kind is torch.optim.SGD:
        assert opt.defaults["nesterov"] == (name == "sgd-nesterov") and opt.defaults["momentum"] == 0.9
    if kind is torch.optim.RMSprop:
        assert (opt.defaults["eps"], opt.defaults["alpha"]) == (optim.RMSPROP_EPS, optim.RMSPROP_ALPHA)
    with pytest.raises(ValueError, match="unknown optimizer"):
        optim.build_optimizer("lamb", optim.parameter_groups(model, 0, 0), 0.1, 0.9)


def test_schedules_after_the_warmup():
    f = optim.lr_factor
    assert f(0.5, 10, 1.0, "step") == 0.5 and f(0.5, 10, 1.0, "exponential") == 0.5  # the warmup
    # step: gamma every step_size epochs counted from the warmup's end (StepLR stepped per epoch)
    assert [f(e, 90, 0.0, "step", 30, 0.1) for e in (0, 29.99, 30, 59.5, 60)] == \
        pytest.approx([1, 1, 0.1, 0.1, 0.01])
    assert f(31, 90, 1.0, "step", 30, 0.1) == pytest.approx(0.1) and f(30.5, 90, 1.0, "step", 30, 0.1) == 1
    assert [f(e, 10, 0.0, "exponential", gamma=0.5) for e in (0, 0.9, 1, 3.2)] == pytest.approx([1, 1, 0.5, 0.125])
    assert f(1.0, 3, 1.0, "cosine") == 1 and f(2.0, 3, 1.0, "cosine") == pytest.approx(0.5)
    assert f(3.0, 3, 1.0, "cosine") == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="unknown learning-rate scheduler"):
        f(1, 2, 0, "poly")


def test_linear_scaling_counts_accumulated_micro_batches():
    assert optim.scaled_learning_rate(0.1, 64, 8) == pytest.approx(0.2)
    assert optim.scaled_learning_rate(0.1, 64, 4, accumulation=2) == optim.scaled_learning_rate(0.1, 64, 8)


# ------------------------------------------------------------ accumulation and clipping
def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 5))


def _gradient_after(accumulation: int, images, labels, clip=None):
    model = _tiny()
    model.eval()  # BatchNorm on running statistics: micro-batches then give exactly the full batch's gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    settings = engine.StepSettings(torch.device("cpu"), accumulation=accumulation, clip_grad_norm=clip)
    loss = engine.train_step(model, opt, scaler, images, labels, settings)
    return loss, [p.grad.clone() for p in model.parameters()]


def _gradient_in_float64(images, labels):
    """:func:`_gradient_after`'s loss and gradient computed in float64 from the same weights and
    normalised images (the reference of :func:`numeric.assert_near_reference`)."""
    model = _tiny().double().eval()
    loss = F.cross_entropy(model(normalize(images).double()), labels, reduction="sum")
    (loss / len(labels)).backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.numeric
def test_accumulated_micro_batches_give_the_whole_batch_gradient_and_loss():
    """The same loss and gradient in 2 to 6 micro-batches as in one pass, to rounding: within
    :data:`numeric.FACTOR` of the one pass's float32 error from float64."""
    images = torch.randint(0, 256, (12, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(12) % 5
    loss1, grads1 = _gradient_after(1, images, labels)
    loss64, grads64 = _gradient_in_float64(images, labels)
    for accumulation in (2, 3, 4, 6, 12):  # 12 images: micro-batches of at least 2, so at most 6
        loss, grads = _gradient_after(accumulation, images, labels)
        assert_near_reference({"loss": loss}, {"loss": loss1}, {"loss": loss64}, f"{accumulation} micro-batches: loss")
        assert_near_reference(dict(enumerate(grads)), dict(enumerate(grads1)), dict(enumerate(grads64)),
                              f"{accumulation} micro-batches: gradient")
    assert engine.micro_batches(12, 12) == 6 and engine.micro_batches(3, 4) == 1 and engine.micro_batches(5, 2) == 2


def test_gradient_clipping_bounds_the_global_norm():
    """Clipped to a quarter of its norm, the gradient is the same one (bit for bit: the same computation)
    times max_norm / (norm + 1e-6) (torch's clip_grad_norm_): equal to a quarter, relatively, to within
    1e-6 / norm plus the rounding of the norm (a sum of n squares: at most n units of float32
    roundoff) and of the product (one more)."""
    images = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(8) % 5
    _, free = _gradient_after(1, images, labels)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in free]))
    _, clipped = _gradient_after(1, images, labels, clip=norm.item() / 4)
    clipped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped]))
    rel = 1e-6 / norm.item() + (sum(g.numel() for g in free) + 1) * U
    assert clipped_norm.item() == pytest.approx(norm.item() / 4, rel=rel)
    for a, b in zip(clipped, free):  # the direction is kept
        torch.testing.assert_close(a * 4, b, rtol=rel, atol=0)


@pytest.mark.numeric
def test_soft_targets_with_label_smoothing():
    """Mixed targets go to the same loss: cross-entropy on probabilities, label smoothing applied."""
    model = _tiny()
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 3])
    soft = F.one_hot(labels, 5).float() * 0.7 + F.one_hot(labels.roll(1), 5).float() * 0.3
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.0), torch.amp.GradScaler("cuda", enabled=False)
    reference = copy.deepcopy(model)
    settings = engine.StepSettings(torch.device("cpu"), label_smoothing=0.1)
    loss = engine.train_step(model, opt, scaler, images, labels, settings, mix=lambda x, y, i: (x, soft))
    expected = F.cross_entropy(reference(normalize(images)), soft, reduction="sum", label_smoothing=0.1)
    assert loss.item() == expected.item()  # the same computation: bit for bit


# ------------------------------------------------------------------------------ EMA
def test_ema_follows_the_weights_with_its_decay_and_restarts_in_the_warmup():
    model = _tiny()
    ema = ModelEMA(model, decay=0.9, every=2)
    start = model[5].weight.detach().clone()
    with torch.no_grad():
        model[5].weight.add_(1.0)
    ema.after_step(model, 1, warming_up=False)  # not due: every 2 steps
    assert ema.updates == 0 and torch.equal(ema.module[5].weight, start)
    ema.after_step(model, 2, warming_up=False)  # the first update copies
    assert ema.updates == 1 and torch.equal(ema.module[5].weight, model[5].weight)
    with torch.no_grad():
        model[5].weight.add_(1.0)
    ema.after_step(model, 4, warming_up=False)
    torch.testing.assert_close(ema.module[5].weight, model[5].weight - 0.9)  # 0.9 x old + 0.1 x new
    ema.after_step(model, 6, warming_up=True)  # the warmup restarts the average: a copy
    assert ema.updates == 1 and torch.equal(ema.module[5].weight, model[5].weight)
    restored = ModelEMA(_tiny(), 0.9, 2)
    restored.load(ema.state_dict(), ema.extra_state())
    assert restored.updates == 1 and torch.equal(restored.module[5].weight, ema.module[5].weight)
    with pytest.raises(ValueError):
        ModelEMA(model, 1.0, 1)


# ------------------------------------------------------------------- command line
def fields(mode, *argv):
    return config_fields(build_parser(mode).parse_args([str(a) for a in argv] + ["--device", "cpu"]), mode)


def test_recipes_fill_fields_and_explicit_flags_override_them():
    tv = fields("scratch", "--recipe", "torchvision-resnet50", "--epochs", "3", "--ra-reps", "2")
    assert tv["recipe"] == "torchvision-resnet50" and tv["epochs"] == 3 and tv["ra_reps"] == 2
    assert (tv["auto_augment"], tv["mixup_alpha"], tv["cutmix_alpha"], tv["model_ema"], tv["input_size"]) == \
        ("ta_wide", 0.2, 1.0, True, 176)
    config = TrainerConfig(**tv)
    text = recipes.describe(config)
    assert "--epochs 3 (overrides the recipe's 600)" in text and "--auto-augment ta_wide" in text
    assert "--model-ema" in text and "torchvision" in text.splitlines()[0]
    ft = fields("finetune", "--recipe", "fixres-resnet50-finetune", "--weight-path", "w.pth")
    assert (ft["input_size"], ft["learning_rate"], ft["epochs"], ft["lr_scheduler"]) == (384, 0.004, 56, "step")
    fx = fields("scratch", "--recipe", "fixres-resnet50-train")
    assert (fx["ra_reps"], fx["lr_step_size"], fx["weight_decay"], fx["norm_weight_decay"]) == (3, 60, 1e-4, 1e-4)
    for recipe in recipes.RECIPES.values():  # every preset is a valid configuration
        TrainerConfig(**{**fields(recipe.mode, "--recipe", recipe.name), "weight_path": "w.pth"})


def test_every_recipe_field_can_be_overridden_and_an_evaluation_drops_its_average():
    """--ra-sampler keeps a recipe's copies; --no-model-ema, --auto-augment none and --no-ra-sampler turn
    a recipe's options off; --eval-only with a recipe (its test preprocessing) keeps no EMA."""
    assert fields("scratch", "--recipe", "torchvision-resnet50", "--ra-sampler")["ra_reps"] == 4
    assert fields("scratch", "--recipe", "fixres-resnet50-train", "--ra-sampler")["ra_reps"] == 3
    off = fields("scratch", "--recipe", "torchvision-resnet50", "--no-model-ema", "--auto-augment", "none",
                 "--no-ra-sampler", "--no-tensorboard")
    assert (off["model_ema"], off["auto_augment"], off["ra_reps"], off["tensorboard"]) == (False, None, 1, False)
    TrainerConfig(**off)
    evaluation = fields("scratch", "--recipe", "torchvision-resnet50", "--eval-only", "--weight-path", "w.pth",
                        "--weight-key", "model_ema")
    config = TrainerConfig(**evaluation)
    assert not config.model_ema and (config.test_size, config.crop_ratio) == (224, 224 / 232)


def test_ra_sampler_sets_the_repeats():
    assert fields("scratch")["ra_reps"] == 1 if "ra_reps" in fields("scratch") else True
    assert fields("scratch", "--ra-sampler")["ra_reps"] == 3
    assert fields("scratch", "--ra-sampler", "--ra-reps", "4")["ra_reps"] == 4


@pytest.mark.parametrize("argv, message", [
    (["--ra-reps", "2"], "--ra-reps needs --ra-sampler"),
    (["--lr", "0.1"], "--lr is --learning-rate (per 256 images) here"),
    (["--lr-step-size", "5"], "--lr-step-size only applies to --lr-scheduler step, not cosine"),
    (["--lr-gamma", "0.5"], "--lr-gamma only applies to --lr-scheduler step or exponential, not cosine"),
    (["--lr-scheduler", "step", "--lr-gamma", "1.5"], "--lr-gamma must be in (0, 1]"),
    (["--model-ema-decay", "0.99"], "--model-ema-decay needs --model-ema"),
    (["--model-ema", "--model-ema-decay", "1.5"], "--model-ema-decay must be in [0, 1)"),
    (["--opt", "adamw", "--momentum", "0.8"], "--momentum does not apply to --opt adamw"),
    (["--mixup-alpha", "-1"], "--mixup-alpha must be >= 0"),
    (["--random-erase", "1.5"], "--random-erase must be a probability in [0, 1]"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0"),
    (["--recipe", "fixres-resnet50-finetune"], "--recipe fixres-resnet50-finetune is for main_finetune.py"),
    (["--recipe", "foo"], "unknown recipe 'foo'; there are fixres-resnet50-train"),
    (["--eval-only", "--weight-path", "w.pth", "--model-ema"], "give --eval-only --weight-key model_ema"),
    (["--eval-only", "--weight-path", "w.pth", "--mixup-alpha", "0.2"], "--mixup-alpha does not apply to --eval-only"),
    (["--eval-only", "--weight-path", "w.pth", "--ra-sampler"], "--ra-sampler does not apply to --eval-only"),
    (["--eval-only", "--weight-path", "w.pth", "--export"], "--export does not apply to --eval-only"),
    (["--lr-scheduler", "exponential", "--lr-step-size", "7"], "--lr-step-size only applies to --lr-scheduler step"),
    (["--opt", "sgd_nesterov", "--momentum", "0"], "--opt sgd-nesterov needs a --momentum above 0"),
    (["--weight-decay", "1e308"], "--weight-decay must be at most 1"),
    (["--norm-weight-decay", "2"], "--norm-weight-decay must be at most 1"),
    (["--mixup-alpha", "1e-320"], "--mixup-alpha must be 0 (off) or in [0.001, 1000]"),
    (["--cutmix-alpha", "1e308"], "--cutmix-alpha must be 0 (off) or in [0.001, 1000]"),
    (["--ra-sampler", "--ra-reps", "1000000000000000000000"], "--ra-reps must be at most 32"),
    (["--no-ra-sampler", "--ra-reps", "2"], "--ra-reps needs --ra-sampler, not --no-ra-sampler"),
    (["--lr=0.1"], "--lr is --learning-rate (per 256 images) here"),
    (["--smoothing=0.1"], "--smoothing is --label-smoothing here"),
])
def test_bad_combinations_are_one_line_before_anything_starts(capsys, tmp_path, argv, message):
    status, err = run_main(capsys, "scratch", "--shared-folder-path", tmp_path, *argv)
    assert status != 0 and message in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--mixup-alpha", "0.2"], "--mixup-alpha/--cutmix-alpha do not go with --finetune-scope head+last-norm"),
    (["--cutmix-alpha", "1", "--finetune-scope", "head"], "do not go with --finetune-scope head"),
    (["--auto-augment", "ra"], "--auto-augment only applies to main_scratch.py"),
    (["--random-erase", "0.1"], "--random-erase only applies to main_scratch.py"),
    (["--opt", "rmsproptf"], "timm's --opt rmsproptf is --opt rmsprop"),
    (["--ra-sampler", "--ra-reps", "0"], "must be a positive whole number"),
    (["--ra-sampler"], "--ra-sampler with --finetune-augmentation test would train on identical copies"),
])
def test_finetune_refuses_what_would_defeat_fixres(capsys, tmp_path, argv, message):
    status, err = run_main(capsys, "finetune", "--weight-path", tmp_path / "w.pth", "--shared-folder-path", tmp_path,
                           *argv)
    assert status != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_ra_reps_zero_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser("scratch").parse_args(["--ra-sampler", "--ra-reps", "0"])
    assert exit_info.value.code == 2 and "--ra-reps: must be a positive whole number, got 0" in capsys.readouterr().err


def test_options_added_later_keep_older_job_ids():
    """A job started before these options existed keeps its derived id (same command, same folder)."""
    base = TrainerConfig()
    assert base.derived_job_id() == "scratch-resnet18-a7af2a1a60e5"  # the id of this configuration before issue 16
    assert TrainerConfig(model_ema=True).derived_job_id() != base.derived_job_id()
    saved = {k: v for k, v in base.to_dict().items() if k not in ("opt", "model_ema", "ra_reps", "mixup_alpha")}
    assert TrainerConfig().changed_since(saved) == []
    assert TrainerConfig(ra_reps=3).changed_since(saved) == ["ra_reps"]


# ------------------------------------------------- everything on, interrupted, resumed
ALL_OPTIONS = ["--model-ema", "--model-ema-steps", "2", "--ra-sampler", "--ra-reps", "2", "--mixup-alpha", "0.2",
               "--cutmix-alpha", "1.0", "--label-smoothing", "0.1", "--auto-augment", "ta_wide", "--random-erase",
               "0.25", "--opt", "sgd-nesterov", "--lr-scheduler", "step", "--lr-step-size", "1", "--lr-gamma", "0.5",
               "--clip-grad-norm", "5", "--grad-accum-steps", "2", "--warmup-epochs", "0.5", "--tensorboard"]


# resnet20 at 16 px, 1 epoch: what these tests check is not the network's work
SMALL = ["--architecture", "resnet20", "--input-size", "16", "--batch", "8", "--epochs", "1", "--workers", "0",
         "--no-progress"]


def _train_all(folder, data, job, fault=None):
    return run_script("scratch", "--num-tasks", 2, "--job-id", job, "--shared-folder-path", folder, "--data-path", data,
                      "--architecture", "resnet20", "--input-size", 16, "--batch", 4, "--epochs", 2, "--workers", 1,
                      "--no-progress", *ALL_OPTIONS, env={"FIXRES_FAULT": fault} if fault else None)


def _scalars(job_folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(job_folder / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.numeric
def test_all_options_on_two_ranks_stopped_mid_epoch_resume_bit_identical(tmp_path):
    """EMA + repeated augmentation + mixup/cutmix + TrivialAugment + random erasing + accumulation +
    clipping + a step schedule on 2 ranks: a run stopped by a signal mid-epoch and run again ends with
    exactly the weights, EMA and metrics of a run never stopped, and its TensorBoard curves hold each
    point once (40 images, 2 ranks x 4 x 2 micro-batches = 16 a step: 3 steps an epoch, the last of 8)."""
    from fixres_dist.training.checkpoint import load_checkpoint
    data = make_subset(tmp_path / "data", 4, 1)
    straight = _train_all(tmp_path, data, "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "repeated augmentation x2" in straight.stdout and "x 2 accumulated" in straight.stdout
    first = _train_all(tmp_path, data, "job", fault="signal:rank=1:step=1")
    assert first.returncode == 3, first.stderr[-3000:]
    stopped = load_checkpoint(tmp_path / "job" / "checkpoint.pth")
    assert stopped["epoch"] == 0 and 0 < stopped["images_in_epoch"] < 40 and stopped["model_ema_state"]["updates"] >= 1
    second = _train_all(tmp_path, data, "job")
    assert second.returncode == 0, second.stderr[-3000:]
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pth")
    b = load_checkpoint(tmp_path / "job" / "checkpoint.pth")
    assert a["global_step"] == b["global_step"] == 6
    for key in ("model", "model_ema"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    assert not torch.equal(a["model"]["fc.weight"], a["model_ema"]["fc.weight"])
    for rank_a, rank_b in zip(a["ranks"], b["ranks"]):
        for name in rank_a["ema_buffers"]:
            assert torch.equal(rank_a["ema_buffers"][name], rank_b["ema_buffers"][name])

    def scores(state):
        return [(e["event"], e.get("epoch"), e.get("loss"), e.get("top1")) for e in state["metrics"]
                if e["event"] in ("train", "eval", "ema_eval")]
    assert scores(a) == scores(b) and [s[0] for s in scores(a)] == ["train", "eval", "ema_eval"] * 2
    curves, resumed = _scalars(tmp_path / "straight"), _scalars(tmp_path / "job")
    assert curves.keys() == resumed.keys()
    assert {"train/loss", "train/loss_step", "eval/top1/16px", "eval_ema/top1/16px"} <= curves.keys()
    for tag in curves:
        steps = [s for s, _ in resumed[tag]]
        assert steps == sorted(set(steps)) == [s for s, _ in curves[tag]], tag  # each point once, same axis
        if not tag.startswith(("train/img_per_s", "step_time_ms/", "peak_memory_gib/")):  # measured, not computed
            assert [v for _, v in resumed[tag]] == [v for _, v in curves[tag]], tag
    assert [s for s, _ in curves["train/loss"]] == [40, 80]  # x axis: images trained on


def test_the_ema_weights_are_evaluated_and_finetuned_with_weight_key(few_data, tmp_path, capsys):
    """--weight-key model_ema picks a checkpoint's EMA, with the checkpoint's configuration and lineage."""
    run = run_script("scratch", "--job-id", "ema", "--shared-folder-path", tmp_path, "--data-path", few_data, *SMALL,
                     "--model-ema", "--model-ema-steps", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "ema" / "metrics.jsonl").read_text().splitlines()]
    ema_top1 = [e["top1"] for e in events if e["event"] == "ema_eval"]
    assert len(ema_top1) == 1 and "eval EMA @16px" in run.stdout
    # one epoch, all of it warmup: the average never moves from the weights, and the run says so
    assert "warning: --model-ema gets 0 updates after the warmup in this run" in run.stdout
    assert "Warning" not in run.stderr, run.stderr  # logged once, as a line: not a Python warning as well
    evaluation = run_script("scratch", "--eval-only", "--weight-path", tmp_path / "ema" / "checkpoint.pth",
                            "--weight-key", "model_ema", "--job-id", "ev", "--shared-folder-path", tmp_path,
                            "--data-path", few_data, *SMALL)
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert "entry 'model_ema'" in evaluation.stdout and "trained from scratch at 16 px" in evaluation.stdout
    top1 = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()
            if '"eval"' in line][-1]["top1"]
    assert math.isclose(top1, ema_top1[0], abs_tol=1e-9)


def test_refused_before_anything_starts_for_the_data_and_folders_given(capsys, tmp_path, tiny_data):
    """A step larger than the training set (80 images) with accumulation; a tensorboard/ that is a file."""
    status, err = run_main(capsys, "scratch", "--shared-folder-path", tmp_path, "--data-path", tiny_data, "--batch", 8,
                           "--grad-accum-steps", 6, "--num-tasks", 2, "--job-id", "big")
    assert status != 0 and len(err.strip().splitlines()) == 1, err
    assert "--grad-accum-steps 6: one step would take 96 images (--batch 8 x 2 rank(s) x 6), more than the 80" in err
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "tensorboard").write_text("")
    status, err = run_main(capsys, "scratch", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                           "--tensorboard", "--job-id", "tb")
    assert status != 0 and "tensorboard: it is a file, not a folder" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tb"] and [p.name for p in (tmp_path / "tb").iterdir()] == \
        ["tensorboard"]


def test_accumulation_with_synchronised_batchnorm_on_a_last_step_split_unevenly(tmp_path):
    """35 images, 2 ranks x 7 x 2 micro-batches: the last step's 7 images split 4/3, and both ranks still take
    the same number of micro-batches (each a collective of the synchronised BatchNorm)."""
    data = make_subset(tmp_path / "d35", 5, 2, classes=7)
    run = run_script("scratch", "--num-tasks", 2, "--job-id", "acc", "--shared-folder-path", tmp_path,
                     "--data-path", data, "--architecture", "resnet20", "--input-size", 16, "--batch", 7,
                     "--grad-accum-steps", 2, "--sync-bn", "--epochs", 1, "--workers", 0, "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 steps per epoch" in run.stdout


def test_an_average_never_updated_is_refused_as_weights(tmp_path):
    from fixres_dist.models.weights import read_weight_file
    model = torchvision.models.resnet18(num_classes=3).state_dict()
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": model, "model_ema": model, "model_ema_state": {"updates": 0}, "config": {}}, path)
    with pytest.raises(FixresError, match="--weight-key model_ema: the average in .* was never updated"):
        read_weight_file(path, "model_ema")
    assert read_weight_file(path).key == "model"
    torch.save({"model": model, "model_ema": model, "model_ema_state": {"updates": 3}, "config": {}}, path)
    assert read_weight_file(path, "model_ema").key == "model_ema"


def test_tensorboard_turned_on_at_a_rerun_writes_the_curves_from_the_start(few_data, tmp_path):
    """A job stopped mid-epoch 2 without --tensorboard, rerun with it: the per-epoch curves hold both
    epochs (replayed from the checkpoint's history), each point once (20 images, 3 steps an epoch:
    8, 8, 4; stopped after step 5, at image 36)."""
    command = ["--job-id", "late", "--shared-folder-path", tmp_path, "--data-path", few_data, *SMALL, "--epochs", 2]
    first = run_script("scratch", *command, env={"FIXRES_FAULT": "signal:rank=0:step=5"})
    assert first.returncode == 3, first.stderr[-3000:]
    second = run_script("scratch", *command, "--tensorboard")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "the curves from image 0 on rewritten from the checkpoint's history" in second.stdout
    curves = _scalars(tmp_path / "late")
    assert [s for s, _ in curves["train/loss"]] == [20, 40] and [s for s, _ in curves["eval/top1/16px"]] == [20, 40]
    assert min(s for s, _ in curves["train/loss_step"]) == 36  # per-step points only from the rerun on (step 6)
