"""The command-line parser shared by ``main_scratch.py`` and ``main_finetune.py`` (FixRes flag names)."""
from __future__ import annotations

import argparse

import torch

from .data import INTERPOLATIONS
from .fixres import SCOPES

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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _input_size(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _size_list(text: str) -> tuple[int, ...]:
    """``"48,64,80"`` -> ``(48, 64, 80)``; every entry a positive integer."""
    sizes = []
    for entry in text.split(","):
        try:
            sizes.append(_positive_int(entry.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{entry.strip()!r} in {text!r} is not an integer number of pixels") from None
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{entry.strip()!r} in {text!r} is not a positive number of pixels") from None
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


def build_parser(mode: str) -> argparse.ArgumentParser:
    """The parser; values not given are ``None`` (resolved later by rank resolution and defaults)."""
    what = "train a classifier from scratch" if mode == "scratch" else \
        "FixRes-finetune a classifier at the test resolution (Touvron et al., NeurIPS 2019)"
    p = argparse.ArgumentParser(description=f"fixres_dist: {what} with DistributedDataParallel.")
    d = p.add_argument_group("distributed (see README: where a process learns its rank)")
    d.add_argument("--num-tasks", type=int, help="world size; alone and > 1: spawn that many local ranks")
    d.add_argument("--global-rank", type=int, help="this process's global rank (with --num-tasks)")
    d.add_argument("--local-rank", type=int, help="this process's rank on its node (default: global rank)")
    d.add_argument("--job-id", help="job name = folder under --shared-folder-path (default: the SLURM job id, else "
                   "<mode>-<architecture>-<hash of the configuration>, so the same command resumes)")
    d.add_argument("--dist-url", help="file://PATH, tcp://HOST:PORT or env:// (default: a file in the job folder)")
    d.add_argument("--dist-backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, gloo on CPU")
    d.add_argument("--dist-timeout", type=float, help="seconds to wait for peers and collectives (default 300)")
    d.add_argument("--shared-folder-path", help="folder (shared by all nodes) for job folders (default ./runs)")
    t = p.add_argument_group("training")
    t.add_argument("--data-path", "--imnet-path", dest="data_path",
                   help="ImageFolder root with train/ and val/ (default: embedded Fashion-MNIST subset)")
    t.add_argument("--architecture", help="torchvision model name, efficientnet_lite0..4, resnet20..resnet110 or "
                   "timm/<name> (default resnet18)")
    t.add_argument("--low-res-stem", action="store_true", default=None,
                   help="torchvision ResNets: 3x3 stride-1 first convolution and no max-pool (total stride 8 "
                        "instead of 32), for inputs of about 64 px and below; or use resnet20 ... resnet110")
    t.add_argument("--weight-path", help="weights to start from: a checkpoint of fixres_dist, FixRes, torchvision's "
                   "references, timm, DeiT or Lightning, or a plain state_dict")
    t.add_argument("--weight-key", metavar="KEY",
                   help="the weight file's top-level entry holding the weights, e.g. model_ema or state_dict_ema "
                        "for EMA weights (default: the file itself if it is a state_dict, else model, state_dict, "
                        "model_state_dict, then the EMA entries)")
    t.add_argument("--input-size", type=_input_size, help=f"training resolution in pixels "
                   f"(default {MODE_DEFAULTS[mode]['input_size']}; finetune: the test resolution, or 'auto': "
                   "the best of --test-sizes before finetuning)")
    t.add_argument("--test-size", type=_positive_int, help="evaluation resolution in pixels (default: input size)")
    t.add_argument("--test-sizes", type=_size_list, metavar="K1,K2,...",
                   help="resolution sweep: evaluate at each of these test resolutions (pixels) at the end "
                        "(finetune: also before), write resolution_sweep.png/.md, name the best")
    t.add_argument("--train-size", type=_positive_int,
                   help="resolution the weights were trained at (default: from the checkpoint's config)")
    t.add_argument("--mean", type=_channels, metavar="M or R,G,B",
                   help="input normalisation mean on the 0-1 scale (with --std; default: the weights' own: "
                        "timm's pretrained config, EfficientNet-Lite's 127/255, else ImageNet's)")
    t.add_argument("--std", type=_channels, metavar="S or R,G,B", help="input normalisation std on the 0-1 scale")
    t.add_argument("--crop-ratio", type=float,
                   help="test-time centre crop's share of the resized shorter side (default: timm's crop_pct, "
                        "else 0.875)")
    t.add_argument("--interpolation", choices=list(INTERPOLATIONS),
                   help="resize interpolation (default: timm's pretrained config, else bilinear)")
    t.add_argument("--batch", type=_positive_int, help="images per process per step, >= 2 for training (default 64)")
    t.add_argument("--epochs", type=_positive_int)
    lr_note = "Goyal et al." if mode == "scratch" else \
        f"FixRes' finetune used {FIXRES_FINETUNE_LR_PER_256:g} per 256 (8e-3 for 8 x 64 = 512 images) on converged " \
        f"ImageNet weights; the demo default is higher"
    t.add_argument("--learning-rate", type=float, help=f"SGD LR per 256 images, scaled linearly to the global batch "
                   f"(default {MODE_DEFAULTS[mode]['learning_rate']:g}; {lr_note})")
    t.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    t.add_argument("--weight-decay", type=float, help="weight decay of weights (default 5e-5)")
    t.add_argument("--norm-weight-decay", type=float,
                   help="weight decay of normalisation-layer parameters and of all biases instead of "
                        "--weight-decay (default 0: not decayed)")
    t.add_argument("--label-smoothing", type=float,
                   help="label smoothing of the cross-entropy training loss, in [0, 1) (default 0: none)")
    t.add_argument("--warmup-epochs", type=float)
    t.add_argument("--dist-bn", choices=["reduce", "broadcast"],
                   help="BatchNorm statistics: average over ranks each epoch (default) or take rank 0's")
    t.add_argument("--workers", type=int, help="data loader worker processes per rank (default 2)")
    t.add_argument("--seed", type=int)
    t.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    f = p.add_argument_group("FixRes finetune, evaluation and feature extraction")
    f.add_argument("--finetune-scope", choices=SCOPES,
                   help="what main_finetune.py trains (default head+last-norm, FixRes section 4)")
    f.add_argument("--last-norm", metavar="NAME",
                   help="the normalisation module that head+last-norm trains (default: the last one on the "
                        "main path, found by data flow; e.g. layer4.1.bn2)")
    f.add_argument("--finetune-augmentation", choices=["test", "fixres"],
                   help="finetune preprocessing: the test transform (default) or FixRes' lighter augmentation "
                        "(flip, mild colour jitter, small random shift of the centre crop)")
    f.add_argument("--eval-only", action="store_true", default=None,
                   help="only evaluate --weight-path at --test-size / --test-sizes (no training)")
    f.add_argument("--extract-features", metavar="DIR",
                   help="write logits.npy, embeddings.npy, labels.npy (dataset order) at the test resolution")
    f.add_argument("--extract-split", choices=["val", "train"], help="split to extract (default val)")
    f.add_argument("--overwrite", action="store_true", default=None,
                   help="let --extract-features replace results already in DIR")
    g = p.add_argument_group("speed (defaults: on for CUDA, off on CPU)")
    g.add_argument("--amp", choices=["bf16", "fp16", "off"],
                   help="mixed precision: bf16 autocast (default on CUDA), fp16 with a GradScaler (CUDA only), off")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory format for the model and its inputs (default on CUDA)")
    g.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile the training step (backend default inductor); if compilation fails the "
                        "run warns with the cause and continues uncompiled")
    g.add_argument("--sync-bn", action="store_true", default=None,
                   help="synchronise every BatchNorm over the ranks (SyncBatchNorm; main_finetune.py always "
                        "synchronises the trainable ones)")
    c = p.add_argument_group("checkpoints and preemption")
    c.add_argument("--ckpt-every", type=int, help="also checkpoint every N optimizer steps (default: epoch ends only)")
    c.add_argument("--keep-checkpoints", type=int, help="numbered checkpoints to keep (default 2)")
    c.add_argument("--resume", help="checkpoint a new job starts from; once the job folder has its own "
                   "checkpoint.pth, that one is used (default: the job folder's checkpoint.pth, if any)")
    c.add_argument("--preempt-signal", help="signal that means 'checkpoint and stop' besides SIGTERM (default SIGUSR2)")
    c.add_argument("--skip-bad-images", action="store_true", default=None,
                   help="skip and count unreadable images instead of stopping")
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar")
    return p


def config_fields(args: argparse.Namespace, mode: str) -> dict:
    """Training options given on the command line plus the mode's defaults (no rank fields)."""
    rank_flags = {"num_tasks", "global_rank", "local_rank", "job_id", "dist_url"}
    fields = {"mode": mode, **MODE_DEFAULTS[mode]}
    fields.update({k: v for k, v in vars(args).items() if v is not None and k not in rank_flags})
    fields.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    fields.setdefault("dist_backend", "nccl" if fields["device"] == "cuda" else "gloo")
    fields.setdefault("amp", "bf16" if fields["device"] == "cuda" else "off")
    fields.setdefault("channels_last", fields["device"] == "cuda")
    return fields
