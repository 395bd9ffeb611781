"""Image transforms in TensorFlow, as DomainBed's torchvision transforms define them.

Training (DomainBed's ``augment_transform``), applied to a decoded uint8 HxWx3 image:

1. ``RandomResizedCrop(224, scale=(0.7, 1), ratio=(3/4, 4/3))`` with torchvision's
   box rule (``random_resized_crop_box``): up to 10 tries of
   ``target_area = H*W*U(scale)``, ``aspect = exp(U(log ratio))``,
   ``w = round(sqrt(target_area*aspect))``, ``h = round(sqrt(target_area/aspect))``
   (round half to even, as Python's ``round``); the first try with ``0 < w <= W`` and
   ``0 < h <= H`` wins, its offset uniform over the valid positions. If none fits,
   a centred crop of the whole image with its aspect ratio clamped into ``ratio``.
   The box is resized to 224x224 (bilinear, antialiased when shrinking, as PIL).
2. Horizontal flip with probability 0.5.
3. ``ColorJitter(0.3, 0.3, 0.3, 0.3)``: brightness, contrast and saturation factors
   ``f ~ U[0.7, 1.3]``, hue shift ``d ~ U[-0.3, 0.3]`` (fraction of the hue circle),
   the four applied in a random order per image, each clipped to [0, 1]:
   brightness ``f*x``; contrast ``f*x + (1-f)*mean(gray(x))``; saturation
   ``f*x + (1-f)*gray(x)``; hue: rotate H in HSV by ``d``.
   ``gray = 0.299 R + 0.587 G + 0.114 B``.
4. ``RandomGrayscale(p=0.1)``: ``gray(x)`` in all three channels.
5. ImageNet normalisation ``(x - mean) / std``.

torchvision applies 1-4 to PIL uint8 images, rounding to integers after each step;
we stay in float32 (differences of at most about 1/255 per step).

Evaluation: resize (squash) to 224x224, bilinear antialiased, then normalisation.

Randomness is stateless: every draw takes a seed tensor of shape [2] (split with
``tf.random.experimental.stateless_split``), so an image's augmentation is a
function of its seed alone.
"""

from __future__ import annotations

import math

import tensorflow as tf

from sagm_jax.data.device_augment import (  # noqa: F401  one definition of the transform's constants
    CROP_RATIO,
    CROP_SCALE,
    FLIP_PROB,
    GRAYSCALE_PROB,
    IMAGENET_MEAN,
    IMAGENET_STD,
    JITTER,
)


def _uniform_int(seed, maxval):
    """Uniform integer in [0, maxval) (maxval a scalar int32 tensor >= 1)."""
    return tf.random.stateless_uniform([], seed, minval=0, maxval=maxval, dtype=tf.int32)


def random_resized_crop_box(
    seed, height, width, scale=CROP_SCALE, ratio=CROP_RATIO, tries: int = 10
):
    """torchvision's ``RandomResizedCrop.get_params``: returns int32 (top, left, h, w)."""
    height = tf.convert_to_tensor(height, tf.int32)
    width = tf.convert_to_tensor(width, tf.int32)
    area_seed, ratio_seed, top_seed, left_seed = tf.unstack(
        tf.random.experimental.stateless_split(seed, 4)
    )
    h_f, w_f = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
    target_area = (
        h_f
        * w_f
        * tf.random.stateless_uniform([tries], area_seed, scale[0], scale[1], dtype=tf.float64)
    )
    aspect = tf.exp(
        tf.random.stateless_uniform(
            [tries], ratio_seed, math.log(ratio[0]), math.log(ratio[1]), dtype=tf.float64
        )
    )
    w = tf.cast(tf.round(tf.sqrt(target_area * aspect)), tf.int32)
    h = tf.cast(tf.round(tf.sqrt(target_area / aspect)), tf.int32)
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)

    # The fallback: centre crop, aspect ratio clamped to [min(ratio), max(ratio)].
    in_ratio = w_f / h_f
    lo, hi = min(ratio), max(ratio)
    fb_w = tf.where(in_ratio > hi, tf.cast(tf.round(h_f * hi), tf.int32), width)
    fb_h = tf.where(in_ratio < lo, tf.cast(tf.round(w_f / lo), tf.int32), height)

    found = tf.reduce_any(fits)
    crop_h = tf.where(found, h[first], fb_h)
    crop_w = tf.where(found, w[first], fb_w)
    top = tf.where(found, _uniform_int(top_seed, height - crop_h + 1), (height - crop_h) // 2)
    left = tf.where(found, _uniform_int(left_seed, width - crop_w + 1), (width - crop_w) // 2)
    return top, left, crop_h, crop_w


def _gray(x):
    return tf.reduce_sum(x * tf.constant([0.299, 0.587, 0.114], x.dtype), axis=-1, keepdims=True)


def _blend(x, other, factor):
    return tf.clip_by_value(factor * x + (1.0 - factor) * other, 0.0, 1.0)


def color_jitter(x, seed, strength: float = JITTER):
    """torchvision ``ColorJitter(s, s, s, s)`` on float RGB in [0, 1] (module doc)."""
    order_seed, factor_seed, hue_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
    order = tf.argsort(tf.random.stateless_uniform([4], order_seed))
    bright, contrast, sat = tf.unstack(
        tf.random.stateless_uniform([3], factor_seed, 1.0 - strength, 1.0 + strength)
    )
    hue = tf.random.stateless_uniform([], hue_seed, -strength, strength)
    ops = [
        lambda y: _blend(y, tf.zeros_like(y), bright),
        lambda y: _blend(y, tf.reduce_mean(_gray(y)), contrast),
        lambda y: _blend(y, _gray(y), sat),
        lambda y: tf.clip_by_value(tf.image.adjust_hue(y, hue), 0.0, 1.0),
    ]
    for k in range(4):
        x = tf.switch_case(order[k], [lambda op=op, y=x: op(y) for op in ops])
        x.set_shape([None, None, 3])
    return x


def normalize(x):
    return (x - tf.constant(IMAGENET_MEAN, tf.float32)) / tf.constant(IMAGENET_STD, tf.float32)


def resize(image, size: int):
    """Bilinear resize of a uint8 image to size x size, as float in [0, 1], antialiased
    as PIL when shrinking. TF's antialiased kernel is ~10x slower than plain bilinear
    and gives the same result (to 0.004/255) when no side shrinks, so it runs only then."""
    shape = tf.shape(image)
    x = tf.cast(image, tf.float32) / 255.0
    shrinks = (shape[0] > size) | (shape[1] > size)
    x = tf.cond(
        shrinks,
        lambda: tf.image.resize(x, [size, size], method="bilinear", antialias=True),
        lambda: tf.image.resize(x, [size, size], method="bilinear"),
    )
    return tf.clip_by_value(x, 0.0, 1.0)


def train_transform(image, seed, size: int = 224):
    """The training augmentation (module doc) of a uint8 HxWx3 image -> float32."""
    crop_seed, flip_seed, jitter_seed, gray_seed = tf.unstack(
        tf.random.experimental.stateless_split(seed, 4)
    )
    shape = tf.shape(image)
    top, left, h, w = random_resized_crop_box(crop_seed, shape[0], shape[1])
    crop = image[top : top + h, left : left + w]
    x = resize(crop, size)
    flip = tf.random.stateless_uniform([], flip_seed) < FLIP_PROB
    x = tf.where(flip, tf.reverse(x, axis=[1]), x)
    x = color_jitter(x, jitter_seed)
    to_gray = tf.random.stateless_uniform([], gray_seed) < GRAYSCALE_PROB
    x = tf.where(to_gray, tf.tile(_gray(x), [1, 1, 3]), x)
    return normalize(x)


def eval_transform(image, size: int = 224):
    """Squash-resize a uint8 HxWx3 image to size x size, then normalise."""
    return normalize(resize(image, size))
