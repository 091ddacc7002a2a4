"""Decode what is kept: a JPEG's crop window, at the smallest DCT scale that still covers the output.

A RandomResizedCrop at 128 px of a 512 px photo keeps a box of, say, 300 x 260 px and shrinks it to
128 x 128; decoding the whole photo at full size to do so wastes most of the decode. libjpeg (and
libjpeg-turbo) can run its inverse DCT at 1/2, 1/4 or 1/8 scale (the "scaled IDCT": each 8 x 8 block
becomes 4 x 4, 2 x 2 or 1 x 1 pixels), which skips most of the IDCT, colour conversion and upsampling.
The transforms here first draw their box from the image's size alone (read from the JPEG header,
nothing decoded), with the same random draws as torchvision's transform on the decoded image
(:meth:`torchvision.transforms.v2.RandomResizedCrop.make_params` on a stand-in of that size), then
decode at the largest scale ``s`` in (8, 4, 2, 1) for which the box is still at least the output size
on both sides (``box / s >= output``), and resize the box the rest of the way with torchvision's
antialiased ``resized_crop``, its corners rounded to the scaled image's pixels (at most ``s / 2``
source pixels away; the crops of a RandomResizedCrop are drawn to the source pixel). The decoder is
libjpeg-turbo through simplejpeg (its ``min_height``/``min_width``: libjpeg's scaling factors). The same
idea is NVIDIA DALI's ``decoders.image_random_crop`` and libjpeg-turbo's ``tjDecompress2`` scaling
factors.

Where no scale applies (``s == 1``: a box less than twice the output on a side) the image is decoded
whole and cropped exactly as before (``torchvision.io.decode_jpeg`` and torchvision's
``resized_crop``), so the pixels are bit-identical to a full decode's. Where one does, they differ
from a full decode by the scaled IDCT's own low-pass (a box filter of the 8 x 8 block's frequencies,
not the antialiased bilinear of a resize) and the rounding of the box's corners:
``tests/data/test_scaled_decode.py`` bounds it against an analytic image, and
``benchmarks/input_pipeline.py`` prints the mean absolute difference on photos beside the speed.
What is not skipped: the entropy (Huffman) decoding of the whole file, which libjpeg must run to
reach any block, and which is most of the cost of a high-quality or progressive JPEG
(benchmarks/README.md: the ceiling this leaves).

Other formats never reach these transforms as :class:`EncodedJpeg`: they are decoded whole, as
before (:func:`fixres_dist.data.images.decode_image`); so are the JPEGs simplejpeg refuses (data it
finds corrupt, a colour space it cannot convert), by the full decode, which decodes them or names the
problem as before. EXIF orientation is ignored, as everywhere in the package.
"""
from __future__ import annotations

import attrs
import simplejpeg
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from fixres_dist.data import images

SCALES = (8, 4, 2, 1)  # libjpeg's scaled IDCT: 1/8, 1/4, 1/2 and full size


class DeferredDecodeError(Exception):
    """A JPEG whose header read but whose data does not decode (truncated, corrupt, a header that
    claims more pixels than the file holds), found when a transform decodes its window. Its
    ``__cause__`` is the decoder's error (an ``OSError``, or a ``ValueError`` as
    :func:`fixres_dist.data.images.open_rgb` raises), which the data loader reports as a bad image."""


@attrs.frozen
class EncodedJpeg:
    """A JPEG file's bytes, not decoded yet, and its size in pixels from its header (``width``,
    ``height``: before any EXIF rotation, as decoded). What :class:`~fixres_dist.data.pipeline.SeededDataset`
    hands a transform that decodes windows (:func:`takes_encoded`)."""

    data: bytes
    width: int
    height: int

    @classmethod
    def of(cls, encoded: bytes) -> EncodedJpeg | None:
        """``encoded`` (an image file's bytes) as an :class:`EncodedJpeg` if it is a JPEG (its size from its
        header), else ``None`` (decoded whole, as before). Raises as :func:`fixres_dist.data.images.jpeg_size`."""
        size = images.jpeg_size(encoded)
        return cls(encoded, *size) if size is not None else None

    def stand_in(self) -> torch.Tensor:
        """A uint8 tensor of shape (3, height, width) that owns one byte (an expanded view): what
        torchvision's transforms query for an image's size, at no cost."""
        return torch.zeros((1, 1, 1), dtype=torch.uint8).expand(3, self.height, self.width)


def dct_scale(box_width: float, box_height: float, width: int, height: int) -> int:
    """The largest libjpeg scale divisor ``s`` in :data:`SCALES` with ``box / s >= output`` on both sides:
    a box of ``box_width`` x ``box_height`` source pixels resized to ``width`` x ``height`` output
    pixels is then downscaled, never upscaled, after the scaled decode."""
    return next((s for s in SCALES if box_width >= s * width and box_height >= s * height), 1)


def decode_full(jpeg: EncodedJpeg):
    """The whole image, decoded as every JPEG was before (:func:`fixres_dist.data.images.decode_image`):
    a uint8 (3, H, W) tensor, or an 8-bit RGB PIL image where torchvision's decoder refuses the file.
    Raises :class:`DeferredDecodeError` when it does not decode."""
    try:
        return images.decode_image(jpeg.data)
    except (OSError, ValueError, SyntaxError) as exc:
        raise DeferredDecodeError(str(exc)) from exc


def decode_box(jpeg: EncodedJpeg, box: tuple[float, float, float, float], size: tuple[int, int],
               interpolation: v2.InterpolationMode, scale: int) -> torch.Tensor | None:
    """The ``box`` (left, top, width, height, in source pixels, fractional allowed) of ``jpeg`` decoded
    at 1/``scale`` (2, 4 or 8; libjpeg-turbo's scaled IDCT through simplejpeg), its corners rounded to
    the scaled image's pixels (at most ``scale / 2`` source pixels away), and resized to ``size``
    (height, width) by torchvision's antialiased ``resized_crop`` with ``interpolation``: a uint8
    (3, height, width) RGB tensor. ``None`` where simplejpeg does not decode the file (data it finds
    corrupt, a colour space it cannot convert): the caller decodes it whole, as before, which decodes
    it or names the problem."""
    try:
        pixels = simplejpeg.decode_jpeg(jpeg.data, "RGB", min_width=-(-jpeg.width // scale),
                                        min_height=-(-jpeg.height // scale), min_factor=scale)
    except ValueError:
        return None
    # libjpeg's scaled image is ceil(side / scale) pixels, pixel i covering source pixels [i s, (i + 1) s).
    height, width = pixels.shape[:2]
    factor = width / -(-jpeg.width // scale) / scale
    left, top = (min(round(v * factor), limit - 1) for v, limit in ((box[0], width), (box[1], height)))
    right, bottom = (min(max(round((v + extent) * factor), start + 1), limit)
                     for v, extent, start, limit in ((box[0], box[2], left, width), (box[1], box[3], top, height)))
    image = torch.from_numpy(pixels).permute(2, 0, 1)  # (3, H, W), a view of the decoder's HWC memory
    return TF.resized_crop(image, top, left, bottom - top, right - left, list(size), interpolation=interpolation,
                           antialias=True)


class WindowedRandomResizedCrop(torch.nn.Module):
    """``v2.RandomResizedCrop(size, interpolation=..., antialias=True)`` that also takes an
    :class:`EncodedJpeg` and then decodes only its box at a DCT scale (module docstring). Given a PIL
    image or a uint8 (3, H, W) tensor it is torchvision's transform. The box comes from the same
    generator draws either way, so the crops (and every draw after them) are those of the full
    decode for the same seed. Returns a uint8 (3, size, size) tensor for a JPEG."""

    def __init__(self, size: int, interpolation: v2.InterpolationMode):
        super().__init__()
        self.crop = v2.RandomResizedCrop(size, interpolation=interpolation, antialias=True)

    def forward(self, image):
        if not isinstance(image, EncodedJpeg):
            return self.crop(image)
        box = self.crop.make_params([image.stand_in()])
        height, width = self.crop.size
        scale = dct_scale(box["width"], box["height"], width, height)
        kept = decode_box(image, (box["left"], box["top"], box["width"], box["height"]), self.crop.size,
                          self.crop.interpolation, scale) if scale > 1 else None
        return kept if kept is not None else self.crop.transform(decode_full(image), box)


class WindowedResizeCenterCrop(torch.nn.Module):
    """``v2.Resize(resize)`` of the shorter side (antialiased) then ``v2.CenterCrop(crop)``, which also
    takes an :class:`EncodedJpeg` and then decodes only the centre box at a DCT scale (module
    docstring): the box is where the centre crop of the resized image lies in the source (the same
    geometry, torchvision's rounding of the resized size and of the crop's corner), resized from its
    fractional corners. Returns a uint8 (3, crop, crop) tensor for a JPEG."""

    def __init__(self, resize: int, crop: int, interpolation: v2.InterpolationMode):
        super().__init__()
        self.resize, self.crop = resize, crop
        self.steps = v2.Compose([v2.Resize(resize, interpolation=interpolation, antialias=True), v2.CenterCrop(crop)])
        self.interpolation = interpolation

    def box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """(left, top, width, height) in source pixels of the centre crop of a ``width`` x ``height``
        image resized to :attr:`resize` pixels on its shorter side."""
        short, long = sorted((width, height))  # torchvision's Resize(int): the longer side truncated
        new_short, new_long = self.resize, int(self.resize * long / short)
        new_width, new_height = (new_short, new_long) if width <= height else (new_long, new_short)
        top = int(round((new_height - self.crop) / 2.0))
        left = int(round((new_width - self.crop) / 2.0))
        x, y = width / new_width, height / new_height
        return left * x, top * y, self.crop * x, self.crop * y

    def forward(self, image):
        if not isinstance(image, EncodedJpeg):
            return self.steps(image)
        if self.crop > self.resize:  # the crop pads the resized image: no box inside the source
            return self.steps(decode_full(image))
        box = self.box(image.width, image.height)
        scale = dct_scale(box[2], box[3], self.crop, self.crop)
        kept = decode_box(image, box, (self.crop, self.crop), self.interpolation, scale) if scale > 1 else None
        return kept if kept is not None else self.steps(decode_full(image))


def takes_encoded(transform) -> bool:
    """Whether ``transform`` (a ``v2.Compose``) starts with a step of this module, so that it may be
    given :class:`EncodedJpeg` items."""
    steps = getattr(transform, "transforms", ())
    return bool(steps) and isinstance(steps[0], (WindowedRandomResizedCrop, WindowedResizeCenterCrop))
