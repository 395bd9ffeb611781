"""RotatedDigits, and RotatedMNIST / ColoredMNIST on tfds mock MNIST."""

import numpy as np
import pytest
from PIL import Image

import sagm_jax.data as data
from sagm_jax.data import mnist


def test_rotated_digits_shapes_labels_envs():
    from sklearn.datasets import load_digits

    ds = data.load("RotatedDigits", None, trial_seed=0)
    assert ds.env_names == ["0", "15", "30", "45", "60", "75"]
    assert ds.num_classes == 10 and ds.input_shape == (28, 28, 1)
    assert ds.env_sizes == [len(range(i, 1797, 6)) for i in range(6)]
    digits = load_digits()
    perm = np.random.RandomState(0).permutation(1797)
    for i in range(6):
        np.testing.assert_array_equal(ds.source.labels[i], digits.target[perm][i::6])
        x = ds.source.images[i]
        assert x.dtype == np.float32 and x.min() >= 0 and x.max() <= 1
    # Environment 0 is unrotated: the upsampled digits themselves.
    first = np.round(digits.images[perm[0]] * 255 / 16).astype(np.uint8)
    up = np.asarray(Image.fromarray(first).resize((28, 28), Image.BILINEAR)) / 255.0
    np.testing.assert_allclose(ds.source.images[0][0, ..., 0], up, atol=1e-6)
    # A rotated environment is rotated: its mass moves, but not its total much.
    assert not np.allclose(ds.source.images[3][0], up[..., None])
    # Splits are DomainBed's rule on each environment.
    for i, parts in enumerate(ds.splits):
        assert sorted(parts["out"]) == sorted(data.holdout_split(ds.env_sizes[i], 0, i)["out"])


def test_rotation_is_counter_clockwise_about_centre():
    image = np.zeros((28, 28), np.uint8)
    image[2:6, 12:16] = 255  # a blob at the top centre
    rotated = mnist.rotate_uint8(image[None], 90)[0]
    ys, xs = np.nonzero(rotated > 128)
    assert xs.mean() < 8 and abs(ys.mean() - 13.5) < 2  # moved to the left edge


@pytest.fixture
def mock_mnist():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=600):
        yield


def test_rotated_mnist_on_mock_data(mock_mnist):
    ds = data.load("RotatedMNIST", None, trial_seed=0)
    assert ds.env_names == ["0", "15", "30", "45", "60", "75"]
    assert ds.input_shape == (28, 28, 1) and ds.num_classes == 10
    assert ds.fingerprint["total"] == 1200  # mock train (600) + test (600)
    raw, labels = mnist.load_mnist_uint8(None)
    perm = np.random.RandomState(0).permutation(len(raw))
    for i in range(6):
        np.testing.assert_array_equal(ds.source.labels[i], labels[perm][i::6])
    np.testing.assert_allclose(ds.source.images[0][..., 0], raw[perm][0::6] / 255.0, atol=1e-6)


def test_colored_mnist_on_mock_data(mock_mnist):
    ds = data.load("ColoredMNIST", None, trial_seed=0)
    assert ds.env_names == ["+90%", "+80%", "-90%"]
    assert ds.input_shape == (28, 28, 2) and ds.num_classes == 2
    raw, digits = mnist.load_mnist_uint8(None)
    perm = np.random.RandomState(0).permutation(len(raw))
    for i, flip_prob in enumerate((0.1, 0.2, 0.9)):
        x, y = ds.source.images[i], ds.source.labels[i]
        d = digits[perm][i::3]
        label_flip = np.mean(y != (d < 5))
        assert abs(label_flip - 0.25) < 0.1  # 400 examples: s.e. about 0.022
        ink = x.reshape(len(x), -1, 2).sum(axis=1)
        has_ink = ink.max(axis=1) > 0
        assert np.all(ink.min(axis=1) == 0)  # one channel always empty
        colour = ink.argmax(axis=1)
        colour_flip = np.mean(colour[has_ink] != y[has_ink])
        assert abs(colour_flip - flip_prob) < 0.1
        np.testing.assert_allclose(x.max(axis=-1), raw[perm][i::3] / 255.0, atol=1e-6)
