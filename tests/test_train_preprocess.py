"""sagm_jax.train.preprocess: a user's images become the batch the run's evaluation
gives its model (image folders: the decoded store's evaluation image, normalised;
MNIST-like datasets: the stored arrays)."""

import os

import numpy as np
import pytest
from PIL import Image

from sagm_jax import rundir, train
from sagm_jax.data import device_augment, store


def write_run_info(folder, dataset, input_shape):
    os.makedirs(folder)
    info = {"dataset": dataset, "input_shape": input_shape, "class_names": ["a", "b"]}
    rundir.write_json(os.path.join(folder, rundir.RUN_INFO), info)
    return str(folder)


def test_folder_images_are_resized_to_the_runs_input_and_normalised(tmp_path):
    workdir = write_run_info(tmp_path / "run", "PACS", [32, 32, 3])
    pixels = np.random.default_rng(0).integers(0, 256, (45, 70, 3), dtype=np.uint8)
    path = str(tmp_path / "image.png")
    Image.fromarray(pixels).save(path)
    # What the run evaluated: the store's evaluation image, normalised on the device.
    stored = store.decode_file(path, (45, 70), (45, 70), 32)[1]
    expected = np.asarray(device_augment.normalize(stored.astype(np.float32) / 255.0))
    with Image.open(path) as opened:
        batch = train.preprocess(workdir, [path, pixels, opened])  # a file, an array, PIL's
    assert batch.shape == (3, 32, 32, 3) and batch.dtype == np.float32
    for image in batch:
        np.testing.assert_allclose(image, expected, atol=1e-5)


def test_mnist_like_images_keep_their_shape_and_scale(tmp_path):
    workdir = write_run_info(tmp_path / "run", "RotatedDigits", [28, 28, 1])
    digits = np.random.default_rng(1).integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
    np.testing.assert_allclose(train.preprocess(workdir, digits), digits / 255.0, rtol=1e-6)
    as_stored = digits.astype(np.float32) / 255.0
    np.testing.assert_array_equal(train.preprocess(workdir, as_stored), as_stored)
    with pytest.raises(ValueError, match=r"shape \(28, 28, 1\); got a batch of shape"):
        train.preprocess(workdir, np.zeros((2, 32, 32, 3), np.uint8))
