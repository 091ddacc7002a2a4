"""Where a run is: :class:`TrainState`, the small typed state that the loops advance and the
checkpoint keeps (:class:`~fixres_dist.training.checkpoint.Contents` names its entries)."""
from __future__ import annotations

import attrs

from fixres_dist.config import TrainerConfig
from fixres_dist.training import engine


@attrs.define
class TrainState:
    """This rank's position in the job.

    ``input_size``: the training resolution (pixels; with ``--input-size auto`` the one chosen, or the
    first test size until then); ``epoch``: the epoch in progress (0-based); ``images_in_epoch``: images
    of it trained on, all ranks together (where the samplers resume); ``global_step``: optimizer steps
    done; ``meter``: this rank's sums of the epoch in progress (None between epochs);
    ``resumed_sums``/``resumed_seconds``: the epoch's (loss sum, images, skipped) and training
    seconds before the checkpoint this run resumed in the middle of it.
    """

    input_size: int
    epoch: int = 0
    images_in_epoch: int = 0
    global_step: int = 0
    meter: engine.EpochMeter | None = None
    resumed_sums: tuple = (0.0, 0.0, 0.0)
    resumed_seconds: float = 0.0

    @classmethod
    def start(cls, config: TrainerConfig, contents=None) -> "TrainState":
        """The state at the start of a run; ``contents``: the checkpoint it resumes (its position,
        and the training resolution that ``--input-size auto`` chose)."""
        if contents is None:
            return cls(config.first_input_size)
        return cls(contents.input_size or config.first_input_size, contents.epoch, contents.images_in_epoch,
                   contents.global_step, None, tuple(contents.epoch_sums or (0.0, 0.0, 0.0)), contents.epoch_seconds)

    def eval_size(self, config: TrainerConfig) -> int:
        """The test resolution in pixels: ``--test-size``, else the training resolution."""
        return config.test_size or self.input_size

    def images_seen(self, images_per_epoch: int) -> int:
        """Images trained on since the job started: the x axis of the TensorBoard curves."""
        return self.epoch * images_per_epoch + self.images_in_epoch
