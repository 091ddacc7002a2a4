"""``TrainerConfig``: every option of a run, validated, and its JSON round trip (``config.json``).

This module imports nothing heavy (no torch, torchvision or numpy): the command line
(:mod:`fixres_dist.entry.cli`) reads its defaults and the names below to answer ``--help`` at once.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import signal
from pathlib import Path
from urllib.parse import urlparse

import attrs

from fixres_dist.errors import FixresError

CONFIG_FILE = "config.json"
RENDEZVOUS_FILE = "rendezvous.json"
# The folder of --shared-folder-path that holds the data's file indexes (fixres_dist.data.file_index),
# shared by every job: no job may be named so.
FILE_INDEX_FOLDER = "file_index"
# Field metadata: a checkpoint written under one value may be resumed under another (where the
# job runs, how fast, what it reports), unlike everything that shapes the trained weights.
RESUMABLE = {"resumable": True}
# Field metadata: a checkpoint written before the field existed behaved as its default does, so the
# field's absence there is no change (unlike norm_weight_decay, whose absence means "decayed").
ABSENT_IS_DEFAULT = {"absent_is_default": True}
# Field metadata for options added after job ids were first derived from the configuration: absent
# from an older checkpoint means the default, and at the default the field is left out of the
# derived job id, so that an older job's command still finds (and resumes) its job folder.
ADDED_LATER = {"absent_is_default": True, "hashed_if_set": True}
# Field metadata for where the data are: a resumed run may read them from another place (copied to
# node-local disk, moved by an admin), because the checkpoint records the data's identity and a
# resume checks that instead (fixres_dist.training.checkpoint.check_same_data); the place still
# goes into the derived job id, so the same command on other data starts another job.
DATA_PLACE = {"resumable": True, "in_job_id": True}
PATH_FIELDS = ("data_path", "weight_path", "resume")  # compared as absolute paths (resolved_path)
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# --interpolation: the resize interpolations (fixres_dist.data.pipeline maps them to torchvision's modes), and
# the one used unless the architecture's own preprocessing names another (fixres_dist.models.preprocessing).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
DEFAULT_INTERPOLATION = "bilinear"
CROP_RATIO = 0.875  # test-time centre crop keeps 87.5 % of the resized shorter side (--crop-ratio)
# --finetune-scope: what trains (fixres_dist.fixres.finetuning). FixRes trained the head and the last BatchNorm
# (section 4).
SCOPES = ("head+last-norm", "head", "norms+head", "all")

# The training recipes' option names (torchvision's references/classification/train.py):
# --opt, --lr-scheduler, --auto-augment (fixres_dist.training.optim, fixres_dist.data.pipeline).
OPTIMIZERS = ("sgd", "sgd-nesterov", "adamw", "rmsprop")
LR_SCHEDULERS = ("cosine", "step", "exponential")
# --sharding (fixres_dist.distributed.sharding): DDP replicas, FSDP2 full shard, hybrid shard (HSDP).
SHARDINGS = ("ddp", "full", "hybrid")
# --world-change (fixres_dist.training.world_change): what a run resumed on another number of data-parallel
# ranks keeps: the global batch (more or fewer accumulated micro-batches) or each rank's batch (linear scaling rule).
WORLD_CHANGES = ("keep-global-batch", "keep-rank-batch")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # fixres_dist.distributed.pipeline.SCHEDULES
# How JPEGs are decoded (fixres_dist.data.scaled_decode): scaled = the kept window at a DCT scale, full = whole.
JPEG_DECODES = ("scaled", "full")
AUTO_AUGMENT_POLICIES = ("ra", "ta_wide", "augmix", "imagenet")  # torchvision v2 policies (data.train_transform)
# --tracker: experiment trackers fed rank 0's record (fixres_dist.reporting.trackers), and --wandb-mode.
TRACKERS = ("mlflow", "wandb")
WANDB_MODES = ("offline", "online")
# --best-metric (fixres_dist.training.best_checkpoint): a field of each epoch's evaluation at the test resolution
# and which way is better (top-1/top-5 in percent, loss in nats); ema_<field>: of the --model-ema average's.
METRIC_GOALS = {"top1": "higher", "top5": "higher", "loss": "lower"}
BEST_METRICS = (*METRIC_GOALS, *(f"ema_{name}" for name in METRIC_GOALS))
# Bounds that catch typos before they reach torch as overflows or degenerate draws: weight decay above
# 1 shrinks weights faster than any recipe (torchvision's 1e-4 to AdamW's 0.05); MixUp/CutMix alphas
# outside [1e-3, 1e3] are Beta draws of exactly 0 or 1/2 in float32 (the recipes use 0.1 to 1);
# repeated augmentation beyond 32 copies leaves an epoch a 32nd of its distinct images (DeiT: 3).
MAX_WEIGHT_DECAY, MIX_ALPHAS, MAX_RA_REPS = 1.0, (1e-3, 1e3), 32
_DECAYS = "recipes use 1e-5 to 0.05"

# --architecture name families besides torchvision's classifiers (fixres_dist.models.architectures builds them).
# Our name -> the name efficientnet_lite_pytorch knows.
LITE_MODELS = {f"efficientnet_lite{i}": f"efficientnet-lite{i}" for i in range(5)}
TIMM_PREFIX = "timm/"
# The CIFAR ResNets of He et al. 2016, section 4.2: name -> n (blocks per stage; depth 6n + 2).
CIFAR_RESNETS = {"resnet20": 3, "resnet32": 5, "resnet44": 7, "resnet56": 9, "resnet110": 18}
# Optional package (import name) -> (pip name, extra of setup.py).
OPTIONAL_PACKAGES = {"efficientnet_lite_pytorch": ("efficientnet-lite-pytorch", "lite0"), "timm": ("timm", "timm")}


def _finite(attribute, value):
    if isinstance(value, float) and not math.isfinite(value):
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be a finite number, got {value}")


def _non_negative(instance, attribute, value):
    _finite(attribute, value)
    if value < 0:
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be >= 0, got {value}")


def _positive(instance, attribute, value):
    if value is not None:
        _finite(attribute, value)
    if value is not None and value <= 0:
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be > 0, got {value}")


def _trackers(value) -> tuple[str, ...]:
    """``--tracker``'s names as a tuple, each once, in order: from a tuple or list, or ``mlflow,wandb``."""
    if value is None:
        return ()
    names = value.split(",") if isinstance(value, str) else value
    return tuple(dict.fromkeys(name.strip() for name in names if name.strip()))


def _known_trackers(instance, attribute, value):
    for name in value:
        if name not in TRACKERS:
            raise FixresError(f"--tracker must be one of {', '.join(TRACKERS)}; got {name!r}")


def _optional_name(instance, attribute, value):
    if value is not None and not value.strip():
        raise FixresError(f"--{attribute.name.replace('_', '-')} must not be empty")


def _one_of(*choices):
    def check(instance, attribute, value):
        if value not in choices:
            raise FixresError(f"--{attribute.name.replace('_', '-')} must be one of {', '.join(choices)}; "
                              f"got {value!r}")
    return check


def _signal_name(instance, attribute, value):
    if not (value.startswith("SIG") and hasattr(signal.Signals, value)) or value in ("SIGKILL", "SIGSTOP"):
        raise FixresError(f"--preempt-signal {value!r} is not a catchable signal name such as SIGUSR2")


def _job_id(instance, attribute, value):
    if not JOB_ID_PATTERN.match(value):
        raise FixresError(f"--job-id {value!r} is not safe as a folder name: use 1-128 characters "
                          "from letters, digits, '.', '_', '-', starting with a letter or digit")
    if value == FILE_INDEX_FOLDER:
        raise FixresError(f"--job-id {value} is reserved: that folder of --shared-folder-path holds the data's "
                          "file indexes; choose another name")


def _dist_url(instance, attribute, value):
    try:
        parsed = urlparse(value)
        port = parsed.port
    except ValueError as exc:
        raise FixresError(f"--dist-url {value!r}: {exc}") from None
    if parsed.scheme not in ("file", "tcp", "env"):
        raise FixresError(f"--dist-url {value!r}: the scheme must be file://, tcp:// or env://")
    if parsed.scheme == "tcp" and (not parsed.hostname or not port):
        raise FixresError(f"--dist-url {value!r}: give tcp://HOST:PORT")
    if parsed.scheme == "file" and (parsed.netloc or not parsed.path.startswith("/") or parsed.path.endswith("/")):
        raise FixresError(f"--dist-url {value!r}: give file:///ABSOLUTE/PATH/FILE (three slashes)")


# Larger test resolutions are typos (FixEfficientNet-L2 tested at 800 px): refused before memory runs out.
MAX_RESOLUTION = 4096


def _check_resolution(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FixresError(f"{flag} must be a positive number of pixels, got {value!r}")
    if value > MAX_RESOLUTION:
        raise FixresError(f"{flag} {value} px is above {MAX_RESOLUTION} px; a typo? (one such image alone "
                          f"needs {3 * 4 * value * value / 2**30:.1f} GiB as float32)")


def _resolution(instance, attribute, value):
    if value is not None:
        _check_resolution(f"--{attribute.name.replace('_', '-')}", value)


def _input_size(instance, attribute, value):
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise FixresError(f"--input-size must be a positive integer or 'auto', got {value!r}")
    if value != "auto":
        _check_resolution("--input-size", value)


def _sizes(value):
    """``--test-sizes``, ``--pipeline-split`` as a tuple of ints (JSON gives lists); None stays None."""
    return None if value is None else tuple(value)


def _test_sizes(instance, attribute, value):
    if value is None:
        return
    if not value:
        raise FixresError("--test-sizes must list at least one resolution")
    for v in value:
        _check_resolution("--test-sizes", v)
    if len(set(value)) != len(value):
        raise FixresError(f"--test-sizes lists a resolution twice: {list(value)}")


def _last_norm(instance, attribute, value):
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise FixresError(f"--last-norm must name a normalisation module (e.g. layer4.1.bn2), got {value!r}")
    if instance.mode != "finetune":
        raise FixresError("--last-norm only applies to main_finetune.py (the norm that the FixRes finetune trains)")


def _fraction(instance, attribute, value):
    _finite(attribute, value)
    if not 0 <= value < 1:
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be in [0, 1), got {value}")


def _channel_triple(value):
    """``--mean``/``--std`` as a tuple of 3 floats (JSON gives lists; one number means all channels)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


def _mean_std(instance, attribute, value):
    if value is None:
        return
    flag = f"--{attribute.name}"
    if len(value) != 3 or not all(math.isfinite(v) for v in value):
        raise FixresError(f"{flag} must be 3 finite numbers (R,G,B on the 0-1 scale), got {list(value)}")
    if attribute.name == "std" and min(value) <= 0:
        raise FixresError(f"--std must be > 0 for every channel, got {list(value)}")


def _crop_ratio(instance, attribute, value):
    if value is None:
        return
    _finite(attribute, value)
    if not 0 < value <= 1:
        raise FixresError(f"--crop-ratio must be in (0, 1] (the centre crop's share of the resized shorter "
                          f"side; 0.875 is 224 of 256 px), got {value}")


def _weight_key(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise FixresError(f"--weight-key must name a top-level entry of the weight file, got {value!r}")


def _probability(instance, attribute, value):
    _finite(attribute, value)
    if not 0 <= value <= 1:
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be a probability in [0, 1], got {value}")


def _gamma(instance, attribute, value):
    _finite(attribute, value)
    if not 0 < value <= 1:
        raise FixresError(f"--lr-gamma must be in (0, 1] (the factor the learning rate is multiplied by), got {value}")


def _ema_decay(instance, attribute, value):
    _finite(attribute, value)
    if not 0 <= value < 1:
        raise FixresError(f"--model-ema-decay must be in [0, 1) (the weight of the average at each update, e.g. "
                          f"0.999), got {value}")


def _at_most(check, limit, why: str):
    """A validator: ``check``, then at most ``limit`` (``why``: the usual values, for the message)."""
    def bounded(instance, attribute, value):
        check(instance, attribute, value)
        if value > limit:
            raise FixresError(f"--{attribute.name.replace('_', '-')} must be at most {limit:g} ({why}), got {value:g}")
    return bounded


def _mix_alpha(instance, attribute, value):
    _non_negative(instance, attribute, value)
    low, high = MIX_ALPHAS
    if value and not low <= value <= high:
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be 0 (off) or in [{low:g}, {high:g}] (the "
                          f"Beta(alpha, alpha) parameter; recipes use 0.1 to 1), got {value:g}")


def _at_least_one(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FixresError(f"--{attribute.name.replace('_', '-')} must be a whole number >= 1, got {value!r}")


def _nearest_metric(name: str) -> str:
    """The --best-metric meant by another spelling (``acc1``, ``val_loss``, ``top-5``, ``ema_acc``), else the
    closest name."""
    words = name.lower()
    base = "loss" if "loss" in words else "top5" if "5" in words else "top1" if "acc" in words or "1" in words \
        else None
    if base is None:
        return difflib.get_close_matches(name, BEST_METRICS, n=1, cutoff=0.0)[0]
    return f"ema_{base}" if "ema" in words else base


def _best_metric(instance, attribute, value):
    if value is not None and value not in BEST_METRICS:
        raise FixresError(f"--best-metric {value!r} is not one of {', '.join(BEST_METRICS)}; the nearest: "
                          f"{_nearest_metric(str(value))}")


def _seed(instance, attribute, value):
    if not 0 <= value < 2 ** 63:
        raise FixresError(f"--seed must be in [0, 2**63), got {value}")


def resolved_path(value: str | None) -> str | None:
    """A user's path as an absolute path with symbolic links resolved (``./data``, ``data/``,
    ``$PWD/data`` and a link to it are one folder), so that the same folder spelt differently is the
    same configuration. None stays None."""
    return None if value is None else os.path.realpath(os.path.expanduser(str(value)))


@attrs.define(frozen=True, kw_only=True)
class TrainerConfig:
    """Everything a rank needs to run its part of a job; immutable and validated on creation.

    Sizes are in pixels, ``batch`` is images per process, ``dist_timeout`` is in seconds,
    ``learning_rate`` is the rate for a global batch of 256 images (scaled linearly, see
    :func:`fixres_dist.training.engine.scaled_learning_rate`). Raises :class:`FixresError` on an invalid
    value. ``to_json``/``from_json`` give a lossless round trip through ``config.json``.
    """

    # Where this process sits in the job (see fixres_dist.distributed.placement.resolve_placement).
    num_tasks: int = attrs.field(default=1, validator=_positive, metadata=RESUMABLE)
    global_rank: int = attrs.field(default=0, validator=_non_negative, metadata=RESUMABLE)
    local_rank: int = attrs.field(default=0, validator=_non_negative, metadata=RESUMABLE)
    job_id: str = attrs.field(default="local", validator=_job_id, metadata=RESUMABLE)
    dist_backend: str = attrs.field(default="gloo", validator=_one_of("gloo", "nccl"), metadata=RESUMABLE)
    dist_url: str = attrs.field(default="env://", validator=_dist_url, metadata=RESUMABLE)
    dist_timeout: float = attrs.field(default=300.0, validator=_positive, metadata=RESUMABLE)
    shared_folder_path: str = attrs.field(default="runs", metadata=RESUMABLE)

    # What to train, on what.
    mode: str = attrs.field(default="scratch", validator=_one_of("scratch", "finetune"))
    data_path: str | None = attrs.field(default=None, converter=resolved_path, metadata=DATA_PLACE)
    architecture: str = "resnet18"
    low_res_stem: bool = False  # torchvision ResNets: 3x3 stride-1 conv1, no max-pool (models.build_model)
    weight_path: str | None = attrs.field(default=None, converter=resolved_path)
    # The weight file's entry with the weights (model_ema, state_dict_ema...; weights.read_weight_file).
    weight_key: str | None = attrs.field(default=None, validator=_weight_key, metadata=ABSENT_IS_DEFAULT)
    train_size: int | None = attrs.field(default=None, validator=_resolution)
    input_size: int | str = attrs.field(default=32, validator=_input_size)
    test_size: int | None = attrs.field(default=None, validator=_resolution)
    test_sizes: tuple[int, ...] | None = attrs.field(default=None, converter=_sizes, validator=_test_sizes,
                                                    metadata=RESUMABLE)

    # The FixRes finetune (fixres.py) and what a run produces besides training.
    finetune_scope: str = attrs.field(default="head+last-norm", validator=_one_of(*SCOPES))
    finetune_augmentation: str = attrs.field(default="test", validator=_one_of("test", "fixres"))
    last_norm: str | None = attrs.field(default=None, validator=_last_norm)  # None: found by data flow (fixres.py)
    eval_only: bool = False
    extract_features: str | None = attrs.field(default=None, metadata=RESUMABLE)
    extract_split: str = attrs.field(default="val", validator=_one_of("val", "train"), metadata=RESUMABLE)
    overwrite: bool = attrs.field(default=False, metadata=RESUMABLE)

    # How.
    batch: int = attrs.field(default=64, validator=_positive)
    epochs: int = attrs.field(default=6, validator=_positive)
    # Per 256 images (linear scaling rule); 0.1 is Goyal et al.'s ResNet rate for batch 256.
    learning_rate: float = attrs.field(default=0.1, validator=_positive)
    momentum: float = attrs.field(default=0.9, validator=_non_negative)
    weight_decay: float = attrs.field(default=5e-5, validator=_at_most(_non_negative, MAX_WEIGHT_DECAY, _DECAYS))
    # Weight decay of normalisation-layer parameters and of every bias (0: none, the usual choice).
    norm_weight_decay: float = attrs.field(default=0.0, validator=_at_most(_non_negative, MAX_WEIGHT_DECAY, _DECAYS))
    label_smoothing: float = attrs.field(default=0.0, validator=_fraction)
    warmup_epochs: float = attrs.field(default=1.0, validator=_non_negative)
    # The recipes users bring from torchvision's references, DeiT and timm (docs/recipes.md, "Recipes").
    opt: str = attrs.field(default="sgd", validator=_one_of(*OPTIMIZERS), metadata=ADDED_LATER)
    lr_scheduler: str = attrs.field(default="cosine", validator=_one_of(*LR_SCHEDULERS), metadata=ADDED_LATER)
    lr_step_size: int = attrs.field(default=30, validator=_at_least_one, metadata=ADDED_LATER)  # epochs
    lr_gamma: float = attrs.field(default=0.1, validator=_gamma, metadata=ADDED_LATER)
    clip_grad_norm: float | None = attrs.field(default=None, validator=_positive, metadata=ADDED_LATER)
    # Micro-batches of `batch` images per rank accumulated into one optimizer step.
    grad_accum_steps: int = attrs.field(default=1, validator=_at_least_one, metadata=ADDED_LATER)
    mixup_alpha: float = attrs.field(default=0.0, validator=_mix_alpha, metadata=ADDED_LATER)
    cutmix_alpha: float = attrs.field(default=0.0, validator=_mix_alpha, metadata=ADDED_LATER)
    auto_augment: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        _one_of(*AUTO_AUGMENT_POLICIES)), metadata=ADDED_LATER)
    random_erase: float = attrs.field(default=0.0, validator=_probability, metadata=ADDED_LATER)
    # Exponential moving average of the weights (fixres_dist.models.ema): decay per update, an update
    # every model_ema_steps optimizer steps.
    model_ema: bool = attrs.field(default=False, metadata=ADDED_LATER)
    model_ema_decay: float = attrs.field(default=0.999, validator=_ema_decay, metadata=ADDED_LATER)
    model_ema_steps: int = attrs.field(default=32, validator=_at_least_one, metadata=ADDED_LATER)
    # Repeated augmentation: copies of each image per epoch cycle (1: off; fixres_dist.data.samplers).
    ra_reps: int = attrs.field(default=1, validator=_at_most(_at_least_one, MAX_RA_REPS, "copies of each image per "
                               "cycle; DeiT and FixRes use 3, torchvision 4"), metadata=ADDED_LATER)
    # The --recipe preset these values started from (fixres_dist.training.recipes); the values are the fields.
    recipe: str | None = attrs.field(default=None, metadata=RESUMABLE)
    # The --config file (YAML or JSON) the settings were read from, under the flags given (entry/config_file.py).
    config_file: str | None = attrs.field(default=None, converter=resolved_path, metadata=RESUMABLE)
    tensorboard: bool = attrs.field(default=False, metadata=RESUMABLE)
    # After the run ends successfully, the export folder of its last checkpoint in <job folder>/export/
    # (fixres_dist.deploy.export, written by the launcher, not the ranks).
    export: bool = attrs.field(default=False, metadata=RESUMABLE)
    # Experiment trackers fed rank 0's record (fixres_dist.reporting.trackers); None: each one's default.
    trackers: tuple[str, ...] = attrs.field(default=(), converter=_trackers, validator=_known_trackers,
                                            metadata=RESUMABLE)
    mlflow_tracking_uri: str | None = attrs.field(default=None, validator=_optional_name, metadata=RESUMABLE)
    mlflow_experiment: str | None = attrs.field(default=None, validator=_optional_name, metadata=RESUMABLE)
    wandb_project: str | None = attrs.field(default=None, validator=_optional_name, metadata=RESUMABLE)
    wandb_mode: str = attrs.field(default="offline", validator=_one_of(*WANDB_MODES), metadata=RESUMABLE)
    wandb_dir: str | None = attrs.field(default=None, converter=resolved_path, metadata=RESUMABLE)
    dist_bn: str = attrs.field(default="reduce", validator=_one_of("reduce", "broadcast"))
    workers: int = attrs.field(default=2, validator=_non_negative, metadata=RESUMABLE)
    # JPEGs decoded at the smallest DCT scale that covers their crop (fixres_dist.data.scaled_decode), or whole;
    # the pixels differ by rounding only, so a resume may change it.
    jpeg_decode: str = attrs.field(default="scaled", validator=_one_of(*JPEG_DECODES),
                                   metadata={**RESUMABLE, **ADDED_LATER})
    seed: int = attrs.field(default=0, validator=_seed)
    # Input preprocessing (preprocessing.py): None = the architecture's or the weight file's own.
    mean: tuple[float, float, float] | None = attrs.field(default=None, converter=_channel_triple,
                                                          validator=_mean_std, metadata=ABSENT_IS_DEFAULT)
    std: tuple[float, float, float] | None = attrs.field(default=None, converter=_channel_triple,
                                                         validator=_mean_std, metadata=ABSENT_IS_DEFAULT)
    crop_ratio: float | None = attrs.field(default=None, validator=_crop_ratio, metadata=ABSENT_IS_DEFAULT)
    interpolation: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        _one_of(*INTERPOLATIONS)), metadata=ABSENT_IS_DEFAULT)
    device: str = attrs.field(default="cpu", validator=_one_of("cpu", "cuda"), metadata=RESUMABLE)
    # Speed (issue 6): mixed precision, memory format, torch.compile backend, synchronised BatchNorm.
    amp: str = attrs.field(default="off", validator=_one_of("bf16", "fp16", "off"), metadata=RESUMABLE)
    channels_last: bool = attrs.field(default=False, metadata=RESUMABLE)
    compile: str | None = attrs.field(default=None, metadata=RESUMABLE)
    sync_bn: bool = False
    # How the ranks hold the model (fixres_dist.distributed.sharding): DDP replicas, FSDP2 full shard or
    # hybrid shard (shard groups of shard_group_size ranks, None: a node's), and its options; activation
    # checkpointing per block with any of them. A job may resume under another choice.
    sharding: str = attrs.field(default="ddp", validator=_one_of(*SHARDINGS), metadata=RESUMABLE)
    shard_group_size: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    reshard_after_forward: bool = attrs.field(default=True, metadata=RESUMABLE)
    cpu_offload: bool = attrs.field(default=False, metadata=RESUMABLE)
    activation_checkpointing: bool = attrs.field(default=False, metadata=RESUMABLE)
    # Ranks per tensor group (fixres_dist.distributed.tensor_parallel): each ViT block's matrices split over
    # that many consecutive ranks, which see the same images; the groups are data-parallel to each other.
    tensor_parallel: int = attrs.field(default=1, validator=_positive, metadata=RESUMABLE)
    # Pipeline stages (fixres_dist.distributed.pipeline): the model cut into that many stages on consecutive
    # ranks, run by a schedule over micro-batches; the pipelines are data-parallel to each other.
    pipeline_stages: int = attrs.field(default=1, validator=_positive, metadata=RESUMABLE)
    pipeline_schedule: str = attrs.field(default="1f1b", validator=_one_of(*PIPELINE_SCHEDULES), metadata=RESUMABLE)
    pipeline_microbatches: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    pipeline_split: tuple[int, ...] | None = attrs.field(default=None, converter=_sizes, metadata=RESUMABLE)
    # GiB a rank may use at its peak (the preflight's estimate: fixres_dist.training.memory_budget); None: the
    # GPU's memory on CUDA, no limit on the CPU.
    memory_budget: float | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    # Rank 0's progress bars (progress.py); None: when stderr is a terminal.
    progress: bool | None = attrs.field(default=None, metadata=RESUMABLE)

    # Never lose work (checkpoint.py): periodic checkpoints, resume, preemption.
    ckpt_every: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    keep_checkpoints: int = attrs.field(default=2, validator=_positive, metadata=RESUMABLE)
    resume: str | None = attrs.field(default=None, converter=resolved_path, metadata=RESUMABLE)
    preempt_signal: str = attrs.field(default="SIGUSR2", validator=_signal_name, metadata=RESUMABLE)
    # The best checkpoint by a metric of each epoch's evaluation (None: none kept), and early stopping after
    # that many evaluations without an improvement by more than the min delta (fixres_dist.training.best_checkpoint).
    best_metric: str | None = attrs.field(default=None, validator=_best_metric, metadata=ADDED_LATER)
    early_stopping_patience: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least_one),
                                                      metadata=ADDED_LATER)
    early_stopping_min_delta: float = attrs.field(default=0.0, validator=_non_negative, metadata=ADDED_LATER)
    skip_bad_images: bool = attrs.field(default=False, metadata=RESUMABLE)
    # The stall watchdog (fixres_dist.distributed.watchdog): seconds without progress before a rank is stalled;
    # None: derived from the steps seen, 0: off.
    stall_timeout: float | None = attrs.field(default=None, validator=attrs.validators.optional(_non_negative),
                                              metadata=RESUMABLE)
    # Lose a node, keep training (fixres_dist.training.world_change): what a resume on another world size
    # keeps, the fewest ranks the job goes on with, and the global batch it keeps (set by that resume from
    # the checkpoint; None: --batch x data-parallel ranks x --grad-accum-steps), with the data-parallel ranks of
    # the run that set it, whose rule for an epoch's short last batch the sampler keeps (data/samplers.py).
    world_change: str = attrs.field(default="keep-global-batch", validator=attrs.validators.in_(WORLD_CHANGES),
                                    metadata=RESUMABLE)
    min_world_size: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    global_batch: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    global_batch_ranks: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)

    # Where the time goes (reporting/profiling.py): a torch.profiler trace of --profile training steps
    # after --profile-after steps of this process, on every rank.
    profile: int | None = attrs.field(default=None, validator=_positive, metadata=RESUMABLE)
    profile_after: int = attrs.field(default=5, validator=_non_negative, metadata=RESUMABLE)
    # Each rank's step breakdown per epoch, stragglers and a loader-bound job (reporting/step_times.py).
    step_times: bool = attrs.field(default=True, metadata=RESUMABLE)

    def __attrs_post_init__(self):
        _check_options(self)

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different images: ``num_tasks`` over the ranks of one split model (a tensor
        group, a pipeline), which see the same. Batch arithmetic (global batch, linear scaling rule) counts these.
        The rest of the layout (each rank's place, the device mesh): :func:`fixres_dist.distributed.layout.of`."""
        return self.num_tasks // (self.tensor_parallel * self.pipeline_stages)

    @property
    def images_per_step(self) -> int:
        """The global batch: images per optimizer step over all data-parallel ranks (``global_batch``, kept
        from a run on another world size, else ``batch`` x :attr:`data_parallel_size` x ``grad_accum_steps``)."""
        return steps_of(self.batch, self.data_parallel_size, self.grad_accum_steps, self.global_batch)[0]

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step on each rank: ``grad_accum_steps``, or, with a kept ``global_batch``,
        as many as keep each micro-batch at ``batch`` images or fewer (a rank's share: the global batch over
        the data-parallel ranks, rounded up)."""
        return steps_of(self.batch, self.data_parallel_size, self.grad_accum_steps, self.global_batch)[1]

    @property
    def run_name(self) -> str:
        """What this run is, in its log, metrics and reports: ``evaluation`` (``--eval-only``, whichever
        script ran it), else ``scratch`` or ``finetune``."""
        return "evaluation" if self.eval_only else self.mode

    @property
    def first_input_size(self) -> int:
        """The training resolution in pixels; with ``--input-size auto``, the first of ``--test-sizes``
        until the sweep before the finetune picks one."""
        return self.input_size if self.input_size != "auto" else self.test_sizes[0]

    @property
    def job_folder(self) -> Path:
        """``<shared_folder_path>/<job_id>``: where config.json, metrics.jsonl and checkpoint.pth go."""
        return Path(self.shared_folder_path) / self.job_id

    @property
    def file_index_folder(self) -> Path:
        """``<shared_folder_path>/file_index``: the data's file indexes, shared by every job
        (:mod:`fixres_dist.data.file_index`)."""
        return Path(self.shared_folder_path) / FILE_INDEX_FOLDER

    def rendezvous_url(self, file_name: str = RENDEZVOUS_FILE) -> str:
        """Where the ranks of this job meet by default: ``file://<job folder>/<file_name>`` (absolute)."""
        return "file://" + str((self.job_folder / file_name).absolute())

    def placed(self, *, num_tasks: int, global_rank: int, local_rank: int, job_id: str | None = None,
               dist_url: str | None = None) -> "TrainerConfig":
        """This configuration at one rank of a job: the one place that fills in job id and rendezvous.

        ``job_id`` None: :meth:`derived_job_id`, the same for the same configuration, so that running
        the same command again resumes the job. ``dist_url`` None: the job folder's
        :meth:`rendezvous_url` for several ranks, ``env://`` (unused) for one.
        """
        placed = attrs.evolve(self, num_tasks=num_tasks, global_rank=global_rank, local_rank=local_rank,
                              job_id=job_id or self.derived_job_id())
        return attrs.evolve(placed, dist_url=dist_url or (placed.rendezvous_url() if num_tasks > 1 else "env://"))

    def derived_job_id(self) -> str:
        """The job id of a run given none: ``<mode>-<architecture>-<12 hex digits>``.

        The digits are the SHA-256 of every field that shapes the trained weights (the fields not
        marked resumable: data folder, architecture, resolutions, schedule, seed, ...), so the same
        command run again (after a preemption, a crash, a reboot) finds its own job folder and
        resumes, from any launcher and any number of ranks, while a different configuration gets
        another folder. Where a run executes and how it reports (ranks, workers, speed options,
        ``--resume``) do not change the id, nor do options added later (``ADDED_LATER``) at their default.
        """
        defaults = {f.name: f.default for f in attrs.fields(type(self)) if f.metadata.get("hashed_if_set")}
        in_job_id = {f.name for f in attrs.fields(type(self)) if f.metadata.get("in_job_id")}
        fields = {k: v for k, v in self.to_dict().items() if (k not in self.resumable_fields() or k in in_job_id)
                  and not (k in defaults and v == defaults[k])}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]
        architecture = re.sub(r"[^A-Za-z0-9._-]+", "-", self.architecture).strip("-.")[:64] or "model"
        return f"{self.mode}-{architecture}-{digest}"

    @classmethod
    def resumable_fields(cls) -> frozenset[str]:
        """Fields a resumed run may change (``metadata=RESUMABLE``); every other one must match."""
        return frozenset(f.name for f in attrs.fields(cls) if f.metadata.get("resumable"))

    def changed_since(self, saved: dict) -> list[str]:
        """Names of the non-resumable fields whose value differs from ``saved`` (a :meth:`to_dict`).

        A field that ``saved`` lacks (a checkpoint from before the field existed) counts as changed:
        the run that wrote it trained without that option, e.g. decaying norms and biases like weights;
        except for fields marked ``ABSENT_IS_DEFAULT``, whose default is what older runs did: there
        only another value than the default is a change.
        """
        mine = self.to_dict()
        saved = {**saved, **{k: resolved_path(saved[k]) for k in PATH_FIELDS if isinstance(saved.get(k), str)}}

        def changed(f) -> bool:
            if f.name in saved:
                return saved[f.name] != mine[f.name]
            return not (f.metadata.get("absent_is_default") and mine[f.name] == f.default)
        return sorted(f.name for f in attrs.fields(type(self)) if not f.metadata.get("resumable") and changed(f))

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainerConfig":
        """Build from a dict as written by :meth:`to_dict`; raises FixresError on unknown keys."""
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FixresError(f"config has unknown keys {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "TrainerConfig":
        return cls.from_dict(json.loads(text))


def _check_sharding(config: TrainerConfig) -> None:
    """Options that only mean something sharded, and what sharding cannot do."""
    sharded = config.sharding != "ddp"
    if config.shard_group_size is not None:
        if config.sharding != "hybrid":
            raise FixresError("--shard-group-size applies to --sharding hybrid (shard within groups of N ranks)")
    if not sharded and (config.cpu_offload or not config.reshard_after_forward):
        flag = "--cpu-offload" if config.cpu_offload else "--no-reshard-after-forward"
        raise FixresError(f"{flag} applies to a sharded model: add --sharding full or hybrid")
    if config.cpu_offload and config.device != "cuda":
        raise FixresError("--cpu-offload moves a sharded model's parameters from the GPU to the CPU: it needs "
                          "--device cuda (on the CPU they are there already)")
    if sharded and config.dist_bn == "broadcast":
        raise FixresError("--dist-bn broadcast is DDP's buffer broadcast; with --sharding "
                          f"{config.sharding} use --dist-bn reduce (BatchNorm statistics averaged at epoch ends)")
    if sharded and config.architecture.startswith("vit_") and not config.eval_only:
        raise FixresError(f"--sharding {config.sharding} cannot run torchvision's {config.architecture} at other "
                          "resolutions (it copies the model to resize the position embedding): use a timm ViT "
                          f"(e.g. {TIMM_PREFIX}vit_base_patch16_224), which resamples it in place, or --sharding "
                          "ddp")


def _refuse_with_a_split(config: TrainerConfig, split: str, *more: tuple[str, bool], shards: bool = False,
                         recomputes: bool = False, averages: bool = False) -> None:
    """A split model (``split``: its flag) does not compose yet with the options in effect here (``shards``:
    but for ``--sharding full/hybrid``; ``recomputes``: but for ``--activation-checkpointing``; ``averages``:
    but for ``--model-ema``), nor with ``more`` ((flag, in effect) pairs): FixresError naming the first."""
    refused = [flag for flag, on in (*more, ("--sharding " + config.sharding, config.sharding != "ddp" and not shards),
                                     ("--model-ema", config.model_ema and not averages),
                                     ("--compile", bool(config.compile)),
                                     ("--amp fp16", config.amp == "fp16"),
                                     ("--activation-checkpointing", config.activation_checkpointing and not recomputes),
                                     ("--dist-bn broadcast", config.dist_bn == "broadcast")) if on]
    if refused:
        flag = refused[0].split()[0]
        raise FixresError(f"{split} does not go with {refused[0]} yet; the nearest that works: "
                          f"{NEAREST_COMPOSITION[flag].format(sharding=config.sharding)} (docs/sharding.md, "
                          "which compositions run)")


# What a refused composition of a split model (tensor groups, pipeline stages) with another option becomes
# in the refusal's line: the nearest that runs (docs/sharding.md's table of compositions).
NEAREST_COMPOSITION = {
    "--sharding": "--sharding {sharding} without --pipeline-stages (each rank holds a shard of every layer), or "
                  "--pipeline-stages with its stages' data-parallel ranks as DDP replicas (why: FSDP2 gathers a "
                  "stage over its data-parallel ranks at every micro-batch, and an uneven last batch gives those "
                  "ranks different micro-batch counts, whose gathers would not pair up)",
    "--tensor-parallel": "--tensor-parallel N --sharding full without --pipeline-stages (2-D: tensor groups, "
                         "sharded over the data-parallel ranks)",
    "--model-ema": "--sharding full --model-ema (the average sharded as the model is), or --pipeline-stages N "
                   "--model-ema (the average cut into the model's stages)",
    "--compile": "--compile with DDP (no split)",
    "--amp": "--amp bf16 (no loss scale to agree on between the parts)",
    "--activation-checkpointing": "--sharding full --activation-checkpointing, or --pipeline-stages N "
                                  "--activation-checkpointing (each stage's blocks recomputed)",
    "--dist-bn": "--dist-bn reduce, the default",
    "--extract-features": "--extract-features on DDP ranks (the same checkpoint, without --pipeline-stages)",
}

def _check_tensor_parallel(config: TrainerConfig) -> None:
    """What tensor parallelism needs, and what it does not compose with yet (refused before start)."""
    ranks = config.tensor_parallel  # its division of the world size: the preflight's (fixres_dist.training.inputs)
    if ranks == 1:
        return
    _refuse_with_a_split(config, f"--tensor-parallel {ranks}", shards=True)  # FSDP x tensor: 2-D
    if config.sharding == "hybrid":  # runs, but no test has shown it equal to DDP yet
        raise FixresError(f"--tensor-parallel {ranks} does not go with --sharding hybrid yet; the nearest that works: "
                          f"--tensor-parallel {ranks} --sharding full (docs/sharding.md, which compositions run)")
    if config.architecture.startswith("vit_"):
        raise FixresError(f"--tensor-parallel cannot run torchvision's {config.architecture}: its attention cannot "
                          "be split and it copies the model to change resolution; use a timm ViT (e.g. "
                          f"{TIMM_PREFIX}vit_base_patch16_224)")


def steps_of(batch: int, data_parallel: int, grad_accum_steps: int, global_batch: int | None) -> tuple[int, int]:
    """A run's optimizer step: (images over all data-parallel ranks, accumulated micro-batches per rank), from
    its ``--batch``, data-parallel ranks and ``--grad-accum-steps``, or from a kept ``global_batch`` (then as
    many micro-batches as keep each at ``batch`` images or fewer of the largest rank's share)."""
    if global_batch is None:
        return batch * data_parallel * grad_accum_steps, grad_accum_steps
    share = -(-global_batch // data_parallel)
    return global_batch, max(1, -(-share // batch))


def _check_options(config: "TrainerConfig") -> None:
    """The checks of one configuration that need several of its fields (FixresError, one line each)."""
    if config.global_rank >= config.num_tasks:
        raise FixresError(f"--global-rank {config.global_rank} must be < --num-tasks {config.num_tasks}")
    if config.local_rank >= config.num_tasks:
        raise FixresError(f"--local-rank {config.local_rank} must be < --num-tasks {config.num_tasks}")
    if config.mode == "finetune" and not config.weight_path:
        raise FixresError("main_finetune.py needs --weight-path (a checkpoint.pth or a state_dict file)")
    if config.amp == "fp16" and config.device != "cuda":
        raise FixresError("--amp fp16 needs --device cuda (its GradScaler is CUDA-only); on CPU use "
                          "--amp bf16 or --amp off")
    if config.batch < 2 and not config.eval_only:
        raise FixresError("--batch must be >= 2 for training: a rank's BatchNorm cannot train on one image "
                          "(--batch 1 is allowed with --eval-only)")
    if config.eval_only and not config.weight_path:
        raise FixresError("--eval-only needs --weight-path (the checkpoint.pth or state_dict to evaluate)")
    if (config.mean is None) != (config.std is None):
        raise FixresError("--mean and --std go together (the normalisation (x - mean) / std needs both)")
    if config.weight_key is not None and not config.weight_path:
        raise FixresError("--weight-key needs --weight-path (it names an entry of that file)")
    if config.opt == "sgd-nesterov" and not config.momentum and not config.eval_only:
        raise FixresError("--opt sgd-nesterov needs a --momentum above 0 (Nesterov momentum without momentum is "
                          "plain SGD: use --opt sgd)")
    if config.eval_only and config.model_ema:
        raise FixresError("--model-ema keeps an average while training; to evaluate the average a checkpoint "
                          "holds, give --eval-only --weight-key model_ema")
    if config.profile and config.eval_only:
        raise FixresError("--profile records training steps, and --eval-only trains none")
    if config.mode == "finetune" and not config.eval_only:
        _check_finetune_regularisation(config=config)
    _check_best(config)
    _check_trackers(config)
    _check_sharding(config)
    _check_tensor_parallel(config)
    _check_pipeline(config)
    if config.global_batch is not None and config.global_batch < 2 * config.data_parallel_size:
        raise FixresError(f"a global batch of {config.global_batch} images is too small for "
                          f"{config.data_parallel_size} data-parallel ranks (at least 2 images each)")
    if config.input_size == "auto":
        if config.mode != "finetune" or config.eval_only:
            raise FixresError("--input-size auto only applies to main_finetune.py (finetune at the best "
                              "swept test resolution)")
        if not config.test_sizes:
            raise FixresError("--input-size auto needs --test-sizes, the resolutions to choose from")


def _check_trackers(config: TrainerConfig) -> None:
    """A tracker's options without that tracker asked for (``--tracker``) would be silently ignored."""
    for name, flags in (("mlflow", ("mlflow_tracking_uri", "mlflow_experiment")),
                        ("wandb", ("wandb_project", "wandb_dir"))):
        given = [f"--{flag.replace('_', '-')}" for flag in flags if getattr(config, flag) is not None]
        if given and name not in config.trackers:
            raise FixresError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --tracker {name}")
    if config.wandb_mode != "offline" and "wandb" not in config.trackers:
        raise FixresError("--wandb-mode needs --tracker wandb")


def _check_best(config: TrainerConfig) -> None:
    """``--best-metric`` and early stopping: what they watch and whether they can act (FixresError, one line).
    Every epoch evaluates, so a training run always has the evaluations they watch."""
    metric, patience = config.best_metric, config.early_stopping_patience
    if config.eval_only and (metric or patience):
        flag = "--best-metric" if metric else "--early-stopping-patience"
        raise FixresError(f"{flag} watches the evaluations of training's epochs, and --eval-only trains none")
    if metric and metric.startswith("ema_") and not config.model_ema:
        raise FixresError(f"--best-metric {metric} watches the --model-ema average's evaluation: add --model-ema, or "
                          f"watch the model's own with --best-metric {metric.removeprefix('ema_')}")
    if config.early_stopping_min_delta and patience is None:
        raise FixresError("--early-stopping-min-delta applies to early stopping: add --early-stopping-patience N")
    if patience is None:
        return
    if metric is None:
        raise FixresError(f"--early-stopping-patience needs --best-metric (one of {', '.join(BEST_METRICS)}): the "
                          "metric whose improvement it waits for")
    if config.mode == "finetune":
        raise FixresError("--early-stopping-patience does not apply to main_finetune.py: a FixRes finetune runs its "
                          "few epochs at the test resolution (--best-metric still keeps its best epoch as best.pth)")
    if patience > config.epochs - 2:
        fix = f"a patience of at most {config.epochs - 2}" if config.epochs > 2 else "at least 3 --epochs"
        raise FixresError(f"--early-stopping-patience {patience} can never end this {config.epochs}-epoch run early: "
                          f"the first epoch's evaluation sets the best, so the earliest stop follows epoch "
                          f"{patience + 1}, and a stop after the last epoch stops nothing; give {fix}")


def _check_pipeline(config: TrainerConfig) -> None:
    """What pipeline stages need, and what they do not compose with yet (refused before start; the
    schedule, the micro-batches and the model's pieces: the preflight's, fixres_dist.training.inputs)."""
    stages = config.pipeline_stages
    if stages == 1:
        given = [flag for flag, on in (("--pipeline-microbatches", config.pipeline_microbatches is not None),
                                       ("--pipeline-split", config.pipeline_split is not None),
                                       ("--pipeline-schedule", config.pipeline_schedule != "1f1b")) if on]
        if given:
            flag = given[0]
            raise FixresError(f"{flag} applies to a model cut into stages: add --pipeline-stages N (N >= 2)")
        return
    # --activation-checkpointing: a stage's blocks are the model's own, checkpointed before the cut; --model-ema:
    # its copy is cut into the same stages (fixres_dist.distributed.pipeline_strategy)
    _refuse_with_a_split(config, f"--pipeline-stages {stages}", ("--tensor-parallel", config.tensor_parallel > 1),
                         ("--extract-features", bool(config.extract_features)), recomputes=True, averages=True)
    if config.grad_accum_steps > 1:
        raise FixresError(f"--pipeline-stages {stages} already accumulates micro-batches: use "
                          f"--pipeline-microbatches instead of --grad-accum-steps {config.grad_accum_steps}")
    if config.architecture.startswith("vit_"):
        raise FixresError(f"--pipeline-stages cannot run torchvision's {config.architecture} at other resolutions "
                          f"(it copies the model to resize the position embedding): use a timm ViT (e.g. "
                          f"{TIMM_PREFIX}vit_base_patch16_224)")


def _check_finetune_regularisation(config: TrainerConfig) -> None:
    """The FixRes finetune adapts the classifier and the last normalisation to the statistics of
    test-time images (FixRes, section 4): mixing images or stronger augmentation would train them
    on other statistics. Mixing is allowed only with ``--finetune-scope all`` (a plain finetune of
    the whole network at a new resolution); the finetune's preprocessing is always
    ``--finetune-augmentation``'s, and repeated augmentation needs one that is random."""
    if (config.mixup_alpha or config.cutmix_alpha) and config.finetune_scope != "all":
        raise FixresError("--mixup-alpha/--cutmix-alpha do not go with --finetune-scope "
                          f"{config.finetune_scope}: the FixRes finetune fits the head and norms to test-time "
                          "image statistics, which mixed images are not; use --finetune-scope all to mix")
    if config.auto_augment or config.random_erase:
        flag = "--auto-augment" if config.auto_augment else "--random-erase"
        raise FixresError(f"{flag} does not apply to main_finetune.py: the finetune's preprocessing is "
                          "--finetune-augmentation's (test = the test transform, FixRes' choice; or fixres)")
    if config.ra_reps > 1 and config.finetune_augmentation == "test":
        raise FixresError("--ra-sampler with --finetune-augmentation test would train on identical copies "
                          "(the test transform is deterministic): use --finetune-augmentation fixres to repeat "
                          "augmentations")
