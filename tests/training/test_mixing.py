"""Batch MixUp / CutMix (fixres_dist.training.mixing): drawn from (seed, key) only, targets that match the images."""
from __future__ import annotations

import math

import pytest
import torch

from fixres_dist.training.mixing import BatchMixing

CLASSES = 10


def batch(size=6, height=12, width=16, seed=0, device="cpu"):
    """Normalised-looking float images, every pixel distinct from its neighbour's, and distinct labels."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 3, height, width, generator=generator)
    labels = torch.randperm(CLASSES, generator=generator)[:size]
    return images.to(device), labels.to(device)


def lam_of(targets, labels):
    """Each row's weight of its own label and of its rolled partner's (labels are distinct)."""
    rows = torch.arange(len(labels))
    return targets[rows, labels], targets[rows, labels.roll(1, 0)]


def pasted(images, mixed):
    """Where the mixed batch took its partner's pixels: a (B, H, W) mask."""
    return (mixed != images).any(1)


def test_same_key_same_draw_other_key_other_draw():
    mix = BatchMixing(0.8, 1.0, CLASSES, seed=3)
    images, labels = batch()
    first = mix(images, labels, (5, 1, 0))
    again = mix(images.clone(), labels.clone(), (5, 1, 0))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert torch.equal(BatchMixing(0.8, 1.0, CLASSES, seed=3)(images, labels, (5, 1, 0))[1], first[1])
    others = [mix(images, labels, key)[1] for key in [(5, 1, 1), (5, 0, 0), (6, 1, 0), (0, 0, 0)]]
    assert all(not torch.equal(first[1], other) for other in others)
    assert not torch.equal(BatchMixing(0.8, 1.0, CLASSES, seed=4)(images, labels, (5, 1, 0))[1], first[1])


def test_leaves_the_global_generator_as_it_was():
    mix = BatchMixing(0.8, 1.0, CLASSES, seed=0)
    images, labels = batch()
    torch.manual_seed(42)
    state = torch.get_rng_state()
    for step in range(5):
        mix(images, labels, (step, 0, 0))
    assert torch.equal(torch.get_rng_state(), state)


def test_mixup_mixes_images_and_labels_by_the_same_lambda():
    mix = BatchMixing(0.4, 0.0, CLASSES, seed=1)
    images, labels = batch()
    lams = []
    for step in range(20):
        mixed, targets = mix(images, labels, (step,))
        assert targets.dtype == torch.float32 and targets.shape == (len(labels), CLASSES)
        own, partner = lam_of(targets, labels)
        lam = own[0].item()
        assert torch.allclose(own, torch.full_like(own, lam)) and torch.allclose(partner, 1 - own)
        assert torch.allclose(targets.sum(1), torch.ones(len(labels)))
        assert torch.allclose(mixed, lam * images + (1 - lam) * images.roll(1, 0), atol=1e-6)
        lams.append(lam)
    assert len(set(lams)) == len(lams) and 0 < min(lams) and max(lams) < 1


def test_cutmix_pastes_one_box_whose_area_is_the_partners_weight():
    mix = BatchMixing(0.0, 1.0, CLASSES, seed=2)
    images, labels = batch()
    for step in range(20):
        mixed, targets = mix(images, labels, (step, 3))
        mask = pasted(images, mixed)
        assert (mask == mask[0]).all(), "the same box in every image"
        box = mask[0]
        if box.any():
            rows, cols = box.any(1).nonzero().flatten(), box.any(0).nonzero().flatten()
            assert box[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all(), "a box"
        assert torch.equal(mixed[:, :, box], images.roll(1, 0)[:, :, box]), "pasted from the partner"
        own, partner = lam_of(targets, labels)
        assert torch.allclose(partner, torch.full_like(partner, box.float().mean().item()))
        assert torch.allclose(own + partner, torch.ones(len(labels)))


def test_both_alphas_choose_each_with_even_odds():
    mix = BatchMixing(0.8, 1.0, CLASSES, seed=5)
    images, labels = batch()
    cutmix = 0
    for step in range(200):
        mixed, targets = mix(images, labels, (step, 0, 0))
        assert torch.allclose(targets.sum(1), torch.ones(len(labels)))
        mask = pasted(images, mixed)
        if not mask.all():  # MixUp changes every pixel (lam < 1); CutMix only its box
            cutmix += 1
    assert 70 <= cutmix <= 130  # binomial(200, 1/2): 5 standard deviations either side


def test_off_when_both_alphas_are_zero():
    mix = BatchMixing(0.0, 0.0, CLASSES, seed=0)
    assert not mix.enabled and BatchMixing(0.1, 0, CLASSES, 0).enabled and BatchMixing(0, 0.1, CLASSES, 0).enabled
    images, labels = batch()
    same, targets = mix(images, labels, (0,))
    assert same is images and torch.equal(targets, torch.nn.functional.one_hot(labels, CLASSES).float())


def test_soft_targets_work_with_label_smoothing_and_bf16_images():
    mix = BatchMixing(0.8, 1.0, CLASSES, seed=0)
    images, labels = batch()
    mixed, targets = mix(images.bfloat16(), labels, (1, 2, 3))
    assert mixed.dtype == torch.bfloat16 and targets.dtype == torch.float32
    loss = torch.nn.functional.cross_entropy(torch.zeros(len(labels), CLASSES), targets, label_smoothing=0.1)
    assert math.isclose(loss.item(), math.log(CLASSES), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"mixup_alpha": -0.1}, "mixup alpha must be a finite number >= 0"),
    ({"cutmix_alpha": -1}, "cutmix alpha must be a finite number >= 0"),
    ({"mixup_alpha": math.nan}, "mixup alpha"), ({"cutmix_alpha": math.inf}, "cutmix alpha"),
    ({"mixup_alpha": "0.8"}, "mixup alpha"), ({"num_classes": 0}, "num_classes"), ({"seed": -1}, "seed"),
])
def test_bad_settings_are_value_errors(kwargs, match):
    settings = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "num_classes": CLASSES, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        BatchMixing(**settings)


def test_bad_calls_are_value_errors():
    mix = BatchMixing(0.8, 1.0, CLASSES, seed=0)
    images, labels = batch()
    with pytest.raises(ValueError, match="key"):
        mix(images, labels, (0, -1))
    with pytest.raises(ValueError, match="float"):
        mix(images.to(torch.uint8), labels, (0,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_cuda_batches_draw_only_from_the_cpu_generator_and_match_the_cpu_draw():
    mix = BatchMixing(0.8, 1.0, CLASSES, seed=7)
    images, labels = batch()
    cuda_state = torch.cuda.get_rng_state()
    for step in range(10):
        on_cpu = mix(images, labels, (step, 1))
        on_gpu = mix(images.cuda(), labels.cuda(), (step, 1))
        assert on_gpu[0].is_cuda and on_gpu[1].is_cuda
        assert torch.allclose(on_gpu[0].cpu(), on_cpu[0], atol=1e-5) and torch.allclose(on_gpu[1].cpu(), on_cpu[1])
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
