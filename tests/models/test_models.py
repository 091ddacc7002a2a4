"""Low-resolution networks (CIFAR ResNets, the low-resolution ResNet stem) and the data-flow choice of
the last norm and head that a FixRes finetune trains (issue 10, items 1 and 2)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from conftest import run_main, run_script
from fixres_dist import FixresError
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures, weights

# name -> (n, parameters with 10 classes). He et al. 2016, Table 6: 0.27M, 0.46M, 0.66M, 0.85M, 1.7M
# with option A shortcuts; ours (option B) add 2 projections: 16*32 + 2*32 + 32*64 + 2*64 = 2,752.
CIFAR = {"resnet20": (3, 272_474), "resnet32": (5, 466_906), "resnet44": (7, 661_338),
         "resnet56": (9, 855_770), "resnet110": (18, 1_730_714)}
PAPER_PARAMS = {"resnet20": 0.27e6, "resnet32": 0.46e6, "resnet44": 0.66e6, "resnet56": 0.85e6, "resnet110": 1.7e6}
PROJECTIONS = 2_752


# ------------------------------------------------------------------------------- CIFAR ResNets
@pytest.mark.parametrize("name", list(CIFAR))
def test_cifar_resnet_has_6n_plus_2_layers_and_its_parameter_count(name):
    n, params = CIFAR[name]
    model = architectures.build_model(name, 10)
    assert name in architectures.available_architectures()
    architectures.check_architecture(name)
    architectures.check_resolution(name, 17)
    assert sum(p.numel() for p in model.parameters()) == params
    option_a = (params - PROJECTIONS) / 1e6  # rounded as the paper rounds: 2 significant digits
    assert round(option_a, 2 if option_a < 1 else 1) == PAPER_PARAMS[name] / 1e6
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    main_path = [c for c in convs if c.kernel_size == (3, 3)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(main_path) + len(linears) == 6 * n + 2 and len(linears) == 1
    shortcuts = [c for c in convs if c.kernel_size == (1, 1)]  # option B, where the shape changes
    assert [(c.in_channels, c.out_channels, c.stride) for c in shortcuts] == [(16, 32, (2, 2)), (32, 64, (2, 2))]
    assert [len(stage) for stage in (model.layer1, model.layer2, model.layer3)] == [n, n, n]
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and model.conv1.out_channels == 16
    assert all(isinstance(block, BasicBlock) for stage in (model.layer1, model.layer2, model.layer3) for block in stage)


def test_cifar_resnet_has_total_stride_4_and_runs_at_any_size():
    model = architectures.build_model("resnet20", 7).eval()
    with torch.no_grad():
        assert model.features(torch.zeros(2, 3, 32, 32)).shape == (2, 64, 8, 8)
        assert model.features(torch.zeros(1, 3, 20, 20)).shape == (1, 64, 5, 5)
        for size in (8, 24, 48):
            out = model(torch.randn(2, 3, size, size))
            assert out.shape == (2, 7) and torch.isfinite(out).all()
    with pytest.raises(FixresError, match=r"6n\+2 layers .* got 21"):
        architectures.CifarResNet(21)


# ------------------------------------------------------------------------ low-resolution stem
def _body(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A torchvision ResNet's last feature map (before pooling)."""
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    return model.layer4(model.layer3(model.layer2(model.layer1(x))))


@pytest.mark.parametrize("name, width", [("resnet18", 512), ("resnet50", 2048)])
def test_low_res_stem_gives_total_stride_8(name, width):
    standard = architectures.build_model(name, 10).eval()
    low = architectures.build_model(name, 10, low_res_stem=True).eval()
    conv = low.conv1
    assert (conv.kernel_size, conv.stride, conv.padding, conv.out_channels) == ((3, 3), (1, 1), (1, 1), 64)
    assert conv.bias is None
    assert isinstance(low.maxpool, nn.Identity)
    with torch.no_grad():
        assert _body(standard, torch.zeros(1, 3, 64, 64)).shape == (1, width, 2, 2)  # stride 32
        assert _body(low, torch.zeros(1, 3, 24, 24)).shape == (1, width, 3, 3)  # stride 8
        assert _body(low, torch.zeros(1, 3, 16, 16)).shape == (1, width, 2, 2)
        assert low(torch.zeros(2, 3, 16, 16)).shape == (2, 10)
    # the rest of the network is unchanged: only conv1's shape differs
    differ = {k for k, v in standard.state_dict().items() if v.shape != low.state_dict()[k].shape}
    assert differ == {"conv1.weight"} and set(standard.state_dict()) == set(low.state_dict())
    with pytest.raises(FixresError, match=r"other --architecture, class count or --low-res-stem\?"):
        weights.load_weights(low, standard.state_dict(), "imagenet-stem.pth")


@pytest.mark.parametrize("name, why", [
    ("vit_b_16", "vit_b_16 has no ResNet stem to replace"),
    ("efficientnet_b0", "efficientnet_b0 has no ResNet stem to replace"),
    ("resnet20", "resnet20 already has a low-resolution stem"),
    ("regnet_y_400mf", "regnet_y_400mf has no ResNet stem to replace"),
])
def test_low_res_stem_of_another_architecture_is_refused(name, why):
    with pytest.raises(FixresError) as info:
        architectures.build_model(name, 10, low_res_stem=True)
    message = str(info.value)
    assert message.startswith(f"--low-res-stem: {why}") and "\n" not in message
    assert message.endswith("it applies to torchvision ResNets (resnet18, resnet34, resnet50, resnet101, "
                            "resnet152, resnext50_32x4d, resnext101_32x8d, resnext101_64x4d, wide_resnet50_2, "
                            "wide_resnet101_2)")
    architectures.check_architecture(name)  # fine without the stem


# ------------------------------------------------------------------- last norm by data flow
# (the head and last norm of each torchvision, CIFAR, Lite and ViT architecture: test_architectures.py)
def _projection_resnet() -> nn.Module:
    """ResNet(BasicBlock, [1, 1, 1, 1]): its only layer4 block has a projection shortcut."""
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _execution_order(model: nn.Module, size: int) -> list[str]:
    order = []
    hooks = [m.register_forward_hook(lambda *_, name=name: order.append(name))
             for name, m in model.named_modules() if isinstance(m, finetuning.NORM_TYPES)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, size, size))
    for h in hooks:
        h.remove()
    return order


def test_projection_shortcut_bn_runs_last_but_the_main_path_norm_is_chosen():
    model = _projection_resnet()
    assert _execution_order(model, 32)[-1] == "layer4.0.downsample.1"  # what execution order used to pick
    layers = finetuning.find_finetune_layers(model, 32)
    assert layers == finetuning.FinetuneLayers("fc", ("fc",), "layer4.0.bn2")
    assert finetuning.find_head_and_last_norm(model, 32) == ("fc", "layer4.0.bn2")
    assert set(finetuning.freeze_for_finetune(model, 32)) == {"fc.weight", "fc.bias", "layer4.0.bn2.weight",
                                                          "layer4.0.bn2.bias"}


def test_mobilenet_v3_head_includes_the_linear_between_norm_and_classifier():
    model = architectures.build_model("mobilenet_v3_large", 10)
    trainable = set(finetuning.freeze_for_finetune(model, 32, "head"))
    assert trainable == {"classifier.0.weight", "classifier.0.bias", "classifier.3.weight", "classifier.3.bias"}
    assert model.classifier[0].in_features == 960 and model.classifier[0].out_features == 1280


class _Unusual(nn.Module):
    """In-place ops (on the input too), data-dependent control flow (not fx-traceable), a shortcut
    norm that runs after the branch's, a two-layer classifier and a parameter of the root model."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.branch = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                    nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.shortcut = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x.mul_(1.0)  # in place on the input
        x = torch.relu_(self.stem(x))
        out = self.branch(x)
        out += self.shortcut(x)  # in place
        if out.sum() > -1e9:  # data-dependent: torch.fx cannot trace this
            out = torch.relu(out)
        out = out.mean((2, 3))
        return self.fc2(torch.relu(self.fc1(out))) * self.scale


def test_in_place_ops_and_untraceable_forward():
    model = _Unusual()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    layers = finetuning.find_finetune_layers(model, 8)
    assert layers == finetuning.FinetuneLayers("fc2", ("fc1", "fc2"), "branch.4")


def test_model_without_norm_trains_the_last_linear_and_what_follows():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    assert finetuning.find_finetune_layers(model, 8) == finetuning.FinetuneLayers("6", ("6",), None)
    with pytest.raises(FixresError, match="has no normalisation layer before its head 6; use --finetune-scope head"):
        finetuning.trainable_modules(model, 8)


# --------------------------------------------------------------------------- --last-norm
def test_last_norm_override_moves_the_head_start():
    layers = finetuning.find_finetune_layers(_projection_resnet(), 32, "layer4.0.bn1")
    assert layers == finetuning.FinetuneLayers("fc", ("layer4.0.conv2", "layer4.0.bn2", "fc"), "layer4.0.bn1")
    same = finetuning.find_finetune_layers(architectures.build_model("resnet18", 10), 32, "layer4.1.bn2")
    assert same == finetuning.FinetuneLayers("fc", ("fc",), "layer4.1.bn2")


@pytest.mark.parametrize("name, message", [
    ("layer4.0.downsample.1", "--last-norm layer4.0.downsample.1 is off the main path of ResNet (a shortcut, a "
                              "shorter parallel branch, or not between the input and the classifier fc); the "
                              "main-path last norm is layer4.0.bn2"),
    ("layer4.0.conv2", "--last-norm 'layer4.0.conv2' is a Conv2d, not a normalisation layer of ResNet; closest "
                       "normalisation layers: layer4.0.bn2, layer4.0.bn1, layer3.0.bn2 (the automatic choice is "
                       "layer4.0.bn2)"),
    ("layer4.0.bn3", "--last-norm 'layer4.0.bn3' names no module of ResNet; closest normalisation layers: "
                     "layer4.0.bn2, layer4.0.bn1, layer3.0.bn2 (the automatic choice is layer4.0.bn2)"),
])
def test_last_norm_override_refused(name, message):
    with pytest.raises(FixresError) as info:
        finetuning.trainable_modules(_projection_resnet(), 32, "head+last-norm", last_norm=name)
    assert str(info.value) == message


def test_finetune_resolution_below_the_train_resolution_warning():
    assert finetuning.finetune_resolution_warning(32, 48) is None
    assert finetuning.finetune_resolution_warning(None, 16) is None
    assert finetuning.finetune_resolution_warning(32, 32) is None
    warning = finetuning.finetune_resolution_warning(32, 24)
    assert warning == ("finetuning at 24 px, below the train resolution 32 px: FixRes predicts the opposite "
                       "(objects look larger in training; about 44 px matches their apparent size)")


def test_last_norm_and_low_res_stem_end_to_end(few_data, tmp_path, capsys):
    """main_finetune.py: an accepted --last-norm trains what it names, with the below-train-resolution
    warning; a refused one fails in preflight with one line; --low-res-stem weights need the flag."""
    start = architectures.build_model("resnet18", 10, low_res_stem=True)
    weights = tmp_path / "start.pth"
    torch.save(start.state_dict(), weights)
    common = ["--weight-path", weights, "--data-path", few_data, "--shared-folder-path", tmp_path / "runs",
              "--low-res-stem", "--input-size", 16, "--batch", 8, "--epochs", 1, "--workers", 0, "--no-progress"]
    ok = run_script("finetune", *common, "--job-id", "ok", "--last-norm", "layer4.1.bn1", "--train-size", "24")
    assert ok.returncode == 0, ok.stderr[-3000:]
    line = next(x for x in ok.stdout.splitlines() if x.startswith("finetuning (head+last-norm)"))
    assert set(line.split(": ", 1)[1].split(", ")) == {
        "layer4.1.conv2.weight", "layer4.1.bn2.weight", "layer4.1.bn2.bias", "fc.weight", "fc.bias",
        "layer4.1.bn1.weight", "layer4.1.bn1.bias"}
    assert "warning: finetuning at 16 px, below the train resolution 24 px: FixRes predicts the opposite" in ok.stdout
    assert (ok.stdout + ok.stderr).count("FixRes predicts the opposite") == 1  # one line, not a Python warning too
    config = (tmp_path / "runs" / "ok" / "config.json").read_text()
    assert '"last_norm": "layer4.1.bn1"' in config and '"low_res_stem": true' in config

    code, err = run_main(capsys, "finetune", *common, "--job-id", "bad", "--last-norm", "layer4.0.downsample.1")
    assert code == 1
    assert err.strip() == ("fixres_dist: rank 0: --last-norm layer4.0.downsample.1 is off the main path of "
                           "ResNet (a shortcut, a shorter parallel branch, or not between the input and the "
                           "classifier fc); the main-path last norm is layer4.1.bn2")
    assert not (tmp_path / "runs" / "bad").exists()
