"""The scaled decode (fixres_dist.data.scaled_decode): the same crops as a full decode for the same seed, the
pixels within a bound derived from an analytic image, and every odd JPEG decoded or named as before."""
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from fixres_dist.data import images, pipeline, scaled_decode
from fixres_dist.data.samplers import SampleKey
from fixres_dist.data.scaled_decode import EncodedJpeg
from fixres_dist.errors import FixresError

WIDTH, HEIGHT = 640, 480


def gradient(width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """An analytic image, uint8 (H, W, 3): red = the column, green = the row (each 0-255 across the image),
    blue constant. Any crop of it says where it was taken: a box off by a pixel shifts its colours."""
    x = np.linspace(0, 255, width)
    y = np.linspace(0, 255, height)
    return np.stack([np.broadcast_to(x, (height, width)), np.broadcast_to(y[:, None], (height, width)),
                     np.full((height, width), 128.0)], -1).round().astype(np.uint8)


def encoded(array: np.ndarray, mode: str = "RGB", **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).convert(mode).save(out, "JPEG", **options)
    return out.getvalue()


def transformed(transform, image, seed: int):
    """``transform(image)`` under the per-sample seeding of SeededDataset, and the generator's state after."""
    with pipeline.seeded_cpu_generator([seed, 0, 7]):
        out = transform(image)
        return out, torch.default_generator.get_state()


def analytic(box, size: int) -> np.ndarray:
    """float64 (3, size, size): the gradient's exact values over ``box`` (left, top, width, height) at each
    output pixel's centre, the reference both decodes approximate."""
    left, top, width, height = box
    centres = (np.arange(size) + 0.5) / size
    red = (left + centres * width - 0.5) * 255 / (WIDTH - 1)
    green = (top + centres * height - 0.5) * 255 / (HEIGHT - 1)
    return np.stack([np.broadcast_to(red, (size, size)), np.broadcast_to(green[:, None], (size, size)),
                     np.full((size, size), 128.0)])


@pytest.mark.parametrize("size", [48, 100, 224])
def test_the_train_crops_are_drawn_as_before_and_decoded_near_the_analytic_image(size):
    """For 40 seeds: the box comes from the same draws as v2.RandomResizedCrop's on the decoded image (the
    generator ends in the same state, so the flip and every draw after it are the same), a crop without a
    DCT scale is bit for bit the full decode's, and one with a scale ``s`` is no further from the analytic
    image than the full decode is, plus one level (a rounding), plus the gradient's change over half a scaled
    pixel (``s / 2`` source pixels: how far the box's corners move when rounded to the scaled image's
    pixels, and how far inside the outermost scaled pixel's centre lies at the image's border)."""
    data = encoded(gradient(), quality=95)
    crop = scaled_decode.WindowedRandomResizedCrop(size, v2.InterpolationMode.BILINEAR)
    scaled_seen = 0
    for seed in range(40):
        full, full_state = transformed(crop, images.decode_image(data), seed)
        mine, state = transformed(crop, EncodedJpeg.of(data), seed)
        assert torch.equal(state, full_state)
        with pipeline.seeded_cpu_generator([seed, 0, 7]):
            box = crop.crop.make_params([EncodedJpeg.of(data).stand_in()])
        scale = scaled_decode.dct_scale(box["width"], box["height"], size, size)
        if scale == 1:
            assert torch.equal(mine, full)
            continue
        scaled_seen += 1
        reference = analytic((box["left"], box["top"], box["width"], box["height"]), size)
        full_error = np.abs(full.double().numpy() - reference)[:2].max()
        border = scale / 2 * 255 / (HEIGHT - 1)  # the steeper of the two ramps, levels per source pixel
        assert np.abs(mine.double().numpy() - reference)[:2].max() <= full_error + 1 + border, (seed, scale)
    assert scaled_seen >= 5  # the scaled path ran


@pytest.mark.parametrize("size,ratio", [(64, 0.875), (128, 0.875), (200, 1.0), (96, 0.5)])
def test_the_centre_crop_is_where_the_full_resize_puts_it(size, ratio):
    """The test transform's window: the same geometry as Resize(shorter side) + CenterCrop on the decoded
    image (torchvision's rounding), no further from the analytic image than that, plus one level."""
    data = encoded(gradient(), quality=95)
    transform = pipeline.test_transform(size, ratio)
    full, mine = transform(images.decode_image(data)), transform(EncodedJpeg.of(data))
    window = transform.transforms[0]
    box = window.box(WIDTH, HEIGHT)
    reference = analytic(box, size)
    assert scaled_decode.dct_scale(box[2], box[3], size, size) > 1
    full_error = np.abs(full.double().numpy() - reference)[:2].max()
    assert np.abs(mine.double().numpy() - reference)[:2].max() <= full_error + 1


@pytest.mark.parametrize("width,height", [(640, 480), (480, 640), (1000, 333), (37, 100), (501, 499), (64, 64)])
def test_the_window_uses_torchvisions_resized_size(width, height):
    """The resized size the window assumes is the one v2.Resize gives (the longer side truncated)."""
    window = scaled_decode.WindowedResizeCenterCrop(73, 64, v2.InterpolationMode.BILINEAR)
    resized = v2.Resize(73, antialias=True)(torch.zeros(1, height, width, dtype=torch.uint8))
    left, top, box_width, box_height = window.box(width, height)
    assert box_width * resized.shape[2] / width == pytest.approx(64)
    assert box_height * resized.shape[1] / height == pytest.approx(64)
    assert left * resized.shape[2] / width == pytest.approx(round((resized.shape[2] - 64) / 2))
    assert top * resized.shape[1] / height == pytest.approx(round((resized.shape[1] - 64) / 2))


def test_dct_scale_is_the_largest_that_never_upsamples():
    assert scaled_decode.dct_scale(512, 512, 64, 64) == 8
    assert scaled_decode.dct_scale(511, 512, 64, 64) == 4
    assert scaled_decode.dct_scale(300, 260, 128, 128) == 2
    assert scaled_decode.dct_scale(255, 600, 128, 128) == 1
    assert scaled_decode.dct_scale(50, 50, 128, 128) == 1  # an upsampling crop: decoded whole


def photo_like(seed: int = 0) -> np.ndarray:
    """A 320 x 240 image with texture at every scale (blurred noise plus edges), a stand-in for a photo."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(128, 60, (60, 80, 3))
    image = np.kron(noise, np.ones((4, 4, 1))) + rng.normal(0, 10, (240, 320, 3))
    image[100:140] = 250
    return image.clip(0, 255).astype(np.uint8)


def window_gap(data: bytes, size: int = 64) -> float:
    """Mean absolute difference (levels) between the test transform of ``data`` decoded through the window
    and decoded whole."""
    transform = pipeline.test_transform(size)
    full, mine = transform(images.decode_image(data)), transform(EncodedJpeg.of(data))
    assert mine.shape == full.shape == (3, size, size)
    return (mine.float() - full.float()).abs().mean().item()


@pytest.mark.parametrize("kind", ["progressive", "cmyk", "grey", "exif-rotated", "subsampling-444"])
def test_odd_jpegs_decode_through_the_window_as_a_plain_one_does(kind):
    """Progressive, CMYK, grey, EXIF-rotated (orientation ignored, as everywhere) and 4:4:4 JPEGs of a
    textured image: the window's output has the full decode's shape, and differs from it no more than a
    plain baseline JPEG of the same image does, doubled, plus a level (the reference, measured here: about
    3 levels; a wrong colour conversion, an inverted CMYK or an applied rotation differ by tens of levels)."""
    array = photo_like()
    options = {"quality": 90}
    mode = {"cmyk": "CMYK", "grey": "L"}.get(kind, "RGB")
    if kind == "progressive":
        options["progressive"] = True
    if kind == "subsampling-444":
        options["subsampling"] = 0
    if kind == "exif-rotated":
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees on display
        options["exif"] = exif.tobytes()
    plain = window_gap(encoded(array, quality=90))
    assert window_gap(encoded(array, mode, **options)) <= 2 * plain + 1


def test_an_arithmetic_coded_jpeg_decodes_through_the_window():
    """``tests/data/files/arithmetic.jpg`` (160 x 120, made with libjpeg-turbo's ``cjpeg -arithmetic``, which
    Pillow cannot write): decoded at a DCT scale, as near the full decode as a Huffman-coded copy is."""
    data = (Path(__file__).parent / "files" / "arithmetic.jpg").read_bytes()
    window = pipeline.test_transform(32).transforms[0].box(160, 120)
    assert scaled_decode.dct_scale(window[2], window[3], 32, 32) == 2
    huffman = io.BytesIO()
    Image.open(io.BytesIO(data)).save(huffman, "JPEG", quality=90)  # the same image, Huffman-coded
    assert window_gap(data, 32) <= 2 * window_gap(huffman.getvalue(), 32) + 1


def test_a_png_named_jpg_and_a_lying_header_take_the_full_decode(tmp_path):
    """A PNG named .jpg is no EncodedJpeg (decoded whole, as before); a header that claims more rows than the
    data holds is decoded as the full decode decodes it (libjpeg fills the missing rows), the same pixels."""
    png = io.BytesIO()
    Image.fromarray(photo_like()).save(png, "PNG")
    assert EncodedJpeg.of(png.getvalue()) is None
    data = encoded(photo_like(), quality=90)
    marker = data.index(b"\xff\xc0")  # the baseline frame header: its height at bytes 5-6
    lying = data[:marker + 5] + (240 * 4).to_bytes(2, "big") + data[marker + 7:]
    transform = pipeline.test_transform(64)
    assert EncodedJpeg.of(lying).height == 960
    assert torch.equal(transform(EncodedJpeg.of(lying)), transform(images.decode_image(lying)))


def jpeg_folder(root, files: dict[str, bytes]):
    for name, data in files.items():
        (root / "train" / "a").mkdir(parents=True, exist_ok=True)
        (root / "train" / "a" / name).write_bytes(data)
    return pipeline.image_folder(root, "train")


@pytest.mark.parametrize("decode", ["scaled", "full"])
def test_a_truncated_jpeg_is_named_in_one_line_or_skipped(tmp_path, decode):
    """The window's decode fails where the full decode does, with the same one-line message naming the file."""
    data = encoded(photo_like(), quality=90)
    folder = jpeg_folder(tmp_path, {"bad.jpg": data[:len(data) // 2], "good.jpg": data})
    dataset = pipeline.SeededDataset(folder, pipeline.test_transform(64), 0, jpeg_decode=decode)
    assert dataset.decodes_windows == (decode == "scaled")
    with pytest.raises(FixresError, match=r"^unreadable image .*bad\.jpg \(OSError: image file is truncated"):
        dataset[SampleKey(0, 0)]
    assert dataset[SampleKey(1, 0)][0].shape == (3, 64, 64)
    skipping = pipeline.SeededDataset(folder, pipeline.test_transform(64), 0, True, decode)
    assert skipping[SampleKey(0, 0)] is None


def test_the_dataset_hands_jpegs_over_undecoded_only_to_window_transforms(tmp_path):
    """SeededDataset: scaled decode from files and from packed shards' bytes gives the same images; an
    unknown decode name is refused in one line."""
    data = encoded(photo_like(), quality=90)
    folder = jpeg_folder(tmp_path, {"x.jpg": data})
    scaled = pipeline.SeededDataset(folder, pipeline.train_transform(48), 3)
    full = pipeline.SeededDataset(folder, pipeline.train_transform(48), 3, jpeg_decode="full")
    assert scaled.decodes_windows and not full.decodes_windows
    key = SampleKey(0, 2)
    assert scaled[key][0].shape == full[key][0].shape == (3, 48, 48)

    class Shard:  # what SeededDataset reads of a ShardSplit: the sample's bytes and its labels
        targets = [0]

        def __len__(self):
            return 1

        def read(self, index):
            return data

        def __getitem__(self, index):
            return images.decode_image(data), 0

    packed = pipeline.SeededDataset(Shard(), pipeline.train_transform(48), 3)
    assert packed.decodes_windows
    assert torch.equal(packed[key][0], scaled[key][0])
    with pytest.raises(FixresError, match="unknown JPEG decode 'fast'"):
        pipeline.SeededDataset(folder, pipeline.test_transform(48), 0, jpeg_decode="fast")
