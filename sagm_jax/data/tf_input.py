"""tf.data pipelines for image-folder datasets: read, decode, augment, batch.

Files are read with ``tf.io.read_file`` and decoded with ``tf.io.decode_image`` (RGB,
as torchvision's loader converts to RGB); formats TensorFlow cannot decode (TIFF,
WebP, PPM/PGM, CMYK JPEG; found during the decode check) go through PIL in a
``tf.numpy_function``. Decoding and augmentation run in parallel and
deterministically (``deterministic=True``), so batches do not depend on timing.
TensorFlow is kept off accelerators: it only feeds the JAX program.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sagm_jax.data import augment as augment_lib

try:
    tf.config.set_visible_devices([], "GPU")
except RuntimeError:  # TF already initialised its devices elsewhere; nothing to do.
    pass

AUTOTUNE = tf.data.AUTOTUNE
# The 'step' folded into the seeds of augmented evaluation: beyond any training step.
EVAL_AUGMENT_STEP = 2**62


def _pil_rgb(path: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(path.decode()) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def decode(path, needs_pil):
    def with_tf():
        return tf.io.decode_image(
            tf.io.read_file(path), channels=3, dtype=tf.uint8, expand_animations=False
        )

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
