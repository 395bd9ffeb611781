"""Augmentation statistics over many draws, and the crop-box rule checked directly."""


import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from sagm_jax.data import augment  # noqa: E402

N = 2000


def boxes(height, width, n=N):
    fn = tf.function(lambda s: tf.stack(augment.random_resized_crop_box(s, height, width)))
    seeds = tf.random.experimental.stateless_split(tf.constant([7, 11], tf.int64), n)
    return np.stack([fn(seeds[i]).numpy() for i in range(n)])


@pytest.mark.parametrize("height,width", [(227, 227), (240, 200), (480, 640)])
def test_crop_area_and_bounds(height, width):
    b = boxes(height, width)
    top, left, h, w = b.T
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    frac = h * w / (height * width)
    # Rounding h and w to integers moves the area by at most about (h + w) / 2 pixels.
    slack = (height + width) / (2 * height * width) + 1e-9
    assert frac.min() >= 0.7 - slack and frac.max() <= 1.0 + slack
    assert frac.min() < 0.72 and frac.max() > 0.97  # the whole range is used
    ratio = w / h
    assert ratio.min() >= 0.75 * (1 - 0.02) and ratio.max() <= 4 / 3 * (1 + 0.02)


def test_crop_aspect_is_log_uniform():
    # Log-uniform aspect ratios on a square image are symmetric: P(w > h) = P(w < h).
    # (A uniform ratio in [3/4, 4/3] would give P(w > h) about 0.57.)
    _, _, h, w = boxes(1000, 1000).T
    wider, taller = np.mean(w > h), np.mean(w < h)
    assert abs(wider - taller) < 0.06
    assert abs(np.mean(np.log(w / h))) < 0.02


def test_crop_fallback_centre_crop_with_clamped_ratio():
    # No try fits a 10x300 strip: torchvision falls back to a centred crop with the
    # aspect ratio clamped to 4/3: h = 10, w = round(10 * 4/3) = 13.
    top, left, h, w = [
        int(v) for v in augment.random_resized_crop_box(tf.constant([1, 2], tf.int64), 10, 300)
    ]
    assert (top, left, h, w) == (0, (300 - 13) // 2, 10, 13)
    top, left, h, w = [
        int(v) for v in augment.random_resized_crop_box(tf.constant([1, 2], tf.int64), 300, 10)
    ]
    assert (top, left, h, w) == ((300 - 13) // 2, 0, round(10 / 0.75), 10)


def run_many(image, n=N):
    image = tf.constant(image)
    seeds = tf.random.experimental.stateless_split(tf.constant([3, 5], tf.int64), n)
    ds = tf.data.Dataset.from_tensor_slices(seeds).map(
        lambda s: augment.train_transform(image, s, size=32), num_parallel_calls=tf.data.AUTOTUNE
    )
    out = np.concatenate([b for b in ds.batch(256).as_numpy_iterator()])
    return out * np.array(augment.IMAGENET_STD) + np.array(augment.IMAGENET_MEAN)


def test_flip_rate_about_half():
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, 32:] = 200  # dark left, bright right
    x = run_many(image)
    flipped = x[:, :, :3].mean(axis=(1, 2, 3)) > x[:, :, -3:].mean(axis=(1, 2, 3))
    assert abs(flipped.mean() - 0.5) < 0.05  # about 4.5 standard errors


def test_grayscale_rate_about_a_tenth():
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, :32, 0] = 220  # red left
    image[:, 32:, 2] = 220  # blue right
    x = run_many(image)
    gray = np.abs(x - x[..., :1]).max(axis=(1, 2, 3)) < 1e-3
    assert abs(gray.mean() - 0.1) < 0.03  # about 4.5 standard errors


def test_brightness_jitter_range():
    # A uniform grey image: only brightness and contrast act; contrast keeps a uniform
    # image's value, so the output value / input value is the brightness factor.
    x = run_many(np.full((40, 40, 3), 128, np.uint8), n=1000)
    factor = x.mean(axis=(1, 2, 3)) / (128 / 255)
    assert factor.min() >= 0.7 - 1e-3 and factor.max() <= 1.3 + 1e-3
    assert factor.min() < 0.72 and factor.max() > 1.28
    assert abs(factor.mean() - 1.0) < 0.02


def test_seeded_and_reproducible():
    image = tf.constant(np.random.default_rng(0).integers(0, 256, (50, 70, 3), np.uint8))
    a = augment.train_transform(image, tf.constant([1, 2], tf.int64), 32).numpy()
    b = augment.train_transform(image, tf.constant([1, 2], tf.int64), 32).numpy()
    c = augment.train_transform(image, tf.constant([1, 3], tf.int64), 32).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert a.shape == (32, 32, 3) and a.dtype == np.float32


def test_eval_transform_is_squash_and_normalisation():
    image = np.zeros((20, 90, 3), np.uint8)
    image[..., 1] = 255
    x = augment.eval_transform(tf.constant(image), 224).numpy()
    assert x.shape == (224, 224, 3)
    np.testing.assert_allclose(x[..., 1], (1 - 0.456) / 0.224, rtol=1e-5)
    np.testing.assert_allclose(x[..., 0], -0.485 / 0.229, rtol=1e-5)
