"""Named training recipes (``--recipe NAME``): presets of :class:`~fixres_dist.config.TrainerConfig`
fields taken from the papers and reference scripts users switch from.

A recipe fills fields after the script's defaults and before the command line, so every flag given
explicitly overrides it; the run prints the recipe in full at its start (:func:`describe`) and
``config.json`` stores its name and every value used. Learning rates are per 256 images (the linear
scaling rule, :func:`fixres_dist.training.optim.scaled_learning_rate`), converted from each source's global
batch. This module imports nothing heavy (``--help`` lists the names).
"""
from __future__ import annotations

import attrs


@attrs.frozen
class Recipe:
    """A preset: the script it is for (``scratch``/``finetune``), the fields it sets, and where they come from."""

    name: str
    mode: str
    fields: dict
    source: str


RECIPES = {recipe.name: recipe for recipe in (
    Recipe("fixres-resnet50-train", "scratch", {
        "architecture": "resnet50", "input_size": 224, "batch": 64, "epochs": 240, "learning_rate": 0.08,
        "opt": "sgd", "momentum": 0.9, "weight_decay": 1e-4, "norm_weight_decay": 1e-4, "warmup_epochs": 0.0,
        "lr_scheduler": "step", "lr_step_size": 60, "lr_gamma": 0.1, "label_smoothing": 0.0, "ra_reps": 3},
        "FixRes (Touvron et al., NeurIPS 2019), main_resnet50_scratch.py: 8 GPUs x 64 images, lr 0.02 scaled as "
        "8 x lr x 512 / 512 = 0.16 for 512 images (0.08 per 256), SGD momentum 0.9, weight decay 1e-4 on every "
        "parameter, StepLR(30) over 120 epochs, repeated augmentation x3. Their sampler drew twice the dataset per "
        "epoch (len_factor 2, capped at 5,005 steps of 512 images), so the same images seen are 240 epochs here "
        "with a step every 60"),
    Recipe("fixres-resnet50-finetune", "finetune", {
        "architecture": "resnet50", "input_size": 384, "batch": 64, "epochs": 56, "learning_rate": 0.004,
        "opt": "sgd", "momentum": 0.9, "weight_decay": 1e-4, "norm_weight_decay": 1e-4, "warmup_epochs": 0.0,
        "lr_scheduler": "step", "lr_step_size": 30, "lr_gamma": 0.1, "finetune_scope": "head+last-norm",
        "finetune_augmentation": "test"},
        "FixRes README, FixResNet-50: main_finetune.py --input-size 384 --epochs 56 --batch 64 --num-tasks 8 "
        "--learning-rate 1e-3, scaled as 8 x lr x 512 / 512 = 8e-3 for 512 images (0.004 per 256); SGD momentum "
        "0.9, weight decay 1e-4, StepLR(30); the test transform; the classifier and the last BatchNorm train "
        "(section 4). Give --weight-path (a ResNet-50 trained at 224 px)"),
    Recipe("torchvision-resnet50", "scratch", {
        "architecture": "resnet50", "input_size": 176, "test_size": 224, "crop_ratio": 224 / 232, "batch": 128,
        "epochs": 600, "learning_rate": 0.125, "opt": "sgd", "momentum": 0.9, "weight_decay": 2e-5,
        "norm_weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_epochs": 5.0, "label_smoothing": 0.1,
        "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "auto_augment": "ta_wide", "random_erase": 0.1,
        "model_ema": True, "model_ema_steps": 32, "model_ema_decay": 0.998908, "ra_reps": 4},
        "torchvision's ResNet50_Weights.IMAGENET1K_V2 recipe (references/classification, 80.86 % top-1): 8 GPUs x "
        "128 images, lr 0.5 (0.125 per 256), cosine after 5 warmup epochs, TrivialAugment, random erasing 0.1, "
        "label smoothing 0.1, mixup 0.2, cutmix 1.0, weight decay 2e-5 (none on norms), train crop 176, test "
        "resize 232 and crop 224, EMA every 32 steps, repeated augmentation x4. Their --model-ema-decay 0.99998 "
        "is rescaled by world x batch x steps / epochs (1,024 x 32 / 600): 0.998908 per update here, where the "
        "decay is per update as given. Their warmup starts at 1 % of the rate, ours at 0"),
)}


def recipe_fields(name: str, mode: str) -> dict:
    """The fields recipe ``name`` sets, for the script of ``mode``. Raises ValueError (one line) for an
    unknown name or a recipe of the other script."""
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ValueError(f"unknown recipe {name!r}; there are {', '.join(RECIPES)}")
    if recipe.mode != mode:
        raise ValueError(f"--recipe {name} is for main_{recipe.mode}.py, not main_{mode}.py")
    return dict(recipe.fields)


# A recipe's fields that only make sense with another one's value: overriding the first alone keeps
# the others at the recipe's scale (a 600-epoch warmup and step size on a 2-epoch run).
SCALES_WITH = {"epochs": ("warmup_epochs", "lr_step_size"), "input_size": ("test_size",)}


def describe(config) -> str:
    """The recipe of ``config`` (a TrainerConfig with ``recipe`` set) in full: its source, then every
    field it sets as a flag with the value this run uses, marking those the command line overrode,
    and a note naming the recipe's values kept beside an override they scale with (:data:`SCALES_WITH`)."""
    recipe = RECIPES[config.recipe]
    flags, overridden = [], []
    for name, value in recipe.fields.items():
        used = getattr(config, name)
        flag = f"--{name.replace('_', '-')}" + ("" if used is True else f" {_shown(used)}")
        if name == "ra_reps" and used > 1:
            flag = f"--ra-sampler {flag}"
        flags.append(flag if used == value else f"{flag} (overrides the recipe's {_shown(value)})")
        overridden += [name] if used != value else []
    notes = []
    for name in overridden:
        kept = [f"--{other.replace('_', '-')} {_shown(getattr(config, other))}" for other in SCALES_WITH.get(name, ())
                if other in recipe.fields and getattr(config, other) == recipe.fields[other]]
        if kept:
            notes.append(f"note: --{name.replace('_', '-')} overridden, but {' and '.join(kept)} kept from the recipe: "
                         f"scale {'it' if len(kept) == 1 else 'them'} too")
    return f"recipe {recipe.name}: {recipe.source}.\n  " + "\n  ".join(flags + notes)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
