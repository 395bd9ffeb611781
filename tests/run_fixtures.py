"""The tiny training runs the tests make: RotatedDigits with a small CNN, seconds each, and
a tiny image folder."""

import os

import numpy as np
from PIL import Image

from sagm_jax.config import base_config, mnist_config


def digits_config(**overrides):
    config = mnist_config("RotatedDigits")
    config.update(
        dict(
            batch_per_env=8,
            steps=5,
            eval_every=2,
            log_every=1,
            eval_batch_size=64,
            cnn_widths=(16, 32, 32, 32),
        )
    )
    config.update(overrides)
    return config


def write_image_tree(root, domains=("art", "photo", "sketch"), classes=("cat", "dog"), n=4):
    rng = np.random.default_rng(0)
    for d in domains:
        for c in classes:
            os.makedirs(root / d / c)
            for k in range(n):
                size = (int(rng.integers(20, 50)), int(rng.integers(20, 50)))
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / d / c / f"{k}.jpg")


def tiny_folder_config(tmp_path, **overrides):
    """An ImageFolder run of ``tmp_path/data`` (write_image_tree) with the MNIST CNN on
    16x16 inputs, ERM, small batches."""
    config = base_config()
    config.update(
        dict(
            dataset="ImageFolder",
            data_dir=str(tmp_path / "data"),
            arch="mnist_cnn",
            pretrained_weights="none",
            image_size=16,
            batch_per_env=4,
            eval_batch_size=8,
            algorithm="erm",
        )
    )
    config.update(overrides)
    return config
