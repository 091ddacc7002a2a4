"""The derived float comparisons of tests/numeric.py: what rounding alone does passes, a defect far
smaller than the tolerances they replaced (rtol 1e-5 to 1e-4) fails."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from numeric import FACTOR, assert_near_reference, assert_settled_ranking, assert_within_spread


def _steps(dtype, micro_batches=1, lr=0.1) -> dict[str, torch.Tensor]:
    """3 SGD steps of a 2-layer MLP on 16 images, the gradient of each step summed over ``micro_batches``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=generator).to(dtype), torch.randint(0, 10, (16,), generator=generator)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (nn.functional.cross_entropy(model(xs), ys, reduction="sum") / 16).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.numeric
def test_another_summation_order_passes_and_a_defect_fails_against_float64():
    baseline, reference = _steps(torch.float32), _steps(torch.float64)
    for micro_batches in (2, 4, 8):  # the same steps summed in other groups: rounding only
        assert assert_near_reference(_steps(torch.float32, micro_batches), baseline, reference, "micro-batches") \
            <= FACTOR
    with pytest.raises(AssertionError, match=r"differ by more than 10 x the float32 baseline's error"):
        assert_near_reference(_steps(torch.float32, 4, lr=0.1 * (1 + 1e-5)), baseline, reference, "lr 1e-5 off")
    lost = _steps(torch.float32, 4)
    lost["2.bias"] = lost["2.bias"] * (1 + 1e-5)  # one tensor off by 1e-5 of its size
    with pytest.raises(AssertionError, match=r"1 of 4 differ .*2\.bias"):
        assert_near_reference(lost, baseline, reference, "one tensor off")


@pytest.mark.numeric
def test_the_spread_of_two_orders_bounds_a_third_and_not_a_defect():
    baseline, other = _steps(torch.float32), _steps(torch.float32, 8)
    assert assert_within_spread(_steps(torch.float32, 4), baseline, other, "micro-batches") <= FACTOR
    with pytest.raises(AssertionError, match=r"the spread of the baseline in two summation orders"):
        assert_within_spread(_steps(torch.float32, 4, lr=0.1 * (1 + 1e-5)), baseline, other, "lr 1e-5 off")
    # two orders that happen to agree exactly: the floor is float32's own rounding, not zero
    same = {"w": torch.ones(1000)}
    assert assert_within_spread({"w": torch.ones(1000) * (1 + 2 ** -23)}, same, same, "1 ulp") <= FACTOR
    with pytest.raises(AssertionError):
        assert_within_spread({"w": torch.ones(1000) * (1 + 1e-5)}, same, same, "1e-5 off")


@pytest.mark.numeric
def test_a_zero_tensor_is_measured_at_the_size_of_its_set():
    """A tensor that is exactly zero in the reference and the baseline (a gradient that cancels) may
    carry the set's rounding, not more."""
    reference = {"w": torch.linspace(-1, 1, 100, dtype=torch.float64), "zero": torch.zeros(10, dtype=torch.float64)}
    baseline = {"w": reference["w"].float() * (1 + 2 ** -23), "zero": torch.zeros(10)}
    assert assert_near_reference({"w": baseline["w"], "zero": torch.full((10,), 1e-7)}, baseline, reference,
                                 "rounding") <= FACTOR
    with pytest.raises(AssertionError, match="zero"):
        assert_near_reference({"w": baseline["w"], "zero": torch.full((10,), 1e-4)}, baseline, reference, "defect")


@pytest.mark.numeric
def test_counts_are_exact_only_where_no_image_is_near_a_tie():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]], dtype=torch.float64)
    assert_settled_ranking(logits, logits.float(), "clear", ks=(1, 2))
    tied = logits.clone()
    tied[1, 2] = 2.0 - 1e-9
    with pytest.raises(AssertionError, match="image 1's top-1 is within float32 rounding of changing"):
        assert_settled_ranking(tied, tied.float(), "a near tie", ks=(1,))
