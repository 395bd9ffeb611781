"""tf.data pipelines for image-folder datasets: read, decode, augment, batch.

``TFDataSource`` serves a dataset's batches from them (the ``dataset.Source`` of
``config.input='tf'``, and of ``registry.load``'s image folders by default).

Files are read with ``tf.io.read_file`` and decoded with ``tf.io.decode_image`` (RGB,
as torchvision's loader converts to RGB); formats TensorFlow cannot decode (TIFF,
WebP, PPM/PGM, CMYK JPEG; found during the decode check) go through PIL in a
``tf.numpy_function``. Either way the pixels are those of torchvision's loader,
``Image.open(path).convert("RGB")``, 16-bit PNGs included: PIL reads 16-bit RGB,
RGBA and grayscale-with-alpha PNGs as 8-bit by keeping each sample's high byte
(what ``decode_image`` does too), but opens 16-bit grayscale PNGs in mode ``I;16``,
whose ``convert("RGB")`` CLIPS each value to 255 where ``decode_image`` would scale
it (``v // 256``); :func:`decode` clips those as PIL does. Decoding and augmentation
run in parallel and deterministically (``deterministic=True``), so batches do not
depend on timing.

TensorFlow is kept off accelerators (it only feeds the JAX program; on a GPU it would
reserve most of the GPU's memory): :func:`hide_accelerators_from_tensorflow` runs when
this module is imported, and ``sagm_jax.main`` calls it at start-up. It raises if
TensorFlow already initialised its devices with an accelerator visible.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sagm_jax.data import augment as augment_lib

ACCELERATOR_KINDS = ("GPU", "TPU")


def hide_accelerators_from_tensorflow() -> None:
    """Makes TensorFlow's GPUs and TPUs invisible to it, so that it takes none of their
    memory (JAX has them). Call it before any TensorFlow op: TensorFlow fixes its
    visible devices when it first initialises them. Calling it again is harmless, and
    it does nothing where TensorFlow sees no accelerator (``tensorflow-cpu``).

    Raises RuntimeError when it is too late: TensorFlow has already initialised its
    devices with an accelerator visible (and holds memory on it)."""
    for kind in ACCELERATOR_KINDS:
        if not tf.config.list_physical_devices(kind):
            continue
        try:
            tf.config.set_visible_devices([], kind)
        except RuntimeError as error:
            visible = tf.config.get_visible_devices(kind)
            if not visible:
                continue
            names = ", ".join(d.name for d in visible)
            raise RuntimeError(
                f"TensorFlow already initialised its devices with {kind}s visible ({names}), "
                f"so it holds {kind} memory that JAX needs, and they can no longer be hidden "
                f"({error}). Something ran a TensorFlow op before sagm_jax hid them: call "
                "sagm_jax.data.tf_input.hide_accelerators_from_tensorflow() (importing "
                "sagm_jax.data.tf_input calls it) before any TensorFlow op, as sagm_jax.main "
                "does at start-up."
            ) from error


hide_accelerators_from_tensorflow()

AUTOTUNE = tf.data.AUTOTUNE
# The 'step' folded into the seeds of augmented evaluation: beyond any training step.
EVAL_AUGMENT_STEP = 2**62


def _pil_rgb(path: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(path.decode()) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def is_gray16_png(raw):
    """Whether the file bytes ``raw`` are a PNG of 16-bit grayscale samples without
    alpha: its IHDR (always the first chunk) has bit depth 16 (byte 24) and colour
    type 0 (byte 25)."""
    head = tf.strings.join([tf.strings.substr(raw, 0, 26), b"\0" * 26])
    return tf.logical_and(
        tf.equal(tf.strings.substr(head, 0, 8), _PNG_SIGNATURE),
        tf.equal(tf.strings.substr(head, 24, 2), b"\x10\x00"),
    )


def decode(path, needs_pil):
    """uint8 [h, w, 3]: the file at ``path`` as ``Image.open(path).convert("RGB")``
    gives it (module doc); ``needs_pil``: decode with PIL (formats TensorFlow lacks)."""

    def with_tf():
        raw = tf.io.read_file(path)

        def gray16():  # PIL: mode "I;16", convert("RGB") clips to 255
            gray = tf.io.decode_png(raw, channels=1, dtype=tf.uint16)
            return tf.image.grayscale_to_rgb(tf.cast(tf.minimum(gray, 255), tf.uint8))

        def other():
            return tf.io.decode_image(raw, channels=3, dtype=tf.uint8, expand_animations=False)

        return tf.cond(is_gray16_png(raw), gray16, other)

    def with_pil():
        return tf.numpy_function(_pil_rgb, [path], tf.uint8)

    image = tf.cond(needs_pil, with_pil, with_tf)
    image.set_shape([None, None, 3])
    return image


def _tables(index):
    paths = tf.constant([p for env in index.paths for p in env])
    labels = tf.constant(np.concatenate(index.labels).astype(np.int32))
    needs_pil = tf.constant(np.concatenate(index.needs_pil))
    return paths, labels, needs_pil


def _example_seed(seed, a, b):
    """Stateless seed for (run seed, a, b): folds a then b into [seed, 0]."""
    s = tf.constant([seed, 0], tf.int64)
    s = tf.random.experimental.stateless_fold_in(s, a)
    return tf.random.experimental.stateless_fold_in(s, b)


def train_dataset(index, sampler, *, seed, start_step, first_row, rows, image_size):
    """Batches of ``rows`` examples; ``sampler(step)`` gives their flat file ids."""
    paths, labels, needs_pil = _tables(index)

    def step_examples(step):
        ids = tf.numpy_function(
            lambda s: sampler(int(s)).astype(np.int64), [step], tf.int64, stateful=False
        )
        ids.set_shape([rows])
        return tf.data.Dataset.from_tensor_slices(
            {
                "step": tf.fill([rows], step),
                "position": tf.range(first_row, first_row + rows, dtype=tf.int64),
                "id": ids,
            }
        )

    def load(ex):
        image = decode(tf.gather(paths, ex["id"]), tf.gather(needs_pil, ex["id"]))
        image = augment_lib.train_transform(
            image, _example_seed(seed, ex["step"], ex["position"]), image_size
        )
        return {"image": image, "label": tf.gather(labels, ex["id"])}

    ds = tf.data.Dataset.range(start_step, 2**62).flat_map(step_examples)
    ds = ds.map(load, num_parallel_calls=AUTOTUNE, deterministic=True)
    return ds.batch(rows, drop_remainder=True).prefetch(AUTOTUNE)


def eval_dataset(index, ids, mask, position, *, augment: bool, seed: int, image_size):
    """Batches of the rows of ``ids`` ([num_batches, b] flat file ids) with ``mask``."""
    paths, labels, needs_pil = _tables(index)
    rows = ids.shape[1] if ids.ndim == 2 and ids.shape[0] else 1

    def load(ex):
        image = decode(tf.gather(paths, ex["id"]), tf.gather(needs_pil, ex["id"]))
        if augment:
            image = augment_lib.train_transform(
                image, _example_seed(seed, EVAL_AUGMENT_STEP, ex["position"]), image_size
            )
        else:
            image = augment_lib.eval_transform(image, image_size)
        return {"image": image, "label": tf.gather(labels, ex["id"]), "mask": ex["mask"]}

    ds = tf.data.Dataset.from_tensor_slices(
        {
            "id": ids.reshape(-1).astype(np.int64),
            "mask": mask.reshape(-1),
            "position": position.reshape(-1).astype(np.int64),
        }
    )
    ds = ds.map(load, num_parallel_calls=AUTOTUNE, deterministic=True)
    return ds.batch(rows).prefetch(AUTOTUNE)


class TFDataSource:
    """The ``dataset.Source`` of an image folder read by tf.data on the host: the files of
    ``index`` (``image_folder.FolderIndex``) decoded and augmented (or resized for
    evaluation) to ``image_size``, normalised float32 images."""

    def __init__(self, index, image_size: int):
        self.index = index
        self.image_size = int(image_size)

    def train_batches(self, ids_at, positions, *, start_step: int, seed: int):
        """``dataset.Source.train_batches`` (:func:`train_dataset`)."""
        ds = train_dataset(
            self.index,
            ids_at,
            seed=seed,
            start_step=start_step,
            first_row=int(positions[0]),
            rows=len(positions),
            image_size=self.image_size,
        )
        return ds.as_numpy_iterator()

    def eval_batches(self, ids, mask, position, *, augment: bool, seed: int):
        """``dataset.Source.eval_batches`` (:func:`eval_dataset`)."""
        ds = eval_dataset(
            self.index,
            ids,
            mask,
            position,
            augment=augment,
            seed=seed,
            image_size=self.image_size,
        )
        return ds.as_numpy_iterator()
