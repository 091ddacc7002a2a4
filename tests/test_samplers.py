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
