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

Repeated augmentation (``reps = K > 1``; Hoffer et al., "Augment your batch: better training with
larger batches", arXiv 1901.09335, as used by DeiT, FixRes and torchvision's reference scripts'
``--ra-sampler --ra-reps``): a global batch holds K differently augmented copies of fewer images.
Our semantics, exactly:

* an epoch keeps its length: N images (the dataset size), hence the same steps per epoch as
  without repetition, so epoch counts of recipes (DeiT, torchvision) carry over;
* epochs are grouped in *cycles* of K consecutive epochs (cycle ``c`` = epochs ``cK .. cK+K-1``).
  A cycle's sample stream is one permutation of the N images, drawn from ``(seed, c)``, with every
  index repeated K times in a row (N x K entries; entry ``q`` is image ``perm[q // K]``, copy
  ``q mod K``); epoch ``e`` takes entries ``[(e mod K) N, (e mod K + 1) N)`` of its cycle's stream;
* so over each full cycle every image appears exactly K times, copies 0 .. K-1 (nothing dropped,
  nothing duplicated beyond its K copies: no truncation of the epoch to a multiple of 256 as DeiT's
  sampler, no padding as FixRes' that repeated the first images). Over a cycle cut short by the end
  of training, images come out at most K times;
* the K copies of an image sit next to each other in the global stream, hence in the same global
  batch (unless cut by a batch or epoch boundary), and, since rank ``r`` takes ``chunk[r::W]`` of
  each global batch, on K different ranks when ``K <= W`` (each rank's BatchNorm sees one copy);
* ``skip`` (resume inside an epoch) and the tail rule act on the epoch's N entries as without
  repetition, and the stream depends only on ``(seed, epoch, K)``, not on the world size: a resume
  on another world size continues the same stream.

With ``K = 1`` a cycle is an epoch and the order is the one drawn without repetition (bit for bit).
Repetition is for training only: evaluation samplers take every image once.

Batches are lists of :class:`SampleKey` ``(index, epoch, copy)``; :class:`fixres_dist.data.pipeline.SeededDataset`
turns a key into an image whose augmentation depends only on (seed, epoch, index, copy), not on the
worker, the rank or where the run started.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from torch.utils.data import Sampler


class SampleKey(NamedTuple):
    """What the sampler hands to the dataset: the dataset index, the epoch it is drawn for, and which
    of the image's repeated-augmentation copies it is (``0 .. reps - 1``; always 0 without repetition)."""

    index: int
    epoch: int
    copy: int = 0


def check_reps(reps) -> int:
    """``reps`` (repeated-augmentation copies per image and cycle) if it is an int >= 1, else ValueError."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps (repeated augmentation copies) must be an integer >= 1, got {reps!r}")
    return reps


def epoch_stream(dataset_size: int, shuffle: bool, seed: int, epoch: int, reps: int = 1) -> torch.Tensor:
    """The ``dataset_size`` samples of ``epoch`` in order: an int64 tensor (N, 2) of (index, copy).

    Shuffled: entries ``[(epoch mod reps) N, (epoch mod reps + 1) N)`` of the stream of cycle
    ``epoch // reps``: a permutation drawn from ``(seed, cycle)`` with every index repeated ``reps``
    times in a row (module notes); ``reps=1`` is the plain permutation of ``(seed, epoch)``.
    Not shuffled: dataset order, copy 0 (``reps`` must be 1).
    """
    check_reps(reps)
    if not shuffle:
        if reps != 1:
            raise ValueError("repeated augmentation (reps > 1) needs a shuffled training sampler")
        order = torch.arange(dataset_size)
        return torch.stack([order, torch.zeros_like(order)], 1)
    cycle, part = divmod(epoch, reps)
    generator = torch.Generator().manual_seed(seed * 100_003 + cycle)
    permutation = torch.randperm(dataset_size, generator=generator)
    if reps == 1:
        return torch.stack([permutation, torch.zeros_like(permutation)], 1)
    position = torch.arange(part * dataset_size, (part + 1) * dataset_size)
    return torch.stack([permutation[position // reps], position % reps], 1)


def global_batch_sizes(remaining: int, world_size: int, batch_size: int, training: bool,
                       global_batch: int | None = None, tail_ranks: int | None = None) -> list[int]:
    """Sizes of the global batches (all ranks together) that ``remaining`` images of an epoch are cut into.

    Full batches of ``global_batch`` images (default ``world_size x batch_size``), then the rest; a
    rest of fewer than ``2 x world_size`` images (``2 x max(world_size, tail_ranks)``: a global batch
    kept from a run on ``tail_ranks`` ranks cuts its epochs as that run did, on as many ranks or fewer)
    is merged into the batch before it, or, in training when there is none, left out (the sizes then
    sum to less than ``remaining``).
    """
    step = global_batch or world_size * batch_size
    sizes = [step] * (remaining // step) + ([remaining % step] if remaining % step else [])
    if sizes and sizes[-1] < 2 * max(world_size, tail_ranks or 0):
        tail = sizes.pop()
        if sizes:
            sizes[-1] += tail
        elif not training:
            sizes.append(tail)
    return sizes


def global_batches(dataset_size: int, world_size: int, batch_size: int, shuffle: bool,
                   seed: int, epoch: int, skip: int = 0, training: bool = False, reps: int = 1,
                   global_batch: int | None = None, tail_ranks: int | None = None) -> list[torch.Tensor]:
    """The epoch's samples (:func:`epoch_stream`), less the first ``skip``, cut into global batches
    of :func:`global_batch_sizes`: int64 tensors (b, 2) of (index, copy).

    The order depends only on ``(seed, epoch, reps)``, not on the world size, so a run resumed on
    another world size continues the same stream: no sample of the epoch is repeated.
    """
    order = epoch_stream(dataset_size, shuffle, seed, epoch, reps)
    sizes = global_batch_sizes(dataset_size - skip, world_size, batch_size, training, global_batch, tail_ranks)
    return list(torch.split(order[skip:skip + sum(sizes)], sizes))


class ExactBatchSampler(Sampler[list[SampleKey]]):
    """Batch sampler for one rank: exact once-per-epoch coverage and equal batch counts.

    Args:
        dataset_size: number of images N.
        world_size, rank: this rank's place (``0 <= rank < world_size``).
        batch_size: images per rank per step (the last step may differ by a few images).
        shuffle: reshuffle every epoch with a generator seeded by ``(seed, epoch)`` (by ``(seed,
            epoch // reps)`` with repetition; the same on all ranks); ``False`` keeps dataset
            order (evaluation).
        seed: base seed shared by all ranks.
        training: every rank gets at least 2 images per step (with ``batch_size >= 2``) and the
            same number of steps; an unsplittable rest after a resume is left out (module notes).
            ``False``: every image exactly once, some ranks may get fewer batches.
        reps: repeated augmentation, K copies of every image per cycle of K epochs (module notes);
            an int >= 1 (ValueError otherwise), above 1 only for a shuffled training sampler.
        global_batch: images per global batch (default ``world_size x batch_size``); a rank's share
            then differs from its peers' by one image at most (a global batch kept on another world
            size: :mod:`fixres_dist.training.world_change`). ``tail_ranks``: the ranks of the run that set
            it, whose rule for the epoch's short last batch is kept (:func:`global_batch_sizes`).
        accumulation: micro-batches per step (``--grad-accum-steps``): the share holds ``accumulation``
            *virtual ranks* of a world ``accumulation`` times larger, one after the other: rank ``r``'s
            micro-batch ``m`` is ``chunk[r + m W :: W x accumulation]``, the images rank ``r + m W`` of
            that world would get, so that 2 ranks accumulating 2 micro-batches see the same BatchNorm
            batches as 4 ranks (and :func:`fixres_dist.training.engine.train_step`'s even cut of the share
            falls on the same boundaries).

    ``len(sampler)`` is this rank's number of batches in the current pass (the same on every rank
    in training). Call :meth:`set_epoch` before each epoch.
    """

    def __init__(self, dataset_size: int, world_size: int, rank: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0, training: bool = False, reps: int = 1,
                 global_batch: int | None = None, accumulation: int = 1, tail_ranks: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if check_reps(reps) > 1 and not (shuffle and training):
            raise ValueError("repeated augmentation (reps > 1) is for shuffled training samplers only")
        self.dataset_size, self.world_size, self.rank = dataset_size, world_size, rank
        self.batch_size, self.shuffle, self.seed, self.training = batch_size, shuffle, seed, training
        self.reps, self.global_batch, self.accumulation, self.tail_ranks = reps, global_batch, accumulation, tail_ranks
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Draw batches for ``epoch``, leaving out its first ``skip`` images (already trained on)."""
        self.epoch, self.skip = epoch, skip

    def global_batch_sizes(self) -> list[int]:
        """Images per global batch (all ranks together) of the current pass."""
        return global_batch_sizes(self.dataset_size - self.skip, self.world_size, self.batch_size, self.training,
                                  self.global_batch, self.tail_ranks)

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
        step = self.global_batch or self.world_size * self.batch_size
        return self.skip + batches_done * step  # all but the last are full

    def __iter__(self) -> Iterator[list[SampleKey]]:
        for chunk in global_batches(self.dataset_size, self.world_size, self.batch_size,
                                    self.shuffle, self.seed, self.epoch, self.skip, self.training, self.reps,
                                    self.global_batch, self.tail_ranks):
            virtual = self.world_size * self.accumulation
            mine = torch.cat([chunk[self.rank + m * self.world_size::virtual]
                              for m in range(self.accumulation)]).tolist()
            if mine:
                yield [SampleKey(index, self.epoch, copy) for index, copy in mine]

    def __len__(self) -> int:
        return sum(1 for size in self.global_batch_sizes() if size > self.rank)
