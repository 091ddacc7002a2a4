"""Recipe defaults and options: learning rates per 256 images, label smoothing, norm/bias weight decay,
and the configuration's own knowledge (which fields a resume may change)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import FAST
from fixres_dist import FixresError, TrainerConfig
from fixres_dist.entry.cli import FIXRES_FINETUNE_LR_PER_256, MODE_DEFAULTS, build_parser, config_fields
from fixres_dist.entry.launch import main
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures
from fixres_dist.training import engine, optim
from fixres_dist.training.checkpoint import check_resumable


def test_learning_rate_defaults_per_256_images():
    assert TrainerConfig().learning_rate == 0.1
    assert config_fields(build_parser("scratch").parse_args([]), "scratch")["learning_rate"] == 0.1
    assert config_fields(build_parser("finetune").parse_args([]), "finetune")["learning_rate"] == 0.05
    assert FIXRES_FINETUNE_LR_PER_256 == pytest.approx(4e-3)  # FixRes: 8e-3 for 8 GPUs x 64 images
    assert "0.004 per 256" in " ".join(build_parser("finetune").format_help().split())


def test_new_options_default_off_and_parse():
    config = TrainerConfig()
    assert config.label_smoothing == 0.0 and config.norm_weight_decay == 0.0
    fields = config_fields(build_parser("scratch").parse_args(["--label-smoothing", "0.1",
                                                               "--norm-weight-decay", "1e-5"]), "scratch")
    assert TrainerConfig(**fields).label_smoothing == 0.1 and TrainerConfig(**fields).norm_weight_decay == 1e-5


def test_cli_scopes_are_the_finetune_scopes():
    action = next(a for a in build_parser("finetune")._actions if a.dest == "finetune_scope")
    assert tuple(action.choices) == finetuning.SCOPES
    assert set(MODE_DEFAULTS) == {"scratch", "finetune"}


@pytest.mark.parametrize("args, message", [
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
    (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1), got -0.1"),
    (["--label-smoothing", "nan"], "--label-smoothing must be a finite number"),
    (["--norm-weight-decay", "-1"], "--norm-weight-decay must be >= 0, got -1.0"),
])
def test_bad_recipe_values_are_refused_in_one_line(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main("scratch", ["--shared-folder-path", str(tmp_path / "s"), *FAST, *args])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fixres_dist: rank 0:") and message in err, err
    assert not (tmp_path / "s").exists()


def test_norms_and_biases_get_their_own_weight_decay():
    model = architectures.build_model("resnet18", 10)
    groups = optim.parameter_groups(model, weight_decay=5e-5, norm_weight_decay=0.0)
    assert [g["weight_decay"] for g in groups] == [5e-5, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, exempt = ({names[id(p)] for p in g["params"]} for g in groups)
    assert decayed == {n for n, p in model.named_parameters() if p.dim() > 1}  # convolutions and fc.weight
    assert "fc.bias" in exempt and "bn1.weight" in exempt and "layer4.1.bn2.bias" in exempt
    assert decayed | exempt == set(names.values()) and not decayed & exempt
    # frozen parameters are left out; empty groups too
    finetuning.freeze_for_finetune(model, 32, "head")
    groups = optim.parameter_groups(model, 5e-5, 0.0)
    assert [sorted(names[id(p)] for p in g["params"]) for g in groups] == [["fc.weight"], ["fc.bias"]]


def test_norm_weight_decay_reaches_the_optimizer(tiny_data, tmp_path):
    from fixres_dist import Trainer
    config = TrainerConfig(data_path=str(tiny_data), shared_folder_path=str(tmp_path), job_id="wd", batch=8,
                           epochs=1, warmup_epochs=0, workers=0, progress=False, weight_decay=1e-4,
                           norm_weight_decay=3e-6)
    trainer = Trainer(config)
    try:
        trainer.build()
        assert [g["weight_decay"] for g in trainer.step.optimizer.param_groups] == [1e-4, 3e-6]
    finally:
        trainer.close()


def _step_loss(label_smoothing: float) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5))
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(6) % 5
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    reference = copy.deepcopy(model)
    loss = engine.train_step(model, optimizer, scaler, images, labels,
                             engine.StepSettings(torch.device("cpu"), label_smoothing=label_smoothing))
    from fixres_dist.data.pipeline import normalize
    expected = F.cross_entropy(reference(normalize(images)), labels, reduction="sum", label_smoothing=label_smoothing)
    assert loss.item() == expected.item()  # the same computation: bit for bit
    return loss.item()


@pytest.mark.numeric
def test_label_smoothing_changes_the_training_loss():
    assert _step_loss(0.1) != pytest.approx(_step_loss(0.0), rel=1e-4)


def test_resumable_fields_come_from_the_configuration():
    resumable = TrainerConfig.resumable_fields()
    assert {"num_tasks", "global_rank", "job_id", "dist_url", "workers", "amp", "compile"} <= resumable
    assert not {"learning_rate", "label_smoothing", "norm_weight_decay", "seed", "architecture"} & resumable
    saved = TrainerConfig(job_id="a", workers=0).to_dict()
    assert TrainerConfig(job_id="b", workers=3, num_tasks=2).changed_since(saved) == []
    assert TrainerConfig(label_smoothing=0.1).changed_since(saved) == ["label_smoothing"]
    # a checkpoint written before a field existed is of another recipe: refused in one line
    older = {k: v for k, v in saved.items() if k != "norm_weight_decay"}
    assert TrainerConfig().changed_since(older) == ["norm_weight_decay"]
    with pytest.raises(FixresError, match=r"norm_weight_decay: absent \(an older fixres_dist\) -> 0.0"):
        check_resumable(TrainerConfig(), older, "old.pth")
    with pytest.raises(FixresError, match=r"another configuration \(learning_rate: 0.1 -> 0.3\)"):
        check_resumable(TrainerConfig(learning_rate=0.3), saved, "ckpt.pth")
    # fields whose default is what older versions did (issue 13): absent means the default
    new_in_13 = ("weight_key", "mean", "std", "crop_ratio", "interpolation")
    before_13 = {k: v for k, v in saved.items() if k not in new_in_13}
    assert TrainerConfig().changed_since(before_13) == []
    assert TrainerConfig(mean=0.5, std=0.2, crop_ratio=0.9).changed_since(before_13) == ["crop_ratio", "mean", "std"]
    assert TrainerConfig.from_json(TrainerConfig(mean=0.5, std=(0.1, 0.2, 0.3)).to_json()).changed_since(
        TrainerConfig(mean=0.5, std=(0.1, 0.2, 0.3)).to_dict()) == []


def test_placed_fills_job_id_and_rendezvous_in_one_place(tmp_path):
    template = TrainerConfig(shared_folder_path=str(tmp_path))
    two = template.placed(num_tasks=2, global_rank=1, local_rank=1, job_id="j")
    assert two.dist_url == f"file://{tmp_path}/j/rendezvous.json" == two.rendezvous_url()
    assert two.rendezvous_url("rendezvous-3.json").endswith("/j/rendezvous-3.json")
    one = template.placed(num_tasks=1, global_rank=0, local_rank=0)
    assert one.dist_url == "env://" and one.job_id == template.derived_job_id()
    assert one.job_id.startswith("scratch-resnet18-") and len(one.job_id) == len("scratch-resnet18-") + 12
    given = template.placed(num_tasks=2, global_rank=0, local_rank=0, job_id="j", dist_url="tcp://h:1")
    assert given.dist_url == "tcp://h:1"


def test_derived_job_ids_follow_what_shapes_the_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    base = TrainerConfig(data_path="data").derived_job_id()
    for same in (TrainerConfig(data_path="./data/"), TrainerConfig(data_path=str(tmp_path / "data")),
                 TrainerConfig(data_path="data", num_tasks=4, workers=0, resume="x.pth", dist_timeout=9.0)):
        assert same.derived_job_id() == base
    for other in (TrainerConfig(data_path="data", seed=1), TrainerConfig(data_path="data", epochs=7),
                  TrainerConfig(data_path="other"), TrainerConfig(data_path="data", architecture="resnet34")):
        assert other.derived_job_id() != base
    assert TrainerConfig(architecture="timm/vit_tiny_patch16_224").derived_job_id().startswith(
        "scratch-timm-vit_tiny_patch16_224-")
