import pytest
import torch

from fixres_dist.samplers import ExactBatchSampler


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
    order = lambda batches: [k.index for b in batches[0] for k in b]
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
from hypothesis import given, settings, strategies as st  # noqa: E402


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
