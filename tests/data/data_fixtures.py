"""Small DomainBed-style image folders written by the tests themselves."""

import os
import struct
import zlib

import numpy as np
from PIL import Image

DOMAINS = ("domain_b", "domain_a", "domain_c")  # written unsorted on purpose
CLASSES = ("dog", "cat", "Zebra")
SIZES = ((40, 30), (17, 64), (96, 20), (33, 33), (50, 80))  # (width, height), odd ratios


def write_image(path, size, seed, fmt):
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)


def make_tree(root, per_class=(3, 4, 2), nested=True):
    """root/<domain>/<class>/<image>: JPEG and PNG files of several sizes, an upper-case
    extension, a nested sub-folder and a non-image file. Returns the number of images
    per domain."""
    counts = {}
    seed = 0
    for d_index, domain in enumerate(DOMAINS):
        n_domain = 0
        for c_index, cls in enumerate(CLASSES):
            class_dir = os.path.join(root, domain, cls)
            for k in range(per_class[c_index] + d_index):
                seed += 1
                fmt = "PNG" if k % 2 else "JPEG"
                ext = {"PNG": ".png", "JPEG": ".jpg"}[fmt]
                if k in (1, 2):
                    ext = ext.upper()
                write_image(
                    os.path.join(class_dir, f"img_{k:02d}{ext}"),
                    SIZES[seed % len(SIZES)],
                    seed,
                    fmt,
                )
                n_domain += 1
            if nested:
                seed += 1
                write_image(os.path.join(class_dir, "sub", "deeper.jpeg"), (21, 13), seed, "JPEG")
                seed += 1
                write_image(os.path.join(class_dir, "a-sibling", "x.png"), (13, 21), seed, "PNG")
                n_domain += 2
            with open(os.path.join(class_dir, "notes.txt"), "w") as f:
                f.write("not an image")
        counts[domain] = n_domain
    return counts


def pil_rgb(path):
    """torchvision's loader (DomainBed's ``ImageFolder``): ``Image.open(path).convert("RGB")``."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


# 16-bit PNGs: PIL reads 16-bit RGB, RGBA and grayscale+alpha PNGs as 8-bit (the high
# byte of each sample), but opens 16-bit grayscale PNGs in mode ``I;16`` and
# ``convert("RGB")`` then CLIPS each value to 255, where ``tf.io.decode_image(dtype=uint8)``
# would scale it to 8 bits. Every path must give torchvision's loader's pixels
# (``pil_rgb``): the decoded store (test_store.py) and tf.data (test_tf_input.py).
# name -> (height, width, channels of 16-bit samples; 0 = written by PIL in mode I;16;
# "L"/"RGB" = an 8-bit control)
SIXTEEN_BIT_FILES = {
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


def write_sixteen_bit_tree(root):
    """root/<d0|d1>/<c0|c1>/<name>.png: every file of SIXTEEN_BIT_FILES in each domain."""
    rng = np.random.default_rng(0)
    for domain in ("d0", "d1"):
        for k, (name, (h, w, kind)) in enumerate(SIXTEEN_BIT_FILES.items()):
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
