"""What a model's weights expect of their input: normalisation, test-time crop ratio, interpolation.

Weights are trained with one preprocessing and lose accuracy under another. For each architecture
(:func:`architecture_preprocessing`):

* ``timm/<name>``: the model's pretrained configuration in timm (``mean``/``std``: 0.5 for many
  ViTs; ``crop_pct``: 0.9 for ViTs, 0.95 for timm's ResNets; ``interpolation``: mostly bicubic);
* ``efficientnet_lite*``: mean 127, std 128 on the 0-255 scale (the TensorFlow Lite models'
  training normalisation, kept by the PyTorch port ``efficientnet-lite-pytorch``), crop 0.875,
  bilinear;
* everything else (torchvision's models, the CIFAR ResNets): ImageNet's mean (0.485, 0.456, 0.406)
  and std (0.229, 0.224, 0.225), crop 0.875 (224 of 256 px), bilinear: the default.

Explicit values win (``--mean``/``--std``, ``--crop-ratio``, ``--interpolation``), then those a
fixres_dist checkpoint given as ``--weight-path`` was trained with (its saved configuration), then
the architecture's (:func:`resolve`). The Trainer logs the result at start
(:meth:`Preprocessing.describe`) and applies it in training, evaluation and feature extraction
(:func:`fixres_dist.data.pipeline.normalize`, the transforms of :mod:`fixres_dist.data.pipeline`).
"""
from __future__ import annotations

import attrs

from fixres_dist.config import CROP_RATIO, DEFAULT_INTERPOLATION, INTERPOLATIONS
from fixres_dist.data.pipeline import IMAGENET_NORMALIZATION
from fixres_dist.models.architectures import LITE_MODELS, TIMM_PREFIX, import_optional

# EfficientNet-Lite's TensorFlow Lite training normalisation: (x - 127) / 128 on the 0-255 scale.
LITE_NORMALIZATION = ((127 / 255,) * 3, (128 / 255,) * 3)


@attrs.frozen
class Preprocessing:
    """``mean``/``std``: 3 floats each (R, G, B) on the 0-1 scale; ``crop_ratio`` in (0, 1]: the
    test-time centre crop's share of the resized shorter side; ``interpolation``: ``bilinear``,
    ``bicubic`` or ``nearest``; ``source``: where each came from, for the log."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_ratio: float = CROP_RATIO
    interpolation: str = DEFAULT_INTERPOLATION
    source: str = "ImageNet's default"

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(mean, std)`` as :func:`fixres_dist.data.pipeline.normalize` takes it."""
        return self.mean, self.std

    def describe(self) -> str:
        """One line for the log, e.g. ``input preprocessing: mean 0.5,0.5,0.5, std ..., crop 0.9, bicubic (...)``."""
        def channels(values):
            return ",".join(f"{v:.4g}" for v in values)
        return (f"input preprocessing: mean {channels(self.mean)}, std {channels(self.std)}, test crop "
                f"{self.crop_ratio:g}, {self.interpolation} ({self.source})")


def _timm_config(name: str):
    timm = import_optional("timm", name)
    return timm.models.get_pretrained_cfg(name[len(TIMM_PREFIX):])


def architecture_preprocessing(name: str) -> Preprocessing:
    """The preprocessing architecture ``name``'s weights expect (see the module docstring).

    Raises :class:`~fixres_dist.errors.FixresError` for ``timm/<name>`` without timm installed.
    """
    if name in LITE_MODELS:
        return Preprocessing(*LITE_NORMALIZATION, source="EfficientNet-Lite's 127/128")
    if name.startswith(TIMM_PREFIX):
        config = _timm_config(name)
        if config is not None:
            mean = tuple(config.mean) if getattr(config, "mean", None) else IMAGENET_NORMALIZATION[0]
            std = tuple(config.std) if getattr(config, "std", None) else IMAGENET_NORMALIZATION[1]
            crop = getattr(config, "crop_pct", None) or CROP_RATIO
            interpolation = getattr(config, "interpolation", None)
            interpolation = interpolation if interpolation in INTERPOLATIONS else DEFAULT_INTERPOLATION
            return Preprocessing(mean, std, min(float(crop), 1.0), interpolation,
                                 f"timm's pretrained config of {name[len(TIMM_PREFIX):]}")
    return Preprocessing(*IMAGENET_NORMALIZATION)


def input_normalization(name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` per RGB channel, on the 0-1 scale, that architecture ``name``'s weights expect."""
    return architecture_preprocessing(name).normalization


_FIELDS = ("mean", "std", "crop_ratio", "interpolation")


def resolve(config, weight_config: dict | None = None) -> Preprocessing:
    """The preprocessing of a run: per field, ``config``'s explicit value (a
    :class:`~fixres_dist.config.TrainerConfig`; None means not given), else ``weight_config``'s (the
    configuration saved in a fixres_dist checkpoint used as ``--weight-path``, if it gave one), else
    the architecture's (:func:`architecture_preprocessing`)."""
    chosen = architecture_preprocessing(config.architecture)
    values, sources = {}, []
    for field in _FIELDS:
        mine = getattr(config, field)
        theirs = (weight_config or {}).get(field)
        if mine is not None:
            values[field] = tuple(mine) if isinstance(mine, (list, tuple)) else mine
            sources.append(f"--{field.replace('_', '-')}")
        elif theirs is not None:
            values[field] = tuple(theirs) if isinstance(theirs, (list, tuple)) else theirs
            sources.append(f"{field.replace('_', ' ')} of the weights' run")
    if not values:
        return chosen
    source = ", ".join(sources) + f"; otherwise {chosen.source}"
    return attrs.evolve(chosen, **values, source=source)
