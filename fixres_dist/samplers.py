"""Distributed batch sampling with exact semantics: every index once per epoch, equal batch counts.

``torch.utils.data.DistributedSampler`` pads the index list with repeats so that every rank gets
the same number of samples; padding duplicates images (wrong for exact evaluation and a bias in
training). :class:`ExactBatchSampler` instead splits each *global* batch (``world_size x batch``
images) across the ranks, so

* each index appears exactly once per epoch over all ranks (no padding, nothing dropped);
* every rank yields the same number of batches (DDP needs this: a rank with one batch more would
  wait forever in its gradient all-reduce);
* the last global batch is shared as evenly as possible; a tail of fewer than ``2 x world_size``
  images is merged into the previous global batch so that no rank gets a batch of 0 or 1 image
  (BatchNorm cannot train on one image).

Batches are lists of :class:`SampleKey` ``(index, epoch)``; :class:`fixres_dist.data.SeededDataset`
turns a key into an image whose augmentation depends only on (seed, epoch, index), not on the
worker, the rank or where the run started.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from torch.utils.data import Sampler


class SampleKey(NamedTuple):
    """What the sampler hands to the dataset: the dataset index and the epoch it is drawn for."""

    index: int
    epoch: int


def global_batches(dataset_size: int, world_size: int, batch_size: int, shuffle: bool,
                   seed: int, epoch: int, skip: int = 0) -> list[torch.Tensor]:
    """The epoch's order, less its first ``skip`` images, cut into global batches (int64 tensors).

    The order depends only on ``(seed, epoch)``, not on the world size, so a run resumed on another
    world size continues the same permutation: no image of the epoch is repeated or skipped.
    """
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(dataset_size, generator=generator)
    else:
        order = torch.arange(dataset_size)
    chunks = list(torch.split(order[skip:], world_size * batch_size))
    if len(chunks) > 1 and len(chunks[-1]) < 2 * world_size:
        tail = chunks.pop()
        chunks[-1] = torch.cat([chunks[-1], tail])
    return chunks


class ExactBatchSampler(Sampler[list[SampleKey]]):
    """Batch sampler for one rank: exact once-per-epoch coverage and equal batch counts.

    Args:
        dataset_size: number of images N.
        world_size, rank: this rank's place (``0 <= rank < world_size``).
        batch_size: images per rank per step (the last step may differ by a few images).
        shuffle: reshuffle every epoch with a generator seeded by ``(seed, epoch)`` (the same on
            all ranks); ``False`` keeps dataset order (evaluation).
        seed: base seed shared by all ranks.

    ``len(sampler)`` is the number of batches, identical on every rank when
    ``dataset_size >= world_size``. Call :meth:`set_epoch` before each epoch.
    """

    def __init__(self, dataset_size: int, world_size: int, rank: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.dataset_size, self.world_size, self.rank = dataset_size, world_size, rank
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Draw batches for ``epoch``, leaving out its first ``skip`` images (already trained on)."""
        self.epoch, self.skip = epoch, skip

    def images_done(self, batches_done: int) -> int:
        """Images of the epoch consumed over all ranks after ``batches_done`` batches of this pass."""
        if batches_done >= len(self):
            return self.dataset_size
        return self.skip + batches_done * self.world_size * self.batch_size

    def global_batch_sizes(self) -> list[int]:
        """Images per global batch (all ranks together) of the current pass, as :func:`global_batches` cuts them."""
        remaining, step = self.dataset_size - self.skip, self.world_size * self.batch_size
        sizes = [step] * (remaining // step) + ([remaining % step] if remaining % step else [])
        if len(sizes) > 1 and sizes[-1] < 2 * self.world_size:
            tail = sizes.pop()
            sizes[-1] += tail
        return sizes

    def __iter__(self) -> Iterator[list[SampleKey]]:
        for chunk in global_batches(self.dataset_size, self.world_size, self.batch_size,
                                    self.shuffle, self.seed, self.epoch, self.skip):
            mine = chunk[self.rank::self.world_size].tolist()
            if mine:
                yield [SampleKey(i, self.epoch) for i in mine]

    def __len__(self) -> int:
        full, rest = divmod(self.dataset_size - self.skip, self.world_size * self.batch_size)
        count, last = (full + 1, rest) if rest else (full, self.world_size * self.batch_size)
        if count == 0:
            return 0
        return count - 1 if count > 1 and last < 2 * self.world_size else count
