"""Objects at varied scales: small images composed on a larger black canvas, deterministically.

FixRes corrects the apparent-object-size bias of RandomResizedCrop (Touvron et al., NeurIPS 2019,
section 3), which matters for photos whose objects come at every size. Fashion-MNIST garments fill
their 28 px frame, so they give that bias nothing to act on (measured: no FixRes gain on them, see
``FIXRES.md`` in the design notes and ``benchmarks/fixres_effect.py``). Pasting the same real
garments at random scales and positions on a larger canvas restores the scale variation of photos,
and with it the paper's effect.

Each image is resized (antialiased bilinear) so that its side is ``s x canvas`` pixels, with ``s``
uniform on ``scale`` (default 45-100 % of the canvas side), and pasted at a uniformly random position
that keeps it whole, on a black (0) background, which is Fashion-MNIST's own background. The draw
depends only on ``(seed, index)`` (``numpy.random.default_rng([seed, index])``), so a dataset built
twice is identical, whatever the order or the process.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

CANVAS_SIZE = 48  # pixels: the embedded canvas dataset's side
SCALE = (0.45, 1.0)  # fraction of the canvas side an object spans


def compose(image: np.ndarray, index: int, seed: int, canvas_size: int = CANVAS_SIZE,
            scale: tuple[float, float] = SCALE) -> np.ndarray:
    """One grey uint8 image (H, W) -> a uint8 (canvas_size, canvas_size) canvas holding it.

    The object's side is ``round(s x canvas_size)`` pixels (at least 1), ``s ~ U(scale)``; its
    top-left corner is uniform over the positions that keep it inside the canvas. Deterministic in
    ``(seed, index)``. Raises ValueError for a scale outside (0, 1] or reversed.
    """
    low, high = scale
    if not 0 < low <= high <= 1:
        raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {scale}")
    rng = np.random.default_rng([seed, index])
    side = max(1, round(rng.uniform(low, high) * canvas_size))
    top, left = (int(v) for v in rng.integers(0, canvas_size - side + 1, size=2))
    resized = Image.fromarray(image).resize((side, side), Image.BILINEAR, reducing_gap=None)
    canvas = np.zeros((canvas_size, canvas_size), dtype=np.uint8)
    canvas[top:top + side, left:left + side] = np.asarray(resized)
    return canvas


def compose_all(images: np.ndarray, seed: int, canvas_size: int = CANVAS_SIZE,
                scale: tuple[float, float] = SCALE, first_index: int = 0) -> np.ndarray:
    """uint8 (N, H, W) -> uint8 (N, canvas_size, canvas_size): :func:`compose` of each, image ``i``
    drawn with index ``first_index + i``."""
    return np.stack([compose(image, first_index + i, seed, canvas_size, scale) for i, image in enumerate(images)])
