"""Small DomainBed-style image folders written by the tests themselves."""

import os

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
