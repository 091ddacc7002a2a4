"""The scale-varied canvas data: deterministic composition, object sizes in range, the shipped set."""
import gzip
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fixres_dist.data import canvas, pipeline

SOURCE = Path("/usr/share/datasets/fashion-mnist")


def garment() -> np.ndarray:
    """A 28 x 28 grey 'garment' with a non-zero border, so its footprint on the canvas is measurable."""
    image = np.full((28, 28), 200, dtype=np.uint8)
    image[10:18, 10:18] = 50
    return image


def test_compose_is_deterministic_per_seed_and_index():
    a = canvas.compose(garment(), index=7, seed=1)
    assert a.shape == (48, 48) and a.dtype == np.uint8
    assert np.array_equal(a, canvas.compose(garment(), index=7, seed=1))
    assert not np.array_equal(a, canvas.compose(garment(), index=8, seed=1))
    assert not np.array_equal(a, canvas.compose(garment(), index=7, seed=2))
    batch = canvas.compose_all(np.stack([garment()] * 3), seed=1, first_index=6)
    assert np.array_equal(batch[1], a)


def test_objects_span_the_scale_range_inside_the_canvas():
    sides = []
    for index in range(300):
        out = canvas.compose(garment(), index=index, seed=0)
        rows, cols = np.nonzero(out)
        height, width = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert height == width  # pasted whole, square, never clipped by the canvas edge
        sides.append(height)
    assert min(sides) >= round(0.45 * 48) and max(sides) <= 48
    assert min(sides) <= 24 and max(sides) >= 45  # the draws cover the range, not one size


def test_bad_scale_is_refused():
    with pytest.raises(ValueError, match="scale"):
        canvas.compose(garment(), 0, 0, scale=(0.5, 1.2))


def test_shipped_canvas_dataset():
    root = pipeline.embedded_data_path("fashion_mnist_canvas")
    classes = pipeline.check_image_folder(root)
    assert len(classes) == 10
    train, val = pipeline.image_folder(root, "train"), pipeline.image_folder(root, "val")
    assert (len(train), len(val)) == (10_000, 2_000)
    assert train[0][0].size == (48, 48)
    assert (root / "LICENSE").read_text().count("Zalando SE") >= 1
    with pytest.raises(ValueError, match="no embedded dataset"):
        pipeline.embedded_data_path("imagenet")


@pytest.mark.skipif(not (SOURCE / "t10k-images-idx3-ubyte.gz").exists(),
                    reason="Debian package dataset-fashion-mnist not installed (apt-get install dataset-fashion-mnist)")
def test_shipped_canvas_images_are_the_documented_composition():
    """A shipped val image equals compose(test image, its index, seed 2), as make_embedded_dataset.py says."""
    with gzip.open(SOURCE / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 28, 28)
    root = pipeline.embedded_data_path("fashion_mnist_canvas") / "val"
    for path in sorted(root.glob("*/*.png"))[:5]:
        index = int(path.stem)
        shipped = np.asarray(Image.open(path))
        assert np.array_equal(shipped, canvas.compose(images[index], index, seed=2))
