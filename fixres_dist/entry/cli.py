"""The command lines of ``main_scratch.py`` and ``main_finetune.py`` (FixRes flag names).

Each script's parser (:func:`build_parser`) lists only its own flags, with every default in its
help, taken from :data:`MODE_DEFAULTS` and :class:`~fixres_dist.config.TrainerConfig`. This module
imports nothing heavy (no torch, torchvision or numpy): ``--help`` and usage errors (exit status 2)
answer in a fraction of a second; :mod:`fixres_dist.entry.scripts` imports the launcher, and torch,
only once the command line has parsed.
"""
from __future__ import annotations

import argparse
import functools
import re

import attrs

from fixres_dist.arguments import Formatter as _Formatter
from fixres_dist.arguments import OneLineParser
from fixres_dist.arguments import pixels as _pixels
from fixres_dist.arguments import positive_int as _positive_int
from fixres_dist.arguments import training_size as _training_size
from fixres_dist.config import (
    AUTO_AUGMENT_POLICIES,
    BEST_METRICS,
    CIFAR_RESNETS,
    CROP_RATIO,
    DEFAULT_INTERPOLATION,
    INTERPOLATIONS,
    JPEG_DECODES,
    LITE_MODELS,
    LR_SCHEDULERS,
    OPTIMIZERS,
    OPTIONAL_PACKAGES,
    PIPELINE_SCHEDULES,
    SCOPES,
    SHARDINGS,
    TIMM_PREFIX,
    TRACKERS,
    WANDB_MODES,
    WORLD_CHANGES,
    TrainerConfig,
)
from fixres_dist.entry import config_file
from fixres_dist.errors import FixresError
from fixres_dist.training import recipes

# Defaults that differ between the two scripts; every other default lives in TrainerConfig.
# --learning-rate is per 256 images (linear scaling rule).
# Scratch: a low training resolution on the 28 px embedded images, lr 0.1 per 256 (Goyal et al.,
# arXiv 1706.02677: 0.1 for a batch of 256 with a warmup).
# Finetune: a higher test resolution, few epochs, no warmup, lr 0.05 per 256. FixRes' own finetune
# (facebookresearch/FixRes, imnet_finetune/train.py) set lr 1e-3 and scaled it as
# 8 x lr x batch per GPU x GPUs / 512: 8e-3 for 8 GPUs x 64 = 512 images, i.e. 4e-3 per 256, 12.5
# times less. Their classifier and BatchNorm start from a network trained on ImageNet to convergence;
# our demo finetunes a few-epoch model, whose head moves far more in 3 short epochs at 0.05.
# For a FixRes finetune of converged ImageNet weights, pass --learning-rate 4e-3.
FIXRES_FINETUNE_LR_PER_256 = 8 * 1e-3 * 256 / 512  # their scaling rule at a global batch of 256
MODE_DEFAULTS = {
    "scratch": {"input_size": 32, "epochs": 8, "learning_rate": 0.1, "warmup_epochs": 1.0},
    "finetune": {"input_size": 48, "epochs": 3, "learning_rate": 0.05, "warmup_epochs": 0.0},
}


# Defaults that follow from --device (itself cuda when available, else cpu): field -> (with cuda, with cpu).
DEVICE_DEFAULTS = {"dist_backend": ("nccl", "gloo"), "amp": ("bf16", "off"), "channels_last": (True, False)}
# Flags that place this process in its job: resolved by fixres_dist.distributed.placement, not configuration fields.
RANK_FLAGS = ("num_tasks", "global_rank", "local_rank", "job_id", "dist_url")
RA_REPS_DEFAULT = 3  # torchvision's --ra-reps default, and FixRes' repetitions
COMPILE_BACKEND = "inductor"  # what --compile alone uses
# main_finetune.py's own flags; main_scratch.py refuses them, naming the script they belong to.
FINETUNE_ONLY_FLAGS = ("--finetune-scope", "--last-norm", "--finetune-augmentation")
# main_scratch.py's only: the finetune's preprocessing is --finetune-augmentation's.
SCRATCH_ONLY_FLAGS = ("--auto-augment", "--random-erase")
# main_scratch.py's only too: a FixRes finetune runs its few epochs (config.py refuses them for a finetune).
EARLY_STOPPING_FLAGS = ("--early-stopping-patience", "--early-stopping-min-delta")


def defaults(mode: str) -> dict:
    """Every configuration field's value in ``mode`` when its flag is not given: :data:`MODE_DEFAULTS`
    over :class:`~fixres_dist.config.TrainerConfig`'s defaults (the device-dependent ones, and
    ``device`` itself, are decided by :func:`config_fields`)."""
    return {**{f.name: f.default for f in attrs.fields(TrainerConfig)}, **MODE_DEFAULTS[mode]}


def shown(value) -> str:
    """A default as ``--help`` writes it: ``on``/``off`` for booleans, ``5e-05`` for floats, ``none`` for an
    empty list, else as is."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == ():
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _finetune_size(text: str) -> int | str:
    """main_finetune.py's --input-size: pixels, or ``auto`` (the best of --test-sizes)."""
    return "auto" if text == "auto" else _pixels(text)


def _int_list(text: str, noun: str, smallest: int) -> tuple[int, ...]:
    """``"48,64,80"`` -> ``(48, 64, 80)``; every entry an integer ``noun`` >= ``smallest`` (0 or 1)."""
    values = []
    for entry in (e.strip() for e in text.split(",")):
        try:
            value = int(entry)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{entry!r} in {text!r} is not an integer {noun}") from None
        if value < smallest:
            raise argparse.ArgumentTypeError(f"{entry!r} in {text!r} is not a "
                                             f"{'positive' if smallest else 'non-negative'} {noun}")
        values.append(value)
    return tuple(values)


def _size_list(text: str) -> tuple[int, ...]:
    """``--test-sizes``: resolutions in pixels."""
    return _int_list(text, "number of pixels", 1)


def _piece_list(text: str) -> tuple[int, ...]:
    """``--pipeline-split``: piece indices."""
    return _int_list(text, "piece index", 0)


def _recipe(mode: str, name: str) -> str:
    """--recipe: a preset of this script (:mod:`fixres_dist.training.recipes`)."""
    try:
        recipes.recipe_fields(name, mode)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _scheduler(text: str) -> str:
    """--lr-scheduler: ours, or torchvision's name for it."""
    return SCHEDULER_ALIASES.get(text.lower(), text)


def _optimizer(text: str) -> str:
    """--opt: ours, or torchvision's spelling (``sgd_nesterov``); timm's and DeiT's names are answered
    with ours."""
    name = text.lower().replace("_", "-")
    if name in TIMM_OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"timm's --opt {text} is --opt {TIMM_OPTIMIZERS[name]} here")
    return name


def _channels(text: str) -> tuple[float, ...]:
    """``"0.5"`` -> ``(0.5, 0.5, 0.5)``; ``"0.485,0.456,0.406"`` -> three floats (R, G, B)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 1 or 3 comma-separated numbers") from None
    if len(values) not in (1, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 number (all channels) or 3 (R,G,B)")
    return values * 3 if len(values) == 1 else values


# The flags of torchvision's references/classification/train.py, DeiT's main.py and timm's train.py
# whose names differ here: an unrecognised one is answered with ours.
OTHER_NAMES = {"--lr": "--learning-rate (per 256 images)", "--batch-size": "--batch (per rank)", "-b": "--batch",
               "--model": "--architecture", "--wd": "--weight-decay", "--train-crop-size": "--input-size",
               "--val-crop-size": "--test-size", "--val-resize-size": "--crop-ratio (test crop / resize)",
               "--lr-warmup-epochs": "--warmup-epochs", "--test-only": "--eval-only",
               "--output-dir": "--shared-folder-path and --job-id", "--smoothing": "--label-smoothing",
               "--mixup": "--mixup-alpha", "--cutmix": "--cutmix-alpha", "--reprob": "--random-erase",
               "--clip-grad": "--clip-grad-norm", "--repeated-aug": "--ra-sampler", "--sched": "--lr-scheduler",
               "--decay-epochs": "--lr-step-size", "--decay-rate": "--lr-gamma", "--aa": "--auto-augment",
               "-j": "--workers", "--grad-accum": "--grad-accum-steps", "--model-ema-force-cpu": None,
               "--world-size": "--num-tasks", "--weights": "--weight-path (a local file)", "--sync_bn": "--sync-bn",
               "--output_dir": "--shared-folder-path and --job-id", "--batch_size": "--batch (per rank)",
               "--bias-weight-decay": "--norm-weight-decay (norms and every bias)",
               "--lr-warmup-method": "--warmup-epochs (always linear from 0)",
               "--lr-warmup-decay": "--warmup-epochs (always linear from 0)", "--data_path": "--data-path"}
# Options that only shape training, or (--export) use what it writes: given explicitly with --eval-only, they are
# refused (docs/recipes.md).
TRAINING_ONLY = ("opt", "lr_scheduler", "lr_step_size", "lr_gamma", "clip_grad_norm", "grad_accum_steps", "mixup_alpha",
                 "cutmix_alpha", "auto_augment", "random_erase", "ra_reps", "model_ema_decay", "model_ema_steps",
                 "label_smoothing", "export")
NO_POLICY = "none"  # --auto-augment none: no policy (overrides a recipe's)
# timm's (and DeiT's) --opt names: ours for them (timm's sgd and nesterov are Nesterov momentum).
TIMM_OPTIMIZERS = {"momentum": "sgd", "nesterov": "sgd-nesterov",
                   "rmsproptf": "rmsprop (torchvision's eps 0.0316 and alpha 0.9, close to TensorFlow's)"}
# torchvision's --lr-scheduler and --opt spellings, accepted as ours.
SCHEDULER_ALIASES = {"cosineannealinglr": "cosine", "steplr": "step", "exponentiallr": "exponential"}


class _Parser(OneLineParser):
    """:class:`~fixres_dist.arguments.OneLineParser` (usage errors in one line, ``check``) whose
    unrecognised flag of torchvision's, DeiT's or timm's scripts is answered with this tool's name for it."""

    def hint(self, message: str) -> str:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            named = [f"{flag} is {OTHER_NAMES[flag]} here" for flag in
                     (word.split("=", 1)[0] for word in unknown.group(1).split()) if OTHER_NAMES.get(flag)]
            if named:
                message += f" ({'; '.join(named)}: see docs/recipes.md)"
        return message


class _OtherScript(argparse.Action):
    """A flag of the other script (``const``: its name) given to this one: a usage error naming the script
    it belongs to (:attr:`belongs_to`, which a ``--config`` file's key of it is refused with too)."""

    @property
    def belongs_to(self) -> str:
        return self.const

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} only applies to {self.const}")


def _other_scripts_flags(group, flags, script: str) -> None:
    """``flags`` of ``script`` in this script's parser: hidden, and a usage error if given."""
    for flag in flags:
        group.add_argument(flag, action=_OtherScript, const=script, nargs="?", default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)


def _architecture_help(default: str) -> str:
    """--architecture's help: the accepted name families (:mod:`fixres_dist.models.architectures`), without
    torchvision."""
    lite_extra, timm_extra = OPTIONAL_PACKAGES["efficientnet_lite_pytorch"][1], OPTIONAL_PACKAGES["timm"][1]
    lite = list(LITE_MODELS)
    return (f"model name ({default}): any torchvision classification model, e.g. resnet50, convnext_tiny, "
            f"vit_b_16; {lite[0]} ... {lite[-1]} (needs the {lite_extra} extra); the CIFAR ResNets "
            f"{', '.join(CIFAR_RESNETS)} (He et al. 2016, total stride 4: for inputs of about 64 px and below); "
            f"or {TIMM_PREFIX}<name>, any timm model (needs the {timm_extra} extra). torchvision ResNets at low "
            "resolution: see --low-res-stem")


def _default_help(mode: str):
    """``default(name)``: the default of field ``name`` in ``mode`` as ``--help`` writes it."""
    known = defaults(mode)

    def default(name: str) -> str:
        return f"default {shown(known[name])}"

    return default


def _with_device(name: str) -> str:
    """The help's default of a field that follows --device (:data:`DEVICE_DEFAULTS`)."""
    cuda, cpu = DEVICE_DEFAULTS[name]
    return f"default: {shown(cuda)} with --device cuda, {shown(cpu)} with --device cpu"


def _add_placement(p: argparse.ArgumentParser, mode: str) -> None:
    """Where this process sits in its job: ranks, job id, rendezvous, the shared folder."""
    default = _default_help(mode)
    d = p.add_argument_group("distributed (see docs/launching.md: where a process learns its rank)")
    d.add_argument("--num-tasks", type=int, help="world size; alone and > 1: spawn that many local ranks "
                   "(default: torchrun's or SLURM's, else one process)")
    d.add_argument("--global-rank", type=int, help="this process's global rank (with --num-tasks)")
    d.add_argument("--local-rank", type=int, help="this process's rank on its node (default: global rank)")
    d.add_argument("--job-id", help="job name = folder under --shared-folder-path (default: the SLURM job id, else "
                   "<mode>-<architecture>-<hash of the configuration>, so the same command resumes)")
    d.add_argument("--dist-url", help="file://PATH, tcp://HOST:PORT or env:// (default: a file in the job folder)")
    d.add_argument("--dist-backend", choices=["gloo", "nccl"], help=_with_device("dist_backend"))
    d.add_argument("--dist-timeout", type=float,
                   help=f"seconds to wait for peers and collectives ({default('dist_timeout')})")
    d.add_argument("--shared-folder-path", help=f"folder (shared by all nodes) for job folders "
                   f"({default('shared_folder_path')}, in the working directory)")


def _add_data_and_model(t, mode: str) -> None:
    """The data, the model and its weights, the resolutions and the input normalisation."""
    finetune = mode == "finetune"
    default = _default_help(mode)
    t.add_argument("--data-path", "--imnet-path", dest="data_path",
                   help="ImageFolder root with train/ and val/, or a folder packed into shards (python -m "
                        "fixres_dist.data.packing; docs/data_at_scale.md) (default: embedded Fashion-MNIST subset)")
    t.add_argument("--architecture", help=_architecture_help(default("architecture")))
    t.add_argument("--low-res-stem", action="store_true", default=None,
                   help="torchvision ResNets (resnet*, resnext*, wide_resnet*): 3x3 stride-1 first convolution and "
                        "no max-pool (total stride 8 instead of 32), for inputs of about 64 px and below")
    sources = "a checkpoint of fixres_dist, FixRes, torchvision's references, timm, DeiT or Lightning, or a plain " \
        "state_dict"
    t.add_argument("--weight-path", help=f"the weights to finetune (required): {sources}" if finetune else
                   f"weights to start from, or to evaluate with --eval-only (default: random initialisation): "
                   f"{sources}")
    t.add_argument("--weight-key", metavar="KEY",
                   help="the weight file's top-level entry holding the weights, e.g. model_ema or state_dict_ema "
                        "for EMA weights (default: the file itself if it is a state_dict, else model, state_dict, "
                        "model_state_dict, then the EMA entries)")
    if finetune:
        t.add_argument("--input-size", type=_finetune_size, help=f"the test resolution to finetune at, in pixels, "
                       f"or 'auto': the best of --test-sizes, measured before finetuning ({default('input_size')})")
    else:
        t.add_argument("--input-size", type=_training_size,
                       help=f"training resolution in pixels ({default('input_size')})")
    t.add_argument("--test-size", type=_pixels, help="evaluation resolution in pixels (default: --input-size)")
    t.add_argument("--test-sizes", type=_size_list, metavar="K1,K2,...",
                   help="resolution sweep: evaluate at each of these test resolutions (pixels) "
                        f"{'before finetuning and ' if finetune else ''}at the end, write resolution_sweep.png/.md, "
                        "name the best")
    t.add_argument("--train-size", type=_pixels,
                   help="resolution the weights were trained at (default: from the checkpoint's config)")
    t.add_argument("--mean", type=_channels, metavar="M or R,G,B",
                   help="input normalisation mean on the 0-1 scale (with --std; default: the weights' own: "
                        "timm's pretrained config, EfficientNet-Lite's 127/255, else ImageNet's)")
    t.add_argument("--std", type=_channels, metavar="S or R,G,B", help="input normalisation std on the 0-1 scale")
    t.add_argument("--crop-ratio", type=float,
                   help=f"test-time centre crop's share of the resized shorter side (default: timm's crop_pct, "
                        f"else {shown(CROP_RATIO)})")
    t.add_argument("--interpolation", choices=INTERPOLATIONS,
                   help=f"resize interpolation (default: timm's pretrained config, else {DEFAULT_INTERPOLATION})")


def _add_training_run(t, mode: str) -> None:
    """Batch, epochs, optimisation, BatchNorm statistics, workers, seed, device and progress bars."""
    finetune = mode == "finetune"
    default = _default_help(mode)
    t.add_argument("--batch", type=_positive_int,
                   help=f"images per process per step, >= 2 for training ({default('batch')})")
    t.add_argument("--epochs", type=_positive_int,
                   help=f"{'finetuning' if finetune else 'training'} epochs ({default('epochs')})")
    lr_note = "Goyal et al." if not finetune else \
        f"FixRes' finetune used {FIXRES_FINETUNE_LR_PER_256:g} per 256 (8e-3 for 8 x 64 = 512 images) on converged " \
        f"ImageNet weights; the demo default is higher"
    t.add_argument("--learning-rate", type=float, help="learning rate per 256 images, scaled linearly to the global "
                   f"batch ({default('learning_rate')}; {lr_note})")
    t.add_argument("--momentum", type=float,
                   help=f"momentum of --opt sgd, sgd-nesterov and rmsprop ({default('momentum')})")
    t.add_argument("--weight-decay", type=float, help=f"weight decay of weights ({default('weight_decay')})")
    t.add_argument("--norm-weight-decay", type=float,
                   help="weight decay of normalisation-layer parameters and of all biases instead of "
                        f"--weight-decay ({default('norm_weight_decay')}: not decayed)")
    t.add_argument("--label-smoothing", type=float, help="label smoothing of the cross-entropy training loss, "
                   f"in [0, 1) ({default('label_smoothing')}: none)")
    t.add_argument("--warmup-epochs", type=float, help="epochs of linear learning-rate warmup (from 0) before "
                   f"--lr-scheduler's decay ({default('warmup_epochs')})")
    t.add_argument("--dist-bn", choices=["reduce", "broadcast"],
                   help="BatchNorm statistics each epoch: reduce = average over the ranks, broadcast = take rank "
                        f"0's ({default('dist_bn')})")
    t.add_argument("--workers", type=int, help=f"data loader worker processes per rank ({default('workers')})")
    t.add_argument("--jpeg-decode", choices=JPEG_DECODES,
                   help="scaled: decode only each JPEG's crop, at the smallest DCT scale (1/2, 1/4, 1/8) still at "
                        "least the output size, the same crops as full; full: decode every JPEG whole "
                        f"(docs/data.md; {default('jpeg_decode')})")
    t.add_argument("--seed", type=int, help=f"random seed ({default('seed')})")
    t.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="rank 0's progress bars on stderr: epochs, evaluations, sweeps, the job's time left "
                        "(default: on when stderr is a terminal, off when it goes to a file or a pipe)")


def _add_evaluation(p: argparse.ArgumentParser, mode: str) -> None:
    """The finetune's own flags (or, in main_scratch.py, their refusal), evaluation and features."""
    finetune = mode == "finetune"
    default = _default_help(mode)
    f = p.add_argument_group("FixRes finetune, evaluation and feature extraction" if finetune else
                             "evaluation and feature extraction")
    if not finetune:
        _other_scripts_flags(f, FINETUNE_ONLY_FLAGS, "main_finetune.py")
    else:
        f.add_argument("--finetune-scope", choices=SCOPES, help=f"what trains ({default('finetune_scope')}: the "
                       "classifier and the last normalisation layer, FixRes section 4)")
        f.add_argument("--last-norm", metavar="NAME",
                       help="the normalisation module that head+last-norm trains (default: the last one on the "
                            "main path, found by data flow; e.g. layer4.1.bn2)")
        f.add_argument("--finetune-augmentation", choices=["test", "fixres"],
                       help="finetune preprocessing: test = the test transform, fixres = FixRes' lighter "
                            "augmentation (flip, mild colour jitter, small random shift of the centre crop) "
                            f"({default('finetune_augmentation')})")
    f.add_argument("--eval-only", action="store_true", default=None,
                   help="only evaluate --weight-path at --test-size / --test-sizes (no training)")
    f.add_argument("--extract-features", metavar="DIR",
                   help="write logits.npy, embeddings.npy, labels.npy (dataset order) at the test resolution")
    f.add_argument("--extract-split", choices=["val", "train"], help=f"split to extract ({default('extract_split')})")
    f.add_argument("--overwrite", action="store_true", default=None,
                   help="let --extract-features replace results already in DIR")
    f.add_argument("--export", action="store_true", default=None,
                   help="after the run ends successfully, write the export folder of its last checkpoint into "
                        "<job folder>/export/: safetensors weights, model.json (test resolution, preprocessing, class "
                        "names), ONNX and a torch.export program (docs/models.md, \"Exporting a model\")")


def _add_recipe_options(p: argparse.ArgumentParser, mode: str) -> None:
    """What a --recipe sets: optimizer, schedule, clipping, accumulation, augmentation, EMA."""
    finetune = mode == "finetune"
    default = _default_help(mode)
    r = p.add_argument_group("recipe options (torchvision's references/classification names; docs/recipes.md)")
    mine = [name for name, recipe in recipes.RECIPES.items() if recipe.mode == mode]
    r.add_argument("--recipe", type=functools.partial(_recipe, mode), metavar="{" + ",".join(mine) + "}",
                   help="a named preset of the options below and above, printed in full at the start and stored "
                   "in config.json; flags given explicitly override it (default: none)")
    r.add_argument("--opt", type=_optimizer, choices=OPTIMIZERS, help=f"optimizer ({default('opt')}; sgd-nesterov: "
                   "Nesterov momentum, also spelt sgd_nesterov; --momentum applies to sgd and rmsprop, adamw "
                   "refuses it)")
    r.add_argument("--lr-scheduler", type=_scheduler, choices=LR_SCHEDULERS,
                   help="after the warmup: cosine = half a cosine to 0 (per step), step = x --lr-gamma every "
                   "--lr-step-size epochs, exponential = x --lr-gamma every epoch; torchvision's "
                   f"cosineannealinglr, steplr, exponentiallr are accepted ({default('lr_scheduler')})")
    r.add_argument("--lr-step-size", type=_positive_int, help=f"epochs between decays of the step schedule "
                   f"({default('lr_step_size')})")
    r.add_argument("--lr-gamma", type=float, help=f"decay factor of the step and exponential schedules "
                   f"({default('lr_gamma')})")
    r.add_argument("--clip-grad-norm", type=float, metavar="NORM",
                   help="clip the gradients' global L2 norm to NORM before each step (default: no clipping)")
    r.add_argument("--grad-accum-steps", type=_positive_int, metavar="N",
                   help="accumulate N micro-batches of --batch images per rank into one optimizer step: the global "
                        "batch is batch x ranks x N, and the linear scaling rule counts it "
                        f"({default('grad_accum_steps')})")
    r.add_argument("--mixup-alpha", type=float, help="MixUp on each batch, lambda ~ Beta(alpha, alpha) "
                   f"({default('mixup_alpha')}: off; torchvision's recipe 0.2)"
                   + ("; with --finetune-scope all only (also --cutmix-alpha)" if finetune else ""))
    r.add_argument("--cutmix-alpha", type=float, help="CutMix on each batch (with --mixup-alpha: one of the two per "
                   f"batch, at random) ({default('cutmix_alpha')}: off; torchvision's recipe 1.0)")
    if finetune:
        _other_scripts_flags(r, SCRATCH_ONLY_FLAGS, "main_scratch.py (the finetune's preprocessing is "
                                                    "--finetune-augmentation's)")
    else:
        r.add_argument("--auto-augment", choices=(*AUTO_AUGMENT_POLICIES, NO_POLICY), help="augmentation policy after "
                       "the random crop: ra = RandAugment, ta_wide = TrivialAugmentWide, augmix = AugMix, imagenet = "
                       "AutoAugment's ImageNet policy (default: none)")
        r.add_argument("--random-erase", type=float, metavar="P", help="random erasing probability, the box filled "
                       f"with the mean colour ({default('random_erase')}: off)")
    r.add_argument("--model-ema", action=argparse.BooleanOptionalAction, default=None,
                   help="keep an exponential moving average of the weights (and BatchNorm statistics), evaluated at "
                        "every epoch and saved in the checkpoint as model_ema (--weight-key model_ema evaluates or "
                        "loads those weights) (default: off)")
    r.add_argument("--model-ema-decay", type=float, help="the average's decay per update "
                   f"({default('model_ema_decay')}; see docs/recipes.md for torchvision's rescaled value)")
    r.add_argument("--model-ema-steps", type=_positive_int, help=f"optimizer steps between EMA updates "
                   f"({default('model_ema_steps')})")
    r.add_argument("--ra-sampler", action=argparse.BooleanOptionalAction, default=None,
                   help="repeated augmentation: each image --ra-reps times per cycle of --ra-reps epochs, its copies "
                        "in the same step with different augmentations, on different ranks when --ra-reps <= ranks "
                        "(epochs keep their length) (default: off)")
    r.add_argument("--ra-reps", type=_positive_int, metavar="K",
                   help=f"copies per image with --ra-sampler ({default('ra_reps')}: no repeats; {RA_REPS_DEFAULT} when "
                        "--ra-sampler is given without it)")
    r.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="write TensorBoard event files into the job folder's tensorboard/ (needs the tensorboard "
                        "extra) (default: off)")


def _add_speed(p: argparse.ArgumentParser, mode: str) -> None:
    """Mixed precision, memory format, compilation, SyncBatchNorm."""
    finetune = mode == "finetune"
    g = p.add_argument_group("speed")
    g.add_argument("--amp", choices=["bf16", "fp16", "off"], help="mixed precision: bf16 autocast, fp16 with a "
                   f"GradScaler (CUDA only), or off ({_with_device('amp')})")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help=f"NHWC memory format for the model and its inputs ({_with_device('channels_last')})")
    g.add_argument("--compile", nargs="?", const=COMPILE_BACKEND, metavar="BACKEND",
                   help=f"torch.compile the training step with BACKEND ({COMPILE_BACKEND} if none is named; default: "
                        "not compiled); if compilation fails the run warns with the cause and continues uncompiled")
    g.add_argument("--sync-bn", action="store_true", default=None,
                   help="synchronise every BatchNorm over the ranks (SyncBatchNorm" +
                        ("; the trainable ones always are)" if finetune else ")"))
    g.add_argument("--profile", type=int, metavar="STEPS",
                   help="record a torch.profiler trace of STEPS training steps on every rank, into <job "
                        "folder>/profile/ (Chrome trace, TensorBoard's profiler, the top operators as text; "
                        "docs/profiling.md); default: no profiler")
    g.add_argument("--profile-after", type=int, metavar="STEPS",
                   help=f"steps of this process before the --profile window, a warm-up "
                        f"({_default_help(mode)('profile_after')})")
    g.add_argument("--step-times", action=argparse.BooleanOptionalAction, default=None,
                   help="per epoch and rank: the time of a step waiting for data, in forward and backward, in the "
                        "gradient all-reduce, in the optimizer; peak memory; stragglers and a loader-bound job "
                        "warned, docs/profiling.md (default: on)")


def _add_sharding(p: argparse.ArgumentParser, mode: str) -> None:
    """How the ranks hold the model (docs/sharding.md) and activation checkpointing."""
    default = _default_help(mode)
    g = p.add_argument_group("sharding and memory (docs/sharding.md)")
    g.add_argument("--sharding", choices=SHARDINGS, help="ddp: a full replica per rank (DistributedDataParallel); "
                   "full: parameters, gradients and optimizer state sharded over all ranks (FSDP2, per block); "
                   f"hybrid: sharded within --shard-group-size ranks, replicated across groups ({default('sharding')})")
    g.add_argument("--shard-group-size", type=_positive_int, metavar="N",
                   help="--sharding hybrid: ranks per shard group (default: the ranks on one node)")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="sharded: free each block's gathered parameters after its forward and gather them again "
                        "for the backward (less memory; --no-reshard-after-forward: one all-gather less per block) "
                        "(default: on)")
    g.add_argument("--cpu-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="sharded, --device cuda: keep parameters, gradients and the optimizer step in CPU memory "
                        "(default: off)")
    g.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="keep only each block's input for the backward and recompute its inside (less activation "
                        "memory, about one more forward per step) (default: off)")
    g.add_argument("--tensor-parallel", type=_positive_int, metavar="N",
                   help="split each block of a timm ViT/DeiT (its MLP by hidden units, its attention by heads) over "
                        "groups of N consecutive ranks that see the same images (N divides the number of ranks); "
                        f"the groups are data-parallel (docs/sharding.md) ({default('tensor_parallel')})")
    g.add_argument("--pipeline-stages", type=_positive_int, metavar="N",
                   help="cut a ResNet, a ConvNeXt or a timm ViT/DeiT into N stages (stem, blocks, head) on N "
                        "consecutive ranks that see the same images, balanced by FLOPs; the pipelines are "
                        f"data-parallel (docs/sharding.md) ({default('pipeline_stages')})")
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES,
                   help="how the stages run a step's micro-batches: gpipe (all forwards, then all backwards), 1f1b "
                        "(one forward, one backward: fewer activations kept), interleaved-1f1b (2 stages per rank: "
                        f"a smaller bubble) ({default('pipeline_schedule')})")
    g.add_argument("--pipeline-split", type=_piece_list, metavar="I0,I1,...",
                   help="the first piece of each stage, pieces counted from 0 (the stem, each block, the head), e.g. "
                        "0,5 for 2 stages: the stem and blocks 0-3, then the rest; interleaved-1f1b has 2 x N stages "
                        "(default: balanced by forward FLOPs; the log names each rank's pieces)")
    g.add_argument("--pipeline-microbatches", type=_positive_int, metavar="M",
                   help="micro-batches per step and rank's batch (--batch a multiple of M; at least one per stage "
                        "with 1f1b) (default: one per stage)")
    g.add_argument("--memory-budget", type=float, metavar="GIB",
                   help="refuse to start a training run whose estimated peak memory per rank exceeds GIB, naming "
                        "the cheapest change that fits (default: the GPU's memory on CUDA; no limit on CPU); the "
                        "table for several choices: python -m fixres_dist.training.memory_table")


def _add_checkpoints(p: argparse.ArgumentParser, mode: str) -> None:
    """Checkpoints, the best one and early stopping, resuming and preemption."""
    default = _default_help(mode)
    c = p.add_argument_group("checkpoints and preemption")
    c.add_argument("--ckpt-every", type=int, help="also checkpoint every N optimizer steps (default: epoch ends only)")
    c.add_argument("--keep-checkpoints", type=int,
                   help=f"numbered checkpoints to keep ({default('keep_checkpoints')})")
    _add_best(c, mode)
    c.add_argument("--resume", help="checkpoint a new job starts from; once the job folder has its own "
                   "checkpoint.pth, that one is used (default: the job folder's checkpoint.pth, if any)")
    c.add_argument("--preempt-signal", help="signal that means 'checkpoint and stop' besides SIGTERM "
                   f"({default('preempt_signal')})")
    c.add_argument("--skip-bad-images", action="store_true", default=None,
                   help="skip and count unreadable images instead of stopping")
    c.add_argument("--world-change", choices=WORLD_CHANGES,
                   help="what a run resumed on another number of ranks (a node lost or back) keeps: the global batch, "
                        "by accumulating micro-batches, or each rank's --batch, with the learning rate re-derived by "
                        f"the linear scaling rule ({default('world_change')})")
    c.add_argument("--stall-timeout", type=_stall_timeout, metavar="SECONDS",
                   help="a rank that makes no progress (no training step, evaluation batch or checkpoint) this long "
                        "ends the job, named, with every rank's stacks in <job folder>/stalls/ and exit status 5; "
                        "0 or off: never (default: auto, 10 x the longest gap between two steps so far, at least "
                        "120 s; before the first step, 20 min or this if longer; docs/checkpoints.md)")
    c.add_argument("--min-world-size", type=int, metavar="N",
                   help="the fewest ranks the job trains on: on fewer it stops before training with exit status 3, "
                        "keeping its checkpoint (default: any)")


def _add_best(c, mode: str) -> None:
    """``--best-metric`` and, in main_scratch.py, early stopping (docs/checkpoints.md, "The best checkpoint")."""
    c.add_argument("--best-metric", metavar="{" + ",".join(BEST_METRICS) + "}",
                   help="keep the checkpoint of the epoch whose evaluation at the test resolution is best by this "
                        "metric as best.pth, beside the last --keep-checkpoints (top1, top5: higher is better; loss: "
                        "lower; ema_*: of the --model-ema average's evaluation) (default: none)")
    if mode == "finetune":
        _other_scripts_flags(c, EARLY_STOPPING_FLAGS, "main_scratch.py (a FixRes finetune runs its few epochs; "
                                                      "--best-metric keeps its best)")
        return
    c.add_argument("--early-stopping-patience", type=int, metavar="N",
                   help="end training normally after N evaluations in a row without an improvement of --best-metric "
                        "(default: off)")
    c.add_argument("--early-stopping-min-delta", type=float, metavar="DELTA",
                   help="an improvement that resets the patience beats the best by more than DELTA (percentage "
                        "points for top1/top5, nats for loss) (default 0: any)")


def _tracker_list(text: str) -> tuple[str, ...]:
    """``--tracker``: one tracker or a comma list of them."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in names:
        if name not in TRACKERS:
            raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(TRACKERS)})")
    return names


class _ExtendTrackers(argparse.Action):
    """``--tracker`` given several times: the trackers of every one, each once."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(dict.fromkeys((*(getattr(namespace, self.dest) or ()), *values))))


def _add_trackers(p: argparse.ArgumentParser, mode: str) -> None:
    """MLflow and Weights & Biases, fed rank 0's record (docs/checkpoints.md, "Experiment trackers")."""
    g = p.add_argument_group("experiment trackers (docs/checkpoints.md#experiment-trackers)")
    g.add_argument("--tracker", dest="trackers", type=_tracker_list, action=_ExtendTrackers,
                   metavar="{" + ",".join(TRACKERS) + "}",
                   help="send the run's parameters, metrics (step: images trained on) and, at the end, its sweep plot "
                        "and export/ to this experiment tracker, on rank 0; repeat it or give a comma list; the "
                        "tracker's run id is saved in the checkpoint, so a resumed or requeued job continues its run; "
                        "a tracker that fails is a warning, never a lost job (needs the trackers extra) "
                        f"({_default_help(mode)('trackers')})")
    g.add_argument("--mlflow-tracking-uri", metavar="URI",
                   help="MLflow's tracking URI: a sqlite:/// database, an http(s):// server, ... (default: "
                        "sqlite:///<job folder>/mlflow.db, artifacts in <job folder>/mlartifacts/)")
    g.add_argument("--mlflow-experiment", metavar="NAME",
                   help="MLflow experiment of the run, created if absent (default fixres_dist)")
    g.add_argument("--wandb-project", metavar="NAME", help="W&B project of the run (default fixres_dist)")
    g.add_argument("--wandb-mode", choices=WANDB_MODES,
                   help="W&B offline (no network; upload later with wandb sync) or online "
                        f"({_default_help(mode)('wandb_mode')})")
    g.add_argument("--wandb-dir", metavar="FOLDER",
                   help="where W&B writes its wandb/ folder (default: the job folder)")


def _stall_timeout(text: str) -> float | None:
    """``--stall-timeout``: seconds, ``off`` (0) or ``auto`` (None, the default)."""
    if text.strip().lower() in ("auto", "off"):
        return None if text.strip().lower() == "auto" else 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, auto or off, got {text!r}") from None


def build_parser(mode: str) -> argparse.ArgumentParser:
    """The parser of ``main_<mode>.py`` (``mode``: ``scratch`` or ``finetune``): that script's flags
    only, each default in its help (:func:`defaults`, :data:`DEVICE_DEFAULTS`).

    Values not given are ``None`` (no argparse defaults): rank resolution and :func:`config_fields`
    fill them in, and a resumed job tells a flag given from one left out. Raises ValueError for
    another ``mode``.
    """
    if mode not in MODE_DEFAULTS:
        raise ValueError(f"mode must be one of {', '.join(MODE_DEFAULTS)}, got {mode!r}")
    finetune = mode == "finetune"
    what = "FixRes-finetune a classifier at the test resolution (Touvron et al., NeurIPS 2019)" if finetune \
        else "train a classifier from scratch"
    p = _Parser(allow_abbrev=False, description=f"fixres_dist: {what} with DistributedDataParallel.",
                formatter_class=_Formatter)
    p.check = functools.partial(_training_fields, mode=mode)
    p.complete = functools.partial(_with_config_file, parser=p, mode=mode)
    p.add_argument("--config", dest="config_file", metavar="FILE",
                   help="read the settings from FILE, YAML (.yaml, .yml) or JSON (.json): a mapping of options, "
                        "named as fields (input_size) or flags (input-size, --input-size), to values as config.json "
                        "holds them (lists for list options, true or false for switches), e.g. a run's config.json; "
                        "the flags given here override it; the placement flags (--num-tasks, --global-rank, "
                        "--local-rank, --job-id, --dist-url) are never read from it (docs/recipes.md)")
    _add_placement(p, mode)
    training = p.add_argument_group("finetuning" if finetune else "training")
    _add_data_and_model(training, mode)
    _add_training_run(training, mode)
    _add_evaluation(p, mode)
    _add_recipe_options(p, mode)
    _add_speed(p, mode)
    _add_sharding(p, mode)
    _add_checkpoints(p, mode)
    _add_trackers(p, mode)
    return p


def _with_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, mode: str) -> None:
    """``--config FILE``'s settings (:func:`fixres_dist.entry.config_file.read_settings`) under the flags
    given: each option the command line left out takes the file's value, as if given (it overrides a
    recipe's), and ``args.config_note`` holds the log's line. Raises FixresError for a bad file."""
    if args.config_file is None:
        return
    settings = config_file.read_settings(args.config_file, parser, mode, RANK_FLAGS)
    values = _file_values(settings.values, args, mode)
    taken = {name: value for name, value in values.items() if getattr(args, name) is None
             and not (name == "ra_reps" and args.ra_sampler is False)}  # --no-ra-sampler: no copies, whatever the file
    for name, value in taken.items():
        setattr(args, name, value)
    overridden = [f"--{name.replace('_', '-')}" for name in values if name not in taken]
    setattr(args, config_file.NOTE, settings.note(overridden, args.num_tasks))


def _file_values(values: dict, args: argparse.Namespace, mode: str) -> dict:
    """The file's values that set something: those equal to the option's value without them (the mode's
    default, or the recipe's) are left out, as a run's config.json lists every field and its defaults
    would count as given (``--lr-step-size`` with cosine); the device's and those that follow it are kept.
    config.json's ``ra_reps`` K is ``--ra-sampler --ra-reps K`` (``--no-ra-sampler`` for 1)."""
    values = dict(values)
    if "ra_reps" in values and "ra_sampler" not in values:
        values["ra_sampler"] = values["ra_reps"] > 1
    recipe = args.recipe or values.get("recipe")
    base = {**defaults(mode), **(recipes.recipe_fields(recipe, mode) if recipe else {})}
    if args.eval_only or values.get("eval_only"):  # an evaluation keeps no average (_training_fields)
        base["model_ema"] = defaults(mode)["model_ema"]
    reps = 1 if values.get("ra_sampler") is False else values.get("ra_reps")
    if reps == base["ra_reps"]:
        values.pop("ra_sampler", None)
        values.pop("ra_reps", None)
    return {name: value for name, value in values.items() if name in ("device", *DEVICE_DEFAULTS) or name not in base
            or (None if name == "auto_augment" and value == NO_POLICY else value) != base[name]}


def config_fields(args: argparse.Namespace, mode: str) -> dict:
    """Training options given on the command line plus the mode's defaults (no rank fields).

    Without ``--device``: cuda when torch sees a GPU (torch is imported here, not before), else cpu;
    the fields of :data:`DEVICE_DEFAULTS` then follow the device.
    """
    fields = _training_fields(args, mode)
    if "device" not in fields:
        import torch

        fields["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    for name, (cuda, cpu) in DEVICE_DEFAULTS.items():
        fields.setdefault(name, cuda if fields["device"] == "cuda" else cpu)
    return fields


def _training_fields(args: argparse.Namespace, mode: str) -> dict:
    """The mode's defaults, then ``--recipe``'s fields, then the flags given (no rank fields, no
    device-dependent ones). Raises FixresError for flags given that the rest would silently ignore."""
    given = {k: v for k, v in vars(args).items() if v is not None and k not in (*RANK_FLAGS, config_file.NOTE)}
    fields = {"mode": mode, **MODE_DEFAULTS[mode]}
    if given.get("recipe"):
        fields.update(recipes.recipe_fields(given["recipe"], mode))
        if given.get("eval_only"):  # an evaluation keeps no average: the recipe's training options do not apply
            fields.pop("model_ema", None)
    ra_sampler = given.pop("ra_sampler", None)
    if ra_sampler:  # the recipe's copies, else torchvision's default
        given.setdefault("ra_reps", fields.get("ra_reps", 1) if fields.get("ra_reps", 1) > 1 else RA_REPS_DEFAULT)
    elif ra_sampler is False:  # --no-ra-sampler
        if given.get("ra_reps", 1) > 1:
            raise FixresError("--ra-reps needs --ra-sampler, not --no-ra-sampler")
        given["ra_reps"] = 1
    elif "ra_reps" in given and fields.get("ra_reps", 1) == 1:
        raise FixresError("--ra-reps needs --ra-sampler (repeated augmentation is off without it)")
    fields.update(given)
    if fields.get("auto_augment") == NO_POLICY:
        fields["auto_augment"] = None
    _check_given_together(given, {**defaults(mode), **fields})
    return fields


def _check_given_together(given: dict, fields: dict) -> None:
    """Flags given that the rest of the configuration would silently ignore: FixresError (one line)."""
    if fields.get("eval_only"):
        ignored = [flag for flag in TRAINING_ONLY if flag in given]
        if ignored:
            raise FixresError(f"--{ignored[0].replace('_', '-').replace('ra-reps', 'ra-sampler')} does not apply to "
                              "--eval-only (it trains nothing)")
    if "lr_step_size" in given and fields["lr_scheduler"] != "step":
        raise FixresError(f"--lr-step-size only applies to --lr-scheduler step, not {fields['lr_scheduler']} "
                          "(exponential decays every epoch)")
    if "lr_gamma" in given and fields["lr_scheduler"] == "cosine":
        raise FixresError("--lr-gamma only applies to --lr-scheduler step or exponential, not cosine")
    if not fields["model_ema"]:
        ignored = [flag for flag in ("model_ema_decay", "model_ema_steps") if flag in given]
        if ignored:
            raise FixresError(f"--{ignored[0].replace('_', '-')} needs --model-ema")
    if fields["opt"] == "adamw" and "momentum" in given:
        raise FixresError("--momentum does not apply to --opt adamw (its moments are Adam's betas)")

