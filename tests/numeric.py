"""How close two float32 computations of the same numbers must be: derived, not tuned on one machine.

torch picks its CPU kernels by the instruction set (``ATEN_CPU_CAPABILITY=default|avx2|avx512``; oneDNN's
convolutions by ``ONEDNN_MAX_CPU_ISA``), and the vector width decides the order in which a sum is added
up: float32 results differ from one CPU to another in their last bits, and by more once training steps
have amplified them. A tolerance tuned on one machine's kernels fails on another's. The tests compare
numbers in one of two ways (the ``numeric`` mark, pytest.ini; ``.ci/run`` reruns those tests under
another kernel set):

* **Bit-identity**, where it is promised (a resumed run and the run never stopped, the same computation
  run twice, an evaluation of the same images in the same batch shapes): ``==`` / ``torch.equal``. Both
  sides run the same kernels on the same shapes in the same process setup, so it holds on any CPU.
* **Two different computations of one mathematical result** (a model split into pipeline stages,
  tensor groups or shards against DDP; BatchNorm over ranks against one process on the union;
  micro-batches against the whole batch; channels-last against not): they round differently, and the
  bound on how differently is measured on the kernels at hand, in one of two ways:

  1. :func:`assert_near_reference`: the computation repeated in float64 (``reference``: exact to about
     1e-16, the mathematical result as far as float32 can tell) gives each float32 side its own error.
     The candidate's error must be at most :data:`FACTOR` times the float32 baseline's (the unsplit
     model, one process, the whole batch): both are float32 rounding of the same sums in different
     orders, amplified by the same steps, so they are of one size, whatever the kernels.
  2. :func:`assert_within_spread`: where no float64 run exists (whole jobs run by the scripts), the
     baseline job run a second time in another summation order (``other``: the same job with the other
     memory format, ``--channels-last``, whose convolutions add up in another order, and every later
     operation on their outputs with them) measures how far rounding alone moves the baseline; the
     candidate must be within :data:`FACTOR` times that distance of it.

  Both compare norm-wise, per tensor (``||x||_2`` over its elements), so that one element's chance
  cancellation does not decide. ``scale`` (the baseline's error, or the spread) has a floor: ``rho``
  times the tensor's norm, where ``rho`` is the relative scale of the whole set compared (all its
  tensors together) and at least :data:`U`, float32's unit roundoff (no float32 result is nearer to
  a number than its own rounding). That covers a tensor whose baseline happens to round almost exactly,
  or whose two orders happen to agree; a tensor that is exactly or nearly zero (a bias that starts at
  zero, a gradient that cancels) is measured as if its elements had the set's root-mean-square size,
  since its rounding comes from sums of terms of that size.

:data:`FACTOR` is 10: an order of magnitude above the rounding measured, where a correct candidate's
ratio is about 1 (at most 2.5 on the AVX-512, AVX2 and SSE4.1 kernel sets: docs/testing.md;
``FIXRES_NUMERIC_MARGINS=FILE`` makes every comparison append its worst ratio to FILE), and well below
what a defect does: a lost micro-batch or a wrong average moves the numbers by percents, and even a
learning rate off by 1e-5 of itself gives a ratio above 30 (:mod:`test_numeric`), where the tolerances
these comparisons replaced (rtol 1e-5 to 1e-4) let it pass.

Top-1 and top-5 are counts, compared exactly: :func:`assert_settled_ranking` checks that they can be,
that no image's ranking of classes is within rounding of changing.
"""
from __future__ import annotations

import copy
import json
import math
import os
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from fixres_dist.data import pipeline
from fixres_dist.models import preprocessing

U = 2.0 ** -24  # float32's unit roundoff: a float32 result is at best this far (relatively) from the number
FACTOR = 10.0  # how far above the measured rounding a candidate may be (see the module's docstring)
MARGINS = "FIXRES_NUMERIC_MARGINS"  # a file: every comparison appends its worst ratio to it (a JSON line)

Tensors = Mapping[str, "torch.Tensor | Sequence[float] | float"]


def as_float64(value) -> torch.Tensor:
    """A tensor, a list of numbers or a number as a float64 tensor (a copy: the caller's is untouched)."""
    return torch.as_tensor(value).detach().to(torch.float64).flatten().clone()


def floating(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point entries of a state_dict (not BatchNorm's ``num_batches_tracked``)."""
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}


def assert_near_reference(candidate: Tensors, baseline: Tensors, reference: Tensors, what: str) -> float:
    """Each tensor of ``candidate`` (float32, computed one way) is within :data:`FACTOR` times the error of
    ``baseline`` (float32, computed the plain way) from ``reference`` (the plain way in float64), norm-wise.
    The three map the same names; returns the worst ratio (the candidate's error over the allowed scale,
    :data:`FACTOR` excluded)."""
    names = _same_names(candidate, baseline, reference, what)
    ref = {n: as_float64(reference[n]) for n in names}
    deviation = {n: (as_float64(candidate[n]) - ref[n]).norm().item() for n in names}
    scale = {n: (as_float64(baseline[n]) - ref[n]).norm().item() for n in names}
    return _check(what, ref, deviation, scale, "the float32 baseline's error from float64")


def assert_within_spread(candidate: Tensors, baseline: Tensors, other: Tensors, what: str) -> float:
    """Each tensor of ``candidate`` is within :data:`FACTOR` times the spread of the same computation
    in two summation orders (``baseline`` and ``other``) from ``baseline``, norm-wise. Returns the worst
    ratio (:data:`FACTOR` excluded)."""
    names = _same_names(candidate, baseline, other, what)
    base = {n: as_float64(baseline[n]) for n in names}
    deviation = {n: (as_float64(candidate[n]) - base[n]).norm().item() for n in names}
    scale = {n: (as_float64(other[n]) - base[n]).norm().item() for n in names}
    return _check(what, base, deviation, scale, "the spread of the baseline in two summation orders")


def assert_settled_ranking(logits64: torch.Tensor, logits32: torch.Tensor, what: str, ks: Sequence[int] = (1, 5)):
    """No image's top-k (k in ``ks``) could change under a float32 evaluation whose logits err up to
    :data:`FACTOR` times ``logits32``'s error from ``logits64`` (float64, the same images): for each image,
    the gap between its k-th and (k+1)-th largest float64 logits exceeds twice that. Then top-1 and top-5
    hits of any such evaluation are the reference's, and counts compare exactly. Fails, naming the image,
    where the data hold a near tie (choose other images then: no count is exact there)."""
    logits64, logits32 = logits64.to(torch.float64), logits32.to(torch.float64)
    error = FACTOR * max((logits32 - logits64).abs().max().item(), U * logits64.abs().max().item())
    ranked = logits64.sort(dim=1, descending=True).values
    for k in ks:
        if k >= logits64.shape[1]:
            continue
        gaps = ranked[:, k - 1] - ranked[:, k]
        image = int(gaps.argmin())
        assert gaps[image] > 2 * error, f"{what}: image {image}'s top-{k} is within float32 rounding of changing " \
            f"(gap {gaps[image]:.3g} between its logits {k} and {k + 1}, rounding up to {error:.3g})"


def evaluation(model: torch.nn.Module, architecture: str, data, split: str, size: int, dtype: torch.dtype,
               head: str | None = None) -> dict:
    """``model`` (a copy in ``dtype``, in eval mode) on every image of ``data``'s ``split`` at ``size`` px,
    preprocessed as the jobs evaluate (the architecture's test transform and normalisation, float32
    inputs), in one batch: ``logits``, ``embeddings`` (the input of module ``head``, when named), the
    mean cross-entropy ``loss`` and the ``top1``/``top5`` hits in percent, as metrics.jsonl's. In float32:
    a baseline; in float64: the reference of :func:`assert_near_reference`."""
    prep = preprocessing.architecture_preprocessing(architecture)
    folder = pipeline.image_folder(data, split)
    transform = pipeline.test_transform(size, prep.crop_ratio, prep.interpolation)
    images = torch.stack([transform(folder[i][0]) for i in range(len(folder))])
    labels = torch.tensor(folder.targets)
    model = copy.deepcopy(model).to(dtype).eval()
    captured = {}
    if head is not None:
        dict(model.named_modules())[head].register_forward_hook(
            lambda module, args, out: captured.__setitem__("embeddings", args[0].flatten(1)))
    with torch.no_grad():
        logits = model(pipeline.normalize(images, prep.normalization).to(dtype))
    top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(labels[:, None])
    return {"logits": logits, **captured, "loss": F.cross_entropy(logits, labels).item(),
            "top1": 100 * top5[:, 0].sum().item() / len(labels), "top5": 100 * top5.any(1).sum().item() / len(labels)}


def _same_names(a: Tensors, b: Tensors, c: Tensors, what: str) -> list[str]:
    assert a.keys() == b.keys() == c.keys(), f"{what}: not the same tensors: {sorted(set(a) ^ set(b) | set(c))}"
    assert a, f"{what}: nothing to compare"
    for name in a:
        shapes = {tuple(torch.as_tensor(x[name]).shape) for x in (a, b, c)}
        assert len(shapes) == 1, f"{what}: {name} has shapes {shapes}"
    return list(a)


def _check(what: str, values: dict[str, torch.Tensor], deviation: dict[str, float], scale: dict[str, float],
           measured: str) -> float:
    """The common rule of both comparisons (the module's docstring): per tensor, ``deviation`` <= FACTOR x
    max(``scale``, rho x its size), with rho the whole set's relative scale (at least U)."""
    for name in values:
        assert math.isfinite(deviation[name]) and math.isfinite(scale[name]), f"{what}: {name} is not finite"
    norms = {n: v.norm().item() for n, v in values.items()}
    total = math.sqrt(sum(x * x for x in norms.values()))
    elements = sum(v.numel() for v in values.values())
    rho = max(U, math.sqrt(sum(s * s for s in scale.values())) / total if total else U)
    rms = total / math.sqrt(elements)  # an element's typical size in this set
    ratios = {}
    for name, value in values.items():
        size = max(norms[name], rms * math.sqrt(value.numel()))  # a zero tensor: elements of the set's size
        allowed = max(scale[name], rho * size)
        ratios[name] = deviation[name] / allowed if allowed else (0.0 if deviation[name] == 0 else math.inf)
    worst = max(ratios, key=ratios.get)
    _record(what, worst, ratios[worst])
    bad = {n: r for n, r in ratios.items() if r > FACTOR}
    assert not bad, f"{what}: {len(bad)} of {len(values)} differ by more than {FACTOR:g} x {measured} " \
        f"(or x {rho:.3g} of their size): " + ", ".join(
            f"{n} ({r:.3g} x: {deviation[n]:.3g} against {scale[n]:.3g})" for n, r in sorted(bad.items())[:5])
    return ratios[worst]


def _record(what: str, name: str, ratio: float) -> None:
    """Appends the comparison's worst ratio to the file named by :data:`MARGINS`, when set."""
    path = os.environ.get(MARGINS)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "what": what,
                                  "worst": name, "ratio": ratio, "kernels": torch.backends.cpu.get_cpu_capability(),
                                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}) + "\n")
