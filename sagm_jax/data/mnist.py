"""The in-memory datasets: RotatedMNIST, ColoredMNIST (DomainBed) and RotatedDigits.

DomainBed's MNIST environments: MNIST's 60k train and 10k test images concatenated
(train first), shuffled, and environment ``i`` of ``n`` takes ``images[i::n]``.
DomainBed shuffles with ``torch.randperm`` under its global torch seed; we cannot
replay torch's generator without torch, so we shuffle with
``np.random.RandomState(data_seed).permutation`` (deviation: same rule, different
permutation). Images are float32 in [0, 1], HxWxC.

* RotatedMNIST: environments rotate by 0, 15, 30, 45, 60, 75 degrees, with
  torchvision's ``rotate`` on the PIL image: counter-clockwise about the centre,
  same size, fill 0. Current DomainBed asks for bilinear interpolation (older
  versions bicubic); we call PIL's ``Image.rotate(angle, BILINEAR, fillcolor=0)``,
  which is what torchvision's PIL path runs. 28x28x1, 10 classes.
* ColoredMNIST: environments with colour-flip probability 0.1, 0.2, 0.9 (names
  '+90%', '+80%', '-90%'). label = (digit < 5), flipped with probability 0.25;
  colour = label, flipped with the environment's probability; the image is put in
  channel ``colour`` of two (the other channel zero). 28x28x2, 2 classes. The coin
  flips use ``np.random.RandomState(data_seed + 1)`` (DomainBed: torch.rand).
* RotatedDigits (offline demo): scikit-learn's ``load_digits`` (1,797 8x8 images,
  values 0..16) scaled to 0..255, upsampled to 28x28 (PIL bilinear), then built as
  RotatedMNIST: seeded shuffle, ``images[i::6]``, rotations 0..75 degrees.
  28x28x1, 10 classes.

Each is an ``ArraySource``: the arrays, and the ``dataset.Source`` that serves them.

MNIST comes from tfds's ``mnist`` builder (downloaded to ``data_dir`` where there is
internet, else read from a ``data_dir`` prepared elsewhere); a failed download says it
needs the internet, and a module tfds lacks is named as a missing package.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

ROTATIONS = (0, 15, 30, 45, 60, 75)
COLOR_FLIP_PROBS = (0.1, 0.2, 0.9)
COLOR_ENV_NAMES = ("+90%", "+80%", "-90%")
LABEL_FLIP_PROB = 0.25


@dataclasses.dataclass
class ArraySource:
    """Per-environment images (float32 [N, H, W, C] in [0, 1]) and int32 labels; the
    ``dataset.Source`` of the in-memory datasets (rows indexed in NumPy, never augmented)."""

    env_names: list[str]
    images: list[np.ndarray]
    labels: list[np.ndarray]
    num_classes: int

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(images, int32 labels) of flat ids (environment 0's rows, then 1's, ...)."""
        ids = np.asarray(ids)
        offsets = np.cumsum([0] + [len(y) for y in self.labels])
        env = np.searchsorted(offsets, ids, side="right") - 1
        images = np.empty((len(ids), *self.images[0].shape[1:]), self.images[0].dtype)
        labels = np.empty(len(ids), np.int32)
        for e in np.unique(env):
            rows = env == e
            images[rows] = self.images[e][ids[rows] - offsets[e]]
            labels[rows] = self.labels[e][ids[rows] - offsets[e]]
        return images, labels

    def train_batches(self, ids_at, positions, *, start_step: int, seed: int):
        """``dataset.Source.train_batches``: the rows of ``ids_at(step)``, not augmented."""
        del positions, seed  # no augmentation
        for step in itertools.count(start_step):
            images, labels = self.take(ids_at(step))
            yield {"image": images, "label": labels}

    def eval_batches(self, ids, mask, position, *, augment: bool, seed: int):
        """``dataset.Source.eval_batches``: the rows of each row of ``ids``, not augmented."""
        del position, augment, seed  # no augmentation
        for row_ids, row_mask in zip(ids, mask):
            images, labels = self.take(row_ids)
            yield {"image": images, "label": labels, "mask": row_mask}


def load_mnist_uint8(data_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
    """MNIST train then test: uint8 [70000, 28, 28] and int64 labels (via tfds)."""
    try:
        import tensorflow_datasets as tfds

        builder = tfds.builder("mnist", data_dir=data_dir)
    except ImportError as e:
        raise missing_package(e) from e
    try:
        builder.download_and_prepare()  # returns at once where data_dir holds MNIST
    except ImportError as e:
        raise missing_package(e) from e
    except Exception as e:
        if not _is_network_error(e):
            raise _load_failed(data_dir, e) from e
        raise ConnectionError(
            f"MNIST is not prepared in {builder.data_dir} and tensorflow-datasets could not "
            f"download it: {e}\nDownloading MNIST needs the internet. Offline, prepare it "
            "on a machine with internet (`tfds build mnist --data_dir=DIR`), copy DIR here "
            "and pass --config.data_dir=DIR. The dataset 'RotatedDigits' runs offline."
        ) from e
    try:
        splits = builder.as_dataset(split=["train", "test"], as_supervised=True)
    except ImportError as e:
        raise missing_package(e) from e
    except Exception as e:
        raise _load_failed(data_dir, e) from e
    images, labels = [], []
    for split in splits:  # train, then test, as DomainBed concatenates them
        for x, y in split.batch(10_000).as_numpy_iterator():
            images.append(x[..., 0])
            labels.append(y)
    images, labels = np.concatenate(images), np.concatenate(labels)
    return images.astype(np.uint8), labels.astype(np.int64)


def missing_package(error: ImportError) -> ModuleNotFoundError:
    """A missing module named as a missing package of the install, not as missing data."""
    name = error.name or str(error)
    return ModuleNotFoundError(
        f"The MNIST datasets load through tensorflow-datasets, which needs the Python "
        f"package '{name}', and it is not installed ({error}). Install sagm_jax's "
        f"dependencies again (`pip install -e .` declares it) or `pip install {name}`.",
        name=error.name,
    )


def _is_network_error(error: BaseException) -> bool:
    """Whether ``error`` or an exception it came from is a failed connection (no
    internet, a name that does not resolve, a timeout)."""
    import socket

    import requests

    kinds = (
        ConnectionError,
        TimeoutError,
        socket.gaierror,
        requests.ConnectionError,
        requests.Timeout,
    )
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _load_failed(data_dir: str | None, error: Exception) -> FileNotFoundError:
    return FileNotFoundError(
        f"Could not load MNIST through tensorflow-datasets (data_dir={data_dir!r}): {error}\n"
        "tfds downloads MNIST on first use where there is internet; offline, prepare it "
        "elsewhere with `tfds build mnist --data_dir=DIR` and copy DIR here. "
        "Use the dataset 'RotatedDigits' for an offline demo."
    )


def shuffle_into_envs(images, labels, n_envs: int, data_seed: int):
    perm = np.random.RandomState(data_seed).permutation(len(images))
    images, labels = images[perm], labels[perm]
    return [(images[i::n_envs], labels[i::n_envs]) for i in range(n_envs)]


def rotate_uint8(images: np.ndarray, angle: float) -> np.ndarray:
    """Rotate each uint8 HxW image by ``angle`` degrees (counter-clockwise), fill 0."""
    from PIL import Image

    if angle == 0:
        return images.copy()
    return np.stack(
        [
            np.asarray(Image.fromarray(im).rotate(angle, Image.BILINEAR, fillcolor=0))
            for im in images
        ]
    )


def rotated(pairs, angles) -> ArraySource:
    images = [
        rotate_uint8(im, a).astype(np.float32)[..., None] / 255.0
        for (im, _), a in zip(pairs, angles)
    ]
    labels = [y.astype(np.int32) for _, y in pairs]
    return ArraySource([str(a) for a in angles], images, labels, 10)


def rotated_mnist(data_dir: str | None, data_seed: int = 0) -> ArraySource:
    images, labels = load_mnist_uint8(data_dir)
    return rotated(shuffle_into_envs(images, labels, len(ROTATIONS), data_seed), ROTATIONS)


def color_environment(
    images: np.ndarray, digits: np.ndarray, flip_prob: float, rng: np.random.RandomState
):
    """DomainBed's ``color_dataset`` for one environment: (float32 [N,28,28,2], labels)."""
    labels = (digits < 5).astype(np.int32)
    labels ^= (rng.rand(len(labels)) < LABEL_FLIP_PROB).astype(np.int32)
    colors = labels ^ (rng.rand(len(labels)) < flip_prob).astype(np.int32)
    x = np.zeros(images.shape + (2,), np.float32)
    x[np.arange(len(images)), :, :, colors] = images.astype(np.float32) / 255.0
    return x, labels


def colored_mnist(data_dir: str | None, data_seed: int = 0) -> ArraySource:
    images, digits = load_mnist_uint8(data_dir)
    pairs = shuffle_into_envs(images, digits, len(COLOR_FLIP_PROBS), data_seed)
    rng = np.random.RandomState(data_seed + 1)
    envs = [color_environment(im, y, p, rng) for (im, y), p in zip(pairs, COLOR_FLIP_PROBS)]
    return ArraySource(list(COLOR_ENV_NAMES), [x for x, _ in envs], [y for _, y in envs], 2)


def rotated_digits(data_dir: str | None = None, data_seed: int = 0) -> ArraySource:
    """RotatedDigits (module doc); ``data_dir`` is unused (the data ship with scikit-learn)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = np.stack(
        [np.asarray(Image.fromarray(im).resize((28, 28), Image.BILINEAR)) for im in small]
    )
    pairs = shuffle_into_envs(images, digits.target.astype(np.int64), len(ROTATIONS), data_seed)
    return rotated(pairs, ROTATIONS)
