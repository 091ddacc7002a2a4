"""Image files to 8-bit RGB, whatever mode Pillow opens them in, with their levels preserved.

Pillow's own ``convert("RGB")`` (what torchvision's ``default_loader`` does) clips wide modes
instead of scaling them: a 16-bit grey PNG (mode ``I;16``) with 180 grey levels becomes black and
white. :func:`to_rgb8` maps every mode Pillow can open to 8-bit RGB by its *levels*:

* ``I;16``, ``I;16L``, ``I;16B``, ``I;16N`` (16-bit grey): ``v -> round(v * 255 / 65535)``, so
  the 16-bit image ``v * 257`` gives the 8-bit image ``v``;
* ``I`` (32-bit signed integer): Pillow reads 16-bit PGM/PPM files (any maxval, rescaled by Pillow to
  0-65535) and some 16-bit TIFFs in this mode, so its scale is 16 bits, except for TIFFs that
  declare 32 bits per sample (``BitsPerSample`` 32), whose scale is 0 to 2**31 - 1; values
  outside the scale (negative, or above it) cannot be converted;
* ``F`` (32-bit float): the scale is 0-1 (``v -> round(255 v)``); values outside [0, 1] or not
  finite cannot be converted (their scale is unknown: 0-1, 0-255, or radiance);
* modes with transparency (``RGBA``, ``LA``, ``PA``, ``P`` with a transparent colour, and the
  premultiplied ``RGBa``, ``La``): composited over black, so a transparent pixel is black whatever
  colour it hides, and an opaque one keeps its levels;
* every other mode Pillow converts to RGB itself (``L``, ``P``, ``1``, ``CMYK``, ``YCbCr``,
  ``HSV``, ``LAB``, ``RGBX``...) by Pillow's conversion.

What cannot be converted raises :class:`ImageModeError` (a ``ValueError``) naming the mode and the
reason; the data loader reports it like any unreadable image (:class:`fixres_dist.data.pipeline.SeededDataset`).

Pillow's decompression-bomb check is kept, for every format: an image of more than twice
``PIL.Image.MAX_IMAGE_PIXELS`` pixels (178,956,970 by default), which Pillow refuses with
``DecompressionBombError`` (an ``Exception``, none of the errors a loader expects), raises
:class:`ImageTooLargeError` (a ``ValueError``) with its pixel count and the limit, before anything
is decoded (JPEGs too, which Pillow's header read checks before ``decode_jpeg`` runs). Between the
limit and twice the limit, Pillow decodes and warns: they are decoded, without the warning
(:func:`pillow_limits` says why).

:func:`read_image` is the loader: JPEG files are decoded by ``torchvision.io.decode_jpeg``
(libjpeg-turbo with Pillow's settings: the same pixels as Pillow's decoder, grey and CMYK become RGB
as with Pillow) straight into a uint8 (3, H, W) tensor, about 0.7 of Pillow's time; everything else,
and JPEGs that decoder refuses, goes through Pillow and :func:`to_rgb8`. EXIF orientation is ignored,
as by torchvision's ImageFolder.
"""
from __future__ import annotations

import contextlib
import io
import re
import warnings

import numpy as np
import torch
from PIL import Image

try:  # deprecated in torchvision 0.29 in favour of torchcodec; Pillow takes over if it goes away
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover
    decode_jpeg = None

_JPEG_MAGIC = b"\xff\xd8\xff"
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_PREMULTIPLIED = {"RGBa": "RGB", "La": "L"}  # colour channels already multiplied by alpha: over black as they are
_TIFF_BITS_PER_SAMPLE = 258


class ImageModeError(ValueError):
    """An image whose mode or values have no 8-bit RGB equivalent; the message says why."""


class ImageTooLargeError(ValueError):
    """An image above Pillow's decompression-bomb limit; the message gives its pixels and the limit."""


_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")  # the count in Pillow's DecompressionBombError message


@contextlib.contextmanager
def pillow_limits():
    """Within the block, Pillow's ``DecompressionBombError`` becomes :class:`ImageTooLargeError`, and
    its ``DecompressionBombWarning`` is not shown."""
    with warnings.catch_warnings():
        # Between MAX_IMAGE_PIXELS and twice that, Pillow decodes and warns. So do we, silently: such
        # an image (89 to 179 M pixels by default: a large photo, scan or panorama; under 0.6 GB as
        # 8-bit RGB) is data rather than an attack, and refusing it would refuse what Pillow and
        # torchvision read; while the warning names no file, and every loader worker process would
        # print it, once per size, among the progress bars. The refusal above twice the limit stays.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            yield
        except Image.DecompressionBombError as exc:
            found = _BOMB_PIXELS.search(str(exc))
            size = f"{int(found[1]):,} pixels" if found else str(exc).strip()
            limit = 2 * Image.MAX_IMAGE_PIXELS
            raise ImageTooLargeError(f"{size}, above Pillow's decompression-bomb limit of {limit:,} pixels "
                                     "(twice PIL.Image.MAX_IMAGE_PIXELS)") from None


def _full_scale(image: Image.Image) -> int:
    """The level that means white in an ``I``-mode image (see the module docstring)."""
    bits = getattr(image, "tag_v2", {}).get(_TIFF_BITS_PER_SAMPLE)
    if isinstance(bits, tuple):
        bits = bits[0] if bits else None
    return 2 ** 31 - 1 if bits == 32 else 65535


def _scaled(values: np.ndarray, full: float, mode: str) -> Image.Image:
    """Grey ``values`` on the scale 0..``full`` -> an 8-bit ``L`` image; ImageModeError outside it."""
    if not np.isfinite(values).all():
        raise ImageModeError(f"mode {mode} image holds non-finite values (NaN or infinity)")
    low, high = values.min(initial=0), values.max(initial=0)
    if low < 0 or high > full:
        scale = "0-1" if mode == "F" else f"0-{full}"
        raise ImageModeError(f"mode {mode} image has values {low:g} to {high:g}, outside its scale {scale}; "
                             "save it as 8- or 16-bit")
    levels = np.rint(values.astype(np.float64) * (255 / full)).astype(np.uint8)
    return Image.fromarray(levels)


def to_rgb8(image: Image.Image) -> Image.Image:
    """``image`` (any mode Pillow opens) as an 8-bit ``RGB`` image with its levels preserved.

    Same size; the mapping per mode is in the module docstring. Decodes a lazily opened image;
    raises ``OSError`` when that fails (truncated file) and :class:`ImageModeError` (a
    ``ValueError``) for values outside a mode's scale or a mode Pillow cannot convert to RGB.
    """
    image.load()  # decode now: a truncated file fails here, not later in a transform
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT:
        return _scaled(np.asarray(image), 65535, mode).convert("RGB")
    if mode == "I":
        return _scaled(np.asarray(image), _full_scale(image), mode).convert("RGB")
    if mode == "F":
        return _scaled(np.asarray(image), 1.0, mode).convert("RGB")
    if mode in _PREMULTIPLIED:
        return Image.merge(_PREMULTIPLIED[mode], image.split()[:-1]).convert("RGB")
    if image.has_transparency_data:
        with warnings.catch_warnings():  # Pillow suggests this very conversion for palette transparency
            warnings.simplefilter("ignore", UserWarning)
            rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba).convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise ImageModeError(f"mode {mode} cannot be converted to RGB ({exc})") from None


def open_rgb(path: str) -> Image.Image:
    """The image file at ``path`` as an 8-bit RGB PIL image (:func:`to_rgb8`).

    Raises ``OSError`` for an unreadable file (Pillow's ``UnidentifiedImageError`` is one),
    :class:`ImageModeError` for one that cannot be converted and :class:`ImageTooLargeError` for
    one above Pillow's decompression-bomb limit (module docstring).
    """
    with open(path, "rb") as f, pillow_limits():
        return to_rgb8(Image.open(io.BytesIO(f.read())))


def read_image(path: str):
    """A JPEG file as a uint8 (3, H, W) RGB tensor, anything else as an 8-bit RGB PIL image.

    See the module docstring; raises as :func:`open_rgb`.
    """
    with open(path, "rb") as f:
        return decode_image(f.read())


def jpeg_size(encoded: bytes) -> tuple[int, int] | None:
    """(width, height) in pixels of a JPEG file's bytes, read from its header alone (nothing decoded;
    Pillow's decompression-bomb check applied); ``None`` for any other format (a PNG named ``.jpg``
    included). Raises as :func:`open_rgb` for a header Pillow cannot read."""
    if encoded[:3] != _JPEG_MAGIC:
        return None
    with pillow_limits():
        image = Image.open(io.BytesIO(encoded))
    return image.size if image.format in ("JPEG", "MPO") else None


def decode_image(encoded: bytes):
    """An image file's bytes (e.g. a packed shard's sample) decoded as :func:`read_image` decodes the
    file; raises as :func:`open_rgb`."""
    with pillow_limits():
        image = Image.open(io.BytesIO(encoded))  # reads the header alone, and checks its size
        if decode_jpeg is not None and encoded[:3] == _JPEG_MAGIC:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    return decode_jpeg(torch.frombuffer(bytearray(encoded), dtype=torch.uint8),
                                       mode=ImageReadMode.RGB)
            except RuntimeError:
                pass
        return to_rgb8(image)
