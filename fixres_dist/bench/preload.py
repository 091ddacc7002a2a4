"""What the forkserver of the local ranks imports once, before it forks each rank
(:data:`fixres_dist.bench.local_ranks.PRELOAD`): the Trainer, FSDP, and timm where it is installed,
imported as every run imports it (:func:`fixres_dist.models.architectures.import_optional`: without the
wandb timm would import, whose temporary folders a rank ended by a signal or ``os._exit`` leaves behind)."""
import importlib.util

import torch.distributed.fsdp  # noqa: F401

import fixres_dist.training.trainer  # noqa: F401
from fixres_dist.models.architectures import TIMM_PREFIX, import_optional

if importlib.util.find_spec("timm") is not None:
    import_optional("timm", TIMM_PREFIX)
