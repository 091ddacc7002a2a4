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

One case cannot keep all three: a *training* epoch resumed on more ranks with fewer than
``2 x world_size`` of its images left (a 1-rank checkpoint with 2 images to go, resumed on 3
ranks). Those images are left out of that epoch (:attr:`ExactBatchSampler.left_out` counts them,
the Trainer logs it) rather than giving a rank one image or a step its peers do not take.
Evaluation samplers (``training=False``) never leave an image out: a rank may then get fewer or
smaller batches, which evaluation allows (it reduces sums once at the end).

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


def global_batch_sizes(remaining: int, world_size: int, batch_size: int, training: bool) -> list[int]:
    """Sizes of the global batches (all ranks together) that ``remaining`` images of an epoch are cut into.

    Full batches of ``world_size x batch_size``, then the rest; a rest of fewer than ``2 x
    world_size`` images is merged into the batch before it, or, in training when there is none,
    left out (the sizes then sum to less than ``remaining``).
    """
    step = world_size * batch_size
    sizes = [step] * (remaining // step) + ([remaining % step] if remaining % step else [])
    if sizes and sizes[-1] < 2 * world_size:
        tail = sizes.pop()
        if sizes:
            sizes[-1] += tail
        elif not training:
            sizes.append(tail)
    return sizes


def global_batches(dataset_size: int, world_size: int, batch_size: int, shuffle: bool,
                   seed: int, epoch: int, skip: int = 0, training: bool = False) -> list[torch.Tensor]:
    """The epoch's order, less its first ``skip`` images, cut into global batches (int64 tensors)
    of :func:`global_batch_sizes`.

    The order depends only on ``(seed, epoch)``, not on the world size, so a run resumed on another
    world size continues the same permutation: no image of the epoch is repeated.
    """
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(dataset_size, generator=generator)
    else:
        order = torch.arange(dataset_size)
    sizes = global_batch_sizes(dataset_size - skip, world_size, batch_size, training)
    return list(torch.split(order[skip:skip + sum(sizes)], sizes))


class ExactBatchSampler(Sampler[list[SampleKey]]):
    """Batch sampler for one rank: exact once-per-epoch coverage and equal batch counts.

    Args:
        dataset_size: number of images N.
        world_size, rank: this rank's place (``0 <= rank < world_size``).
        batch_size: images per rank per step (the last step may differ by a few images).
        shuffle: reshuffle every epoch with a generator seeded by ``(seed, epoch)`` (the same on
            all ranks); ``False`` keeps dataset order (evaluation).
        seed: base seed shared by all ranks.
        training: every rank gets at least 2 images per step (with ``batch_size >= 2``) and the
            same number of steps; an unsplittable rest after a resume is left out (module notes).
            ``False``: every image exactly once, some ranks may get fewer batches.

    ``len(sampler)`` is this rank's number of batches in the current pass (the same on every rank
    in training). Call :meth:`set_epoch` before each epoch.
    """

    def __init__(self, dataset_size: int, world_size: int, rank: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0, training: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.dataset_size, self.world_size, self.rank = dataset_size, world_size, rank
        self.batch_size, self.shuffle, self.seed, self.training = batch_size, shuffle, seed, training
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Draw batches for ``epoch``, leaving out its first ``skip`` images (already trained on)."""
        self.epoch, self.skip = epoch, skip

    def global_batch_sizes(self) -> list[int]:
        """Images per global batch (all ranks together) of the current pass."""
        return global_batch_sizes(self.dataset_size - self.skip, self.world_size, self.batch_size, self.training)

    @property
    def left_out(self) -> int:
        """Images of the current pass that no rank gets (training only; see the module notes)."""
        return self.dataset_size - self.skip - sum(self.global_batch_sizes())

    @property
    def common_batches(self) -> int:
        """Batches of the current pass that every rank gets (all of them in training)."""
        return sum(1 for size in self.global_batch_sizes() if size >= self.world_size)

    def images_done(self, batches_done: int) -> int:
        """Images of the epoch consumed over all ranks after ``batches_done`` batches of this pass."""
        if batches_done >= len(self):
            return self.dataset_size
        return self.skip + batches_done * self.world_size * self.batch_size  # all but the last are full

    def __iter__(self) -> Iterator[list[SampleKey]]:
        for chunk in global_batches(self.dataset_size, self.world_size, self.batch_size,
                                    self.shuffle, self.seed, self.epoch, self.skip, self.training):
            mine = chunk[self.rank::self.world_size].tolist()
            if mine:
                yield [SampleKey(i, self.epoch) for i in mine]

    def __len__(self) -> int:
        return sum(1 for size in self.global_batch_sizes() if size > self.rank)
