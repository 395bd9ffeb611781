"""16-bit PNGs decode, on every path, to exactly what torchvision's loader (DomainBed's
``ImageFolder``: ``Image.open(path).convert("RGB")``) gives.

PIL reads 16-bit RGB, RGBA and grayscale+alpha PNGs as 8-bit (the high byte of each
sample), but opens 16-bit grayscale PNGs in mode ``I;16`` and ``convert("RGB")`` then
CLIPS each value to 255; ``tf.io.decode_image(dtype=uint8)`` would scale it to 8 bits.
The paths: the decoded store (``store.open_source``, built and streamed) and the tf.data
decode (``tf_input.decode``, with the decode check's ``needs_pil`` and without it).
"""

import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from sagm_jax.data import image_folder, store

S = 8  # the stores' image_size (eval images are S x S)
# name -> (height, width, channels of 16-bit samples; 0 = written by PIL in mode I;16;
# "L"/"RGB" = an 8-bit control)
FILES = {
    "gray16": (7, 5, 1),
    "gray16_pil": (6, 9, 0),
    "gray_alpha16": (5, 6, 2),
    "rgb16": (9, 4, 3),
    "rgba16": (4, 7, 4),
    "gray8": (5, 5, "L"),
    "rgb8": (6, 4, "RGB"),
}


def samples16(rng, shape):
    """uint16 samples, half of them below 512 (where clipping and scaling differ most),
    the rest anywhere in [0, 65535]."""
    low = rng.integers(0, 512, shape)
    high = rng.integers(0, 65536, shape)
    return np.where(rng.random(shape) < 0.5, low, high).astype(np.uint16)


def write_png16(path, samples):
    """A 16-bit PNG of ``samples`` (uint16 [h, w, c]; c = 1 gray, 2 gray+alpha, 3 RGB,
    4 RGBA), written by hand (PIL cannot write 16-bit colour PNGs)."""
    h, w, c = samples.shape
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    rows = samples.reshape(h, w * c).astype(">u2")
    data = b"".join(b"\0" + row.tobytes() for row in rows)  # filter type 0 per row

    def chunk(kind, body):
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(data)))
        f.write(chunk(b"IEND", b""))


def write_tree(root):
    """root/<d0|d1>/<c0|c1>/<name>.png: every file of FILES in each domain."""
    rng = np.random.default_rng(0)
    for domain in ("d0", "d1"):
        for k, (name, (h, w, kind)) in enumerate(FILES.items()):
            folder = os.path.join(root, domain, f"c{k % 2}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{name}.png")
            if kind == 0:
                Image.fromarray(samples16(rng, (h, w))).save(path)  # mode I;16
            elif isinstance(kind, str):
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                Image.fromarray(pixels).convert(kind).save(path)
            else:
                write_png16(path, samples16(rng, (h, w, kind)))


def reference(path):
    """torchvision's loader."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("sixteen_bit")
    write_tree(str(root))
    return image_folder.scan_image_folder(str(root), missing_help="", cache_dir=None)


def paths_of(index):
    return [p for env in index.paths for p in env]


def test_the_files_are_what_the_test_needs(index):
    paths = paths_of(index)
    assert len(paths) == 2 * len(FILES)
    for path in paths:
        name = os.path.basename(path)[: -len(".png")]
        with Image.open(path) as image:
            if name.startswith("gray16"):
                # PIL's 16-bit grayscale mode, with values above 255: clipping and
                # scaling to 8 bits give different pixels.
                assert image.mode in ("I;16", "I;16B", "I"), image.mode
                values = np.asarray(image)
                assert values.max() > 255 and (values <= 255).any()
                assert (reference(path)[..., 0] == np.minimum(values, 255)).all()
            elif name in ("rgb16", "rgba16", "gray_alpha16"):
                assert image.mode in ("RGB", "RGBA", "LA"), image.mode


@pytest.mark.parametrize("mode", ["cache", "stream"])
def test_store_pixels_are_pils(index, tmp_path, mode):
    source = store.open_source(
        index,
        image_size=S,
        short_side=64,
        mode=mode,
        cache_dir=str(tmp_path),
        workers=1,
        progress=False,
    )
    paths = paths_of(index)
    ids = np.arange(len(paths))
    images, hw = source.gather(ids)
    evals = source.eval_images(ids)
    for k, path in enumerate(paths):
        expected = reference(path)
        h, w = hw[k]
        np.testing.assert_array_equal(images[k, :h, :w], expected, err_msg=path)
        with Image.open(path) as image:
            expected_eval = np.asarray(image.convert("RGB").resize((S, S), Image.BILINEAR))
        np.testing.assert_array_equal(evals[k], expected_eval, err_msg=path)


@pytest.mark.parametrize("checked", [True, False], ids=["needs_pil", "tf_only"])
def test_tf_decode_pixels_are_pils(index, checked):
    """Through tf.data (graph mode, as the pipeline runs it); ``tf_only``: every file
    decoded by TensorFlow itself, as when the decode check is off."""
    tf = pytest.importorskip("tensorflow")
    from sagm_jax.data import tf_input

    paths = paths_of(index)
    needs_pil = np.concatenate(index.needs_pil) if checked else np.zeros(len(paths), bool)
    ds = tf.data.Dataset.from_tensor_slices((paths, needs_pil)).map(tf_input.decode)
    for path, image in zip(paths, ds.as_numpy_iterator()):
        np.testing.assert_array_equal(image, reference(path), err_msg=path)
