"""The command lines of ``main_scratch.py`` and ``main_finetune.py`` (FixRes flag names) and their start.

Each script's parser (:func:`build_parser`) lists only its own flags, with every default in its
help, taken from :data:`MODE_DEFAULTS` and :class:`~fixres_dist.config.TrainerConfig`. This module
imports nothing heavy (no torch, torchvision or numpy): ``--help`` and usage errors (exit status 2)
answer in a fraction of a second; :func:`run_script` imports the launcher, and torch, only once the
command line has parsed.
"""
from __future__ import annotations

import argparse
import textwrap

import attrs

from . import startup
from .config import (CIFAR_RESNETS, CROP_RATIO, DEFAULT_INTERPOLATION, INTERPOLATIONS, LITE_MODELS, OPTIONAL_PACKAGES,
                     SCOPES, TIMM_PREFIX, TrainerConfig)

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
# Flags that place this process in its job: resolved by fixres_dist.placement, not configuration fields.
RANK_FLAGS = ("num_tasks", "global_rank", "local_rank", "job_id", "dist_url")
COMPILE_BACKEND = "inductor"  # what --compile alone uses
# main_finetune.py's own flags; main_scratch.py refuses them, naming the script they belong to.
FINETUNE_ONLY_FLAGS = ("--finetune-scope", "--last-norm", "--finetune-augmentation")


def defaults(mode: str) -> dict:
    """Every configuration field's value in ``mode`` when its flag is not given: :data:`MODE_DEFAULTS`
    over :class:`~fixres_dist.config.TrainerConfig`'s defaults (the device-dependent ones, and
    ``device`` itself, are decided by :func:`config_fields`)."""
    return {**{f.name: f.default for f in attrs.fields(TrainerConfig)}, **MODE_DEFAULTS[mode]}


def shown(value) -> str:
    """A default as ``--help`` writes it: ``on``/``off`` for booleans, ``5e-05`` for floats, else as is."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _whole(text: str, unit: str = "") -> int:
    """A positive whole number (of ``unit``, for the message); ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{unit}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number{unit}, got {text}")
    return value


def _positive_int(text: str) -> int:
    """A count: a positive whole number."""
    return _whole(text)


def _pixels(text: str) -> int:
    """A resolution: a positive whole number of pixels."""
    return _whole(text, " of pixels")


def _finetune_size(text: str) -> int | str:
    """main_finetune.py's --input-size: pixels, or ``auto`` (the best of --test-sizes)."""
    return "auto" if text == "auto" else _pixels(text)


def _training_size(text: str) -> int:
    """main_scratch.py's --input-size: pixels (``auto`` is main_finetune.py's)."""
    if text == "auto":
        raise argparse.ArgumentTypeError("'auto' only applies to main_finetune.py, which finetunes at the best "
                                         "of --test-sizes")
    return _pixels(text)


def _size_list(text: str) -> tuple[int, ...]:
    """``"48,64,80"`` -> ``(48, 64, 80)``; every entry a positive integer."""
    sizes = []
    for entry in (e.strip() for e in text.split(",")):
        try:
            size = int(entry)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{entry!r} in {text!r} is not an integer number of pixels") from None
        if size <= 0:
            raise argparse.ArgumentTypeError(f"{entry!r} in {text!r} is not a positive number of pixels")
        sizes.append(size)
    return tuple(sizes)


def _channels(text: str) -> tuple[float, ...]:
    """``"0.5"`` -> ``(0.5, 0.5, 0.5)``; ``"0.485,0.456,0.406"`` -> three floats (R, G, B)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 1 or 3 comma-separated numbers") from None
    if len(values) not in (1, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 number (all channels) or 3 (R,G,B)")
    return values * 3 if len(values) == 1 else values


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in one line, ``<prog>: error: <message>`` (exit status 2), instead of
    the whole usage message before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.HelpFormatter):
    """argparse's help layout, wrapping only between words: ``--input-size`` is never split at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _OtherScript(argparse.Action):
    """A flag of main_finetune.py given to main_scratch.py: a usage error naming the script it belongs to."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} only applies to main_finetune.py")


def _architecture_help(default: str) -> str:
    """--architecture's help: the accepted name families (:mod:`fixres_dist.models`), without torchvision."""
    lite_extra, timm_extra = OPTIONAL_PACKAGES["efficientnet_lite_pytorch"][1], OPTIONAL_PACKAGES["timm"][1]
    lite = list(LITE_MODELS)
    return (f"model name ({default}): any torchvision classification model, e.g. resnet50, convnext_tiny, "
            f"vit_b_16; {lite[0]} ... {lite[-1]} (needs the {lite_extra} extra); the CIFAR ResNets "
            f"{', '.join(CIFAR_RESNETS)} (He et al. 2016, total stride 4: for inputs of about 64 px and below); "
            f"or {TIMM_PREFIX}<name>, any timm model (needs the {timm_extra} extra). torchvision ResNets at low "
            "resolution: see --low-res-stem")


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
    known = defaults(mode)

    def default(name: str) -> str:
        return f"default {shown(known[name])}"

    def with_device(name: str) -> str:
        cuda, cpu = DEVICE_DEFAULTS[name]
        return f"default: {shown(cuda)} with --device cuda, {shown(cpu)} with --device cpu"

    what = "FixRes-finetune a classifier at the test resolution (Touvron et al., NeurIPS 2019)" if finetune \
        else "train a classifier from scratch"
    p = _Parser(allow_abbrev=False, description=f"fixres_dist: {what} with DistributedDataParallel.", formatter_class=_Formatter)
    d = p.add_argument_group("distributed (see README: where a process learns its rank)")
    d.add_argument("--num-tasks", type=int, help="world size; alone and > 1: spawn that many local ranks "
                   "(default: torchrun's or SLURM's, else one process)")
    d.add_argument("--global-rank", type=int, help="this process's global rank (with --num-tasks)")
    d.add_argument("--local-rank", type=int, help="this process's rank on its node (default: global rank)")
    d.add_argument("--job-id", help="job name = folder under --shared-folder-path (default: the SLURM job id, else "
                   "<mode>-<architecture>-<hash of the configuration>, so the same command resumes)")
    d.add_argument("--dist-url", help="file://PATH, tcp://HOST:PORT or env:// (default: a file in the job folder)")
    d.add_argument("--dist-backend", choices=["gloo", "nccl"], help=with_device("dist_backend"))
    d.add_argument("--dist-timeout", type=float,
                   help=f"seconds to wait for peers and collectives ({default('dist_timeout')})")
    d.add_argument("--shared-folder-path", help=f"folder (shared by all nodes) for job folders "
                   f"({default('shared_folder_path')}, in the working directory)")
    t = p.add_argument_group("finetuning" if finetune else "training")
    t.add_argument("--data-path", "--imnet-path", dest="data_path",
                   help="ImageFolder root with train/ and val/ (default: embedded Fashion-MNIST subset)")
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
    t.add_argument("--batch", type=_positive_int,
                   help=f"images per process per step, >= 2 for training ({default('batch')})")
    t.add_argument("--epochs", type=_positive_int,
                   help=f"{'finetuning' if finetune else 'training'} epochs ({default('epochs')})")
    lr_note = "Goyal et al." if not finetune else \
        f"FixRes' finetune used {FIXRES_FINETUNE_LR_PER_256:g} per 256 (8e-3 for 8 x 64 = 512 images) on converged " \
        f"ImageNet weights; the demo default is higher"
    t.add_argument("--learning-rate", type=float, help=f"SGD LR per 256 images, scaled linearly to the global batch "
                   f"({default('learning_rate')}; {lr_note})")
    t.add_argument("--momentum", type=float, help=f"SGD momentum ({default('momentum')})")
    t.add_argument("--weight-decay", type=float, help=f"weight decay of weights ({default('weight_decay')})")
    t.add_argument("--norm-weight-decay", type=float,
                   help="weight decay of normalisation-layer parameters and of all biases instead of "
                        f"--weight-decay ({default('norm_weight_decay')}: not decayed)")
    t.add_argument("--label-smoothing", type=float, help="label smoothing of the cross-entropy training loss, "
                   f"in [0, 1) ({default('label_smoothing')}: none)")
    t.add_argument("--warmup-epochs", type=float, help="epochs of linear learning-rate warmup before the cosine "
                   f"decay ({default('warmup_epochs')})")
    t.add_argument("--dist-bn", choices=["reduce", "broadcast"],
                   help="BatchNorm statistics each epoch: reduce = average over the ranks, broadcast = take rank "
                        f"0's ({default('dist_bn')})")
    t.add_argument("--workers", type=int, help=f"data loader worker processes per rank ({default('workers')})")
    t.add_argument("--seed", type=int, help=f"random seed ({default('seed')})")
    t.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="rank 0's progress bars on stderr: epochs, evaluations, sweeps, the job's time left "
                        "(default: on when stderr is a terminal, off when it goes to a file or a pipe)")
    f = p.add_argument_group("FixRes finetune, evaluation and feature extraction" if finetune else
                             "evaluation and feature extraction")
    if not finetune:
        for flag in FINETUNE_ONLY_FLAGS:
            f.add_argument(flag, action=_OtherScript, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
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
    g = p.add_argument_group("speed")
    g.add_argument("--amp", choices=["bf16", "fp16", "off"], help="mixed precision: bf16 autocast, fp16 with a "
                   f"GradScaler (CUDA only), or off ({with_device('amp')})")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help=f"NHWC memory format for the model and its inputs ({with_device('channels_last')})")
    g.add_argument("--compile", nargs="?", const=COMPILE_BACKEND, metavar="BACKEND",
                   help=f"torch.compile the training step with BACKEND ({COMPILE_BACKEND} if none is named; default: "
                        "not compiled); if compilation fails the run warns with the cause and continues uncompiled")
    g.add_argument("--sync-bn", action="store_true", default=None,
                   help="synchronise every BatchNorm over the ranks (SyncBatchNorm" +
                        ("; the trainable ones always are)" if finetune else ")"))
    c = p.add_argument_group("checkpoints and preemption")
    c.add_argument("--ckpt-every", type=int, help="also checkpoint every N optimizer steps (default: epoch ends only)")
    c.add_argument("--keep-checkpoints", type=int,
                   help=f"numbered checkpoints to keep ({default('keep_checkpoints')})")
    c.add_argument("--resume", help="checkpoint a new job starts from; once the job folder has its own "
                   "checkpoint.pth, that one is used (default: the job folder's checkpoint.pth, if any)")
    c.add_argument("--preempt-signal", help="signal that means 'checkpoint and stop' besides SIGTERM "
                   f"({default('preempt_signal')})")
    c.add_argument("--skip-bad-images", action="store_true", default=None,
                   help="skip and count unreadable images instead of stopping")
    return p


def config_fields(args: argparse.Namespace, mode: str) -> dict:
    """Training options given on the command line plus the mode's defaults (no rank fields).

    Without ``--device``: cuda when torch sees a GPU (torch is imported here, not before), else cpu;
    the fields of :data:`DEVICE_DEFAULTS` then follow the device.
    """
    fields = {"mode": mode, **MODE_DEFAULTS[mode]}
    fields.update({k: v for k, v in vars(args).items() if v is not None and k not in RANK_FLAGS})
    if "device" not in fields:
        import torch

        fields["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    for name, (cuda, cpu) in DEVICE_DEFAULTS.items():
        fields.setdefault(name, cuda if fields["device"] == "cuda" else cpu)
    return fields


def run_script(mode: str, argv: list[str] | None = None) -> None:
    """What ``main_<mode>.py`` and the console entry points run: parse ``argv`` (default: the
    command line) before anything heavy is imported, then import the launcher (and torch) and run
    (:func:`fixres_dist.launch.main`). Stop signals before the launcher listens end it with one line,
    and those that arrive once the job is over are ignored (:mod:`fixres_dist.startup`)."""
    startup.guard_signals()  # before torch loads: Ctrl-C or SIGTERM while starting is one line, not a traceback
    startup.quiet_native_logs()
    try:
        args = build_parser(mode).parse_args(argv)
        from .launch import main

        main(mode, args)
    finally:
        startup.ignore_signals()


def main_scratch() -> None:
    """Console entry point ``fixres-scratch`` (same as ``python main_scratch.py``)."""
    run_script("scratch")


def main_finetune() -> None:
    """Console entry point ``fixres-finetune`` (same as ``python main_finetune.py``)."""
    run_script("finetune")
