from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixres_dist.data.samplers import ExactBatchSampler, SampleKey, epoch_stream, global_batches


def epoch_batches(n, world, batch, epoch, shuffle=True, seed=0):
    samplers = [ExactBatchSampler(n, world, r, batch, shuffle=shuffle, seed=seed) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@pytest.mark.parametrize("n", [1, 2, 5, 35, 64, 65, 97, 130, 131])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_each_index_exactly_once_and_equal_batch_counts(n, world, batch):
    samplers, batches = epoch_batches(n, world, batch, epoch=3)
    seen = [key.index for rank in batches for b in rank for key in b]
    assert sorted(seen) == list(range(n))
    if n >= world:
        assert {len(b) for b in batches} == {len(samplers[0])}
    if n >= 2 * world:  # no rank ever trains on a single image (BatchNorm)
        assert min(len(b) for rank in batches for b in rank) >= 2 or batch == 1
    assert all(key.epoch == 3 for rank in batches for b in rank for key in b)


def test_reshuffles_per_epoch_and_agrees_across_ranks():
    _, first = epoch_batches(100, 2, 8, epoch=0)
    _, second = epoch_batches(100, 2, 8, epoch=1)
    _, again = epoch_batches(100, 2, 8, epoch=0)
    def order(batches):
        return [k.index for b in batches[0] for k in b]

    assert order(first) != order(second)
    assert first == again  # deterministic in (seed, epoch): every rank computes the same permutation


def test_evaluation_order_is_dataset_order():
    _, batches = epoch_batches(10, 3, 2, epoch=5, shuffle=False)
    assert [k.index for b in batches[1] for k in b] == [1, 4, 7]


def test_length_matches_iteration():
    for n in range(1, 120):
        for world in (1, 2, 3):
            for batch in (1, 3, 8):
                s = ExactBatchSampler(n, world, 0, batch)
                assert len(s) == len(list(s)) or n < world


# ----------------------------------------------------------------- resume on any world size


@st.composite
def resumed_epochs(draw):
    """A training epoch of N images interrupted after some steps on W0 ranks x B0 images, resumed on W x B."""
    world = draw(st.integers(1, 8))
    size = draw(st.integers(2 * world, 400))  # the Trainer refuses fewer than 2 images per rank
    first_world, first_batch = draw(st.integers(1, 8)), draw(st.integers(2, 64))
    steps_done = draw(st.integers(0, 400))
    first = ExactBatchSampler(size, first_world, 0, first_batch, training=True)
    skip = first.images_done(min(steps_done, len(first))) if size >= 2 * first_world else 0
    return size, world, draw(st.integers(2, 64)), skip, draw(st.integers(0, 5))


@settings(max_examples=400, deadline=None)
@given(resumed_epochs())
def test_a_resumed_training_epoch_never_gives_a_rank_one_image_or_an_extra_step(case):
    size, world, batch, skip, epoch = case
    samplers = [ExactBatchSampler(size, world, r, batch, training=True, seed=7) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch, skip=skip)
    batches = [list(s) for s in samplers]
    steps = {len(b) for b in batches}
    assert steps == {len(samplers[0])}, "every rank takes the same number of steps"
    assert all(len(b) >= 2 for rank in batches for b in rank), "no rank ever trains on fewer than 2 images"
    seen = [key.index for rank in batches for b in rank for key in b]
    assert len(seen) == len(set(seen)), "no image twice"
    order = torch.randperm(size, generator=torch.Generator().manual_seed(7 * 100_003 + epoch)).tolist()
    left = order[skip:]
    assert sorted(seen) == sorted(left[:len(seen)]), "the epoch's permutation continues where it stopped"
    left_out = samplers[0].left_out
    assert len(seen) + left_out == size - skip
    assert left_out == 0 or (left_out < 2 * world and not seen), "only an unsplittable rest is left out"
    assert samplers[0].images_done(len(samplers[0])) == size


def test_one_rank_checkpoint_with_two_images_left_resumed_on_three_ranks():
    samplers = [ExactBatchSampler(80, 3, r, 8, training=True) for r in range(3)]
    for s in samplers:
        s.set_epoch(0, skip=78)
    assert [list(s) for s in samplers] == [[], [], []] and samplers[0].left_out == 2


# ----------------------------------------------------------------- repeated augmentation


def ra_epoch(n, world, batch, epoch, reps, skip=0, seed=5):
    """Every rank's batches of one training epoch with ``reps`` copies per cycle."""
    samplers = [ExactBatchSampler(n, world, r, batch, training=True, seed=seed, reps=reps) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch, skip=skip)
    return samplers, [list(s) for s in samplers]


def global_stream(batches):
    """The global order of the keys that the ranks' batches came from (rank r took chunk[r::W])."""
    world, stream = len(batches), []
    for step in zip(*batches):
        chunk = [None] * sum(len(b) for b in step)
        for rank, keys in enumerate(step):
            chunk[rank::world] = keys
        stream.extend(chunk)
    return stream


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("world,batch,epoch,skip", [(1, 8, 0, 0), (3, 4, 2, 0), (4, 16, 7, 33), (2, 3, 1, 95)])
def test_one_rep_is_the_order_without_repetition_bit_for_bit(training, world, batch, epoch, skip):
    n, seed = 100, 11
    before = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    for chunks in (global_batches(n, world, batch, True, seed, epoch, skip, training),
                   global_batches(n, world, batch, True, seed, epoch, skip, training, reps=1)):
        flat = torch.cat(chunks)
        assert flat.dtype == torch.int64 and (flat[:, 1] == 0).all()
        assert torch.equal(flat[:, 0], before[skip:skip + len(flat)])
    for rank in range(world):
        default = ExactBatchSampler(n, world, rank, batch, seed=seed, training=training)
        explicit = ExactBatchSampler(n, world, rank, batch, seed=seed, training=training, reps=1)
        default.set_epoch(epoch, skip), explicit.set_epoch(epoch, skip)
        assert list(default) == list(explicit)
        assert all(key == (key.index, key.epoch) + (0,) for b in default for key in b)


@pytest.mark.parametrize("n,world,batch,reps", [(37, 2, 4, 2), (100, 4, 8, 3), (64, 8, 2, 4), (50, 2, 7, 5),
                                                (9, 1, 4, 3), (130, 3, 16, 2)])
def test_every_image_exactly_reps_times_per_cycle_with_each_copy_once(n, world, batch, reps):
    for cycle in (0, 3):
        keys = []
        for epoch in range(cycle * reps, (cycle + 1) * reps):
            samplers, batches = ra_epoch(n, world, batch, epoch, reps)
            assert {len(b) for b in batches} == {len(samplers[0])}, "every rank takes the same steps"
            assert samplers[0].left_out == 0 and samplers[0].images_done(len(samplers[0])) == n
            epoch_keys = [key for rank in batches for b in rank for key in b]
            assert len(epoch_keys) == n and {key.epoch for key in epoch_keys} == {epoch}, "an epoch keeps its length"
            keys += epoch_keys
        assert Counter(key.index for key in keys) == {i: reps for i in range(n)}
        assert sorted((key.index, key.copy) for key in keys) == [(i, c) for i in range(n) for c in range(reps)]


def test_cycle_stream_is_one_permutation_with_each_index_repeated_in_a_row():
    n, reps, seed, cycle = 23, 3, 4, 2
    stream = torch.cat([epoch_stream(n, True, seed, cycle * reps + part, reps) for part in range(reps)])
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + cycle))
    assert torch.equal(stream[:, 0], permutation.repeat_interleave(reps))
    assert torch.equal(stream[:, 1], torch.arange(reps).repeat(n))
    assert not torch.equal(epoch_stream(n, True, seed, 0, reps), epoch_stream(n, True, seed, reps, reps))


@pytest.mark.parametrize("world,reps", [(2, 2), (4, 3), (4, 4), (8, 3)])
def test_copies_of_an_image_go_to_distinct_ranks_of_one_global_batch(world, reps):
    n, batch = 200, 6
    for epoch in range(reps):
        _, batches = ra_epoch(n, world, batch, epoch, reps)
        for step in zip(*batches):
            ranks = {}
            for rank, keys in enumerate(step):
                for key in keys:
                    ranks.setdefault(key.index, []).append(rank)
            assert all(len(set(r)) == len(r) for r in ranks.values()), "two copies of an image on one rank"
        # apart from runs cut at a batch or epoch boundary, the K copies share a global batch
        together = sum(1 for step in zip(*batches) for index, count in
                       Counter(key.index for keys in step for key in keys).items() if count == reps)
        assert together >= n // reps - 2 - (len(batches[0]) - 1)


@st.composite
def resumed_ra_epochs(draw):
    """An RA training epoch interrupted after some steps on W0 ranks x B0 images, resumed on W x B."""
    world, reps = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    size = draw(st.integers(2 * world, 300))
    first_world, first_batch = draw(st.integers(1, 8)), draw(st.integers(2, 32))
    first = ExactBatchSampler(size, first_world, 0, first_batch, training=True, reps=reps)
    steps_done = draw(st.integers(0, len(first)))
    skip = first.images_done(steps_done) if size >= 2 * first_world else 0
    return size, world, draw(st.integers(2, 32)), skip, draw(st.integers(0, 9)), reps, first_world, first_batch


@settings(max_examples=300, deadline=None)
@given(resumed_ra_epochs())
def test_a_resumed_ra_epoch_gives_exactly_the_rest_of_the_same_stream(case):
    size, world, batch, skip, epoch, reps, first_world, first_batch = case
    samplers, batches = ra_epoch(size, world, batch, epoch, reps, skip=skip, seed=3)
    assert {len(b) for b in batches} == {len(samplers[0])}, "every rank takes the same number of steps"
    assert all(len(b) >= 2 for rank in batches for b in rank)
    expected = [SampleKey(i, epoch, c) for i, c in epoch_stream(size, True, 3, epoch, reps).tolist()]
    resumed = global_stream(batches)
    assert resumed == expected[skip:skip + len(resumed)], "the stream continues where it stopped"
    assert len(resumed) + samplers[0].left_out == size - skip
    # the interrupted run's first steps and the resumed run together are the whole epoch, once
    _, first = ra_epoch(size, first_world, first_batch, epoch, reps, seed=3)
    done = global_stream(first)[:skip]
    assert done + resumed == expected[:len(done) + len(resumed)]


def test_reps_is_validated():
    for bad in (0, -1, 1.0, 2.5, "2", True, None):
        with pytest.raises(ValueError, match="reps"):
            ExactBatchSampler(10, 1, 0, 2, training=True, reps=bad)
    with pytest.raises(ValueError, match="training"):
        ExactBatchSampler(10, 1, 0, 2, shuffle=False, training=True, reps=2)
    with pytest.raises(ValueError, match="training"):
        ExactBatchSampler(10, 1, 0, 2, training=False, reps=2)
    with pytest.raises(ValueError, match="reps"):
        epoch_stream(10, True, 0, 0, reps=0)


def _shares(n, world, batch, skip=0, **options):
    """Every rank's batches of epoch 1 (from image ``skip``) as lists of indices."""
    samplers = [ExactBatchSampler(n, world, r, batch, seed=3, training=True, **options) for r in range(world)]
    for s in samplers:
        s.set_epoch(1, skip)
    return samplers, [[[key.index for key in b] for b in s] for s in samplers]


@pytest.mark.parametrize("n, skip", [(80, 0), (77, 0), (77, 13), (131, 40)])
def test_accumulated_micro_batches_are_the_images_of_the_ranks_of_a_larger_world(n, skip):
    """2 ranks accumulating 2 micro-batches of 8: rank r's share, cut in 2 as the train step cuts it
    (``tensor_split``), holds the batches ranks r and r + 2 of 4 ranks of 8 get, the uneven last one too."""
    _, four = _shares(n, 4, 8, skip)
    _, two = _shares(n, 2, 16, skip, accumulation=2)
    for rank in range(2):
        assert len(two[rank]) == len(four[rank])
        for step, share in enumerate(two[rank]):
            micro = [part.tolist() for part in torch.tensor(share).tensor_split(2)]
            assert micro == [four[rank][step], four[rank + 2][step]], (rank, step)


@pytest.mark.parametrize("n, world, global_batch, skip", [(80, 3, 32, 0), (80, 3, 16, 21), (97, 7, 64, 5),
                                                          (64, 5, 12, 0)])
def test_a_global_batch_kept_on_a_world_that_does_not_divide_it(n, world, global_batch, skip):
    """Every image of the epoch's rest exactly once, the same steps on every rank, each step's shares
    differing by one image at most and summing to the global batch (but the merged last)."""
    samplers, shares = _shares(n, world, -(-global_batch // world), skip, global_batch=global_batch)
    seen = [i for rank in shares for b in rank for i in b]
    assert sorted(seen) == sorted(epoch_stream(n, True, 3, 1)[skip:, 0].tolist())
    assert len({len(rank) for rank in shares}) == 1
    sizes = samplers[0].global_batch_sizes()
    for step in range(len(shares[0])):
        share = [len(rank[step]) for rank in shares]
        assert max(share) - min(share) <= 1 and sum(share) == sizes[step]
        assert sizes[step] == global_batch or step == len(sizes) - 1
    assert samplers[0].images_done(1) == skip + global_batch


def test_a_kept_global_batch_cuts_its_epochs_as_the_ranks_that_set_it():
    """26 images a step on 2 ranks cut 80 as 26, 26, 28 (a rest of 2, fewer than 2 per rank, merged);
    on 1 rank with the rule of the 2 that set the global batch, the same: the same steps, the same schedule."""
    two = ExactBatchSampler(80, 2, 0, 13, training=True)
    one = ExactBatchSampler(80, 1, 0, 26, training=True, global_batch=26, accumulation=2, tail_ranks=2)
    assert two.global_batch_sizes() == one.global_batch_sizes() == [26, 26, 28]
    assert ExactBatchSampler(80, 1, 0, 26, training=True, global_batch=26).global_batch_sizes() == [26, 26, 26, 2]
