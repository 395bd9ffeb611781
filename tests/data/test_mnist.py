"""RotatedDigits, RotatedMNIST / ColoredMNIST on tfds mock MNIST, and MNIST through tfds's
real builder offline: a tiny MNIST prepared by it, a failed download, a missing package."""

import os
import socket

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


TINY_SIZES = {"train": 12, "test": 6}


def write_idx(path, array: np.ndarray, magic: int):
    """MNIST's IDX file: a big-endian magic number, the dimensions, then the bytes."""
    header = np.array([magic, *array.shape], ">u4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def examples(images, labels) -> list:
    return sorted((image.tobytes(), int(label)) for image, label in zip(images, labels))


@pytest.fixture
def tiny_mnist_download(tmp_path, monkeypatch):
    """The four MNIST files, tiny (12 train and 6 test images), served in place of the
    download: tfds's own ``mnist`` builder does everything else (its download manager,
    generation, tfds's folder format, reading). Returns the images and labels written."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.image_classification import mnist as tfds_mnist

    rng = np.random.RandomState(0)
    written, files = {}, {}
    for split, n in TINY_SIZES.items():
        images = rng.randint(0, 256, (n, 28, 28)).astype(np.uint8)
        labels = rng.randint(0, 10, n).astype(np.uint8)
        files[f"{split}_data"] = tmp_path / f"{split}-images-idx3-ubyte"
        files[f"{split}_labels"] = tmp_path / f"{split}-labels-idx1-ubyte"
        write_idx(files[f"{split}_data"], images, 2051)
        write_idx(files[f"{split}_labels"], labels, 2049)
        written[split] = (images, labels)
    monkeypatch.setattr(tfds_mnist, "_TRAIN_EXAMPLES", TINY_SIZES["train"])
    monkeypatch.setattr(tfds_mnist, "_TEST_EXAMPLES", TINY_SIZES["test"])
    served = []

    def download_and_extract(self, urls):
        served.extend(urls)
        return {key: str(files[key]) for key in urls}

    monkeypatch.setattr(tfds.download.DownloadManager, "download_and_extract", download_and_extract)
    return written, served


def test_mnist_is_prepared_and_read_by_tfds_real_builder(tmp_path, tiny_mnist_download):
    """A broken tensorflow-datasets install (a module it imports missing) fails here."""
    written, served = tiny_mnist_download
    data_dir = str(tmp_path / "tfds")
    images, labels = mnist.load_mnist_uint8(data_dir)  # prepares data_dir, then reads it
    assert sorted(served) == ["test_data", "test_labels", "train_data", "train_labels"]
    assert os.path.exists(os.path.join(data_dir, "mnist", "3.0.1", "dataset_info.json"))
    assert images.dtype == np.uint8 and labels.dtype == np.int64
    # Train then test, each in the order tfds wrote it (tfds shuffles when it prepares).
    start = 0
    for split, n in TINY_SIZES.items():
        assert examples(images[start : start + n], labels[start : start + n]) == examples(
            *written[split]
        )
        start += n
    # Prepared: read again without a download, and as a dataset.
    served.clear()
    again, _ = mnist.load_mnist_uint8(data_dir)
    assert served == [] and np.array_equal(again, images)
    ds = data.load("RotatedMNIST", data_dir, trial_seed=0)
    assert ds.fingerprint["total"] == sum(TINY_SIZES.values())


@pytest.fixture
def no_internet(monkeypatch):
    """Every host name fails to resolve, as on a machine without internet (and tfds tries
    once, not its 10 retries with backoff, about 200 s)."""
    from tensorflow_datasets.core.download import downloader

    monkeypatch.setattr(downloader, "MAX_RETRIES", 0)

    def getaddrinfo(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_failed_download_says_it_needs_the_internet(tmp_path, no_internet):
    data_dir = str(tmp_path / "tfds")
    with pytest.raises(ConnectionError) as raised:
        mnist.load_mnist_uint8(data_dir)
    message = " ".join(str(raised.value).split())
    assert f"MNIST is not prepared in {data_dir}" in message
    assert "Downloading MNIST needs the internet" in message
    assert "`tfds build mnist --data_dir=DIR`" in message and "--config.data_dir=DIR" in message


def test_a_module_tfds_lacks_is_named_as_a_missing_package(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    def download_and_prepare(self, *args, **kwargs):
        # What tensorflow-datasets 4.9.10 raised where importlib_resources was missing.
        raise ModuleNotFoundError(
            "No module named 'importlib_resources'", name="importlib_resources"
        )

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download_and_prepare)
    with pytest.raises(ModuleNotFoundError) as raised:
        mnist.load_mnist_uint8(str(tmp_path / "tfds"))
    message = " ".join(str(raised.value).split())
    assert "needs the Python package 'importlib_resources', and it is not installed" in message
    assert "pip install importlib_resources" in message
    assert "tfds build" not in message and "offline" not in message
