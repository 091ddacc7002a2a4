"""Build the embedded Fashion-MNIST subset shipped inside the package.

Source: Debian's ``dataset-fashion-mnist`` package (``apt-get install dataset-fashion-mnist``),
which installs the original IDX files of Xiao, Rasul and Vollgraf, "Fashion-MNIST: a Novel Image
Dataset for Benchmarking Machine Learning Algorithms" (arXiv 1708.07747), MIT licence, Zalando SE.

Output: ``fixres_dist/embedded_data/fashion_mnist/{train,val}/<class>/<index>.png`` (28 x 28 grey
PNG, ImageFolder layout) plus the licence notice. Train images come from the first images of each
class in the official training split, validation images from the official test split, so the two
never overlap. Deterministic: running it twice writes the same bytes.

With ``--canvas 48`` the garments are instead composed at random scales (45-100 % of the side) and
positions on a black 48 x 48 canvas (:mod:`fixres_dist.data.canvas`; train images drawn with seed 1, val
images with seed 2, each by its index in the official split): the embedded
``fashion_mnist_canvas`` dataset of the demo, objects at varied scales as in photos.

Usage: ``python scripts/make_embedded_dataset.py [--source DIR] [--train-per-class 300]
[--val-per-class 100] [--canvas PIXELS] [--out DIR]``

The shipped sets: ``fashion_mnist`` (defaults: 300 + 100 per class) and ``fashion_mnist_canvas``
(``--canvas 48 --train-per-class 1000 --val-per-class 200 --out fixres_dist/embedded_data/fashion_mnist_canvas``).
"""
import argparse
import gzip
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixres_dist.data.canvas import compose

CLASSES = ["0_tshirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat",
           "5_sandal", "6_shirt", "7_sneaker", "8_bag", "9_ankle_boot"]
LICENSE = """Fashion-MNIST subset (images selected and converted to PNG by scripts/make_embedded_dataset.py)

Source: Xiao, Rasul, Vollgraf, "Fashion-MNIST: a Novel Image Dataset for Benchmarking Machine
Learning Algorithms", arXiv 1708.07747; distributed by Debian as package dataset-fashion-mnist.

The MIT License (MIT)

Copyright (c) 2017 Zalando SE, https://tech.zalando.com

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES
OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN
CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (gzip) into a uint8 array: images (N, 28, 28) or labels (N,)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def write_split(images, labels, per_class, out: Path, canvas: int | None = None, seed: int = 0) -> int:
    """The first ``per_class`` images of each class as PNGs; composed on a ``canvas`` px canvas if given."""
    count = 0
    for label, name in enumerate(CLASSES):
        folder = out / name
        folder.mkdir(parents=True)
        for index in np.flatnonzero(labels == label)[:per_class]:
            image = images[index] if canvas is None else compose(images[index], int(index), seed, canvas)
            Image.fromarray(image, mode="L").save(folder / f"{index:05d}.png", optimize=True)
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "fixres_dist" / "embedded_data" / "fashion_mnist")
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("--canvas", type=int, help="compose each garment on a canvas of this side (pixels)")
    args = parser.parse_args()
    if not (args.source / "train-images-idx3-ubyte.gz").exists():
        sys.exit(f"error: no Fashion-MNIST IDX files in {args.source} (apt-get install dataset-fashion-mnist)")
    if args.out.exists():
        shutil.rmtree(args.out)
    n_train = write_split(read_idx(args.source / "train-images-idx3-ubyte.gz"),
                          read_idx(args.source / "train-labels-idx1-ubyte.gz"), args.train_per_class,
                          args.out / "train", args.canvas, seed=1)
    n_val = write_split(read_idx(args.source / "t10k-images-idx3-ubyte.gz"),
                        read_idx(args.source / "t10k-labels-idx1-ubyte.gz"), args.val_per_class, args.out / "val",
                        args.canvas, seed=2)
    (args.out / "LICENSE").write_text(LICENSE)
    print(f"wrote {n_train} train and {n_val} val images to {args.out}")


if __name__ == "__main__":
    main()
