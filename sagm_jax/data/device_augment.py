"""DomainBed's training augmentation, computed on the accelerator inside the jitted step.

Owns the device side of the image-folder input: the host sends uint8 images on a
zero-padded canvas with each image's true ``(h, w)`` (``store.py``); here each
example, from its own key, gets DomainBed's ``augment_transform`` (torchvision on PIL
images), vmapped over the batch:

1. ``RandomResizedCrop(224, scale=(0.7, 1), ratio=(3/4, 4/3))``, torchvision's box
   rule (``crop_box``): 10 tries of ``area = h*w*U(scale)``, ``r = exp(U(log ratio))``,
   ``cw = round(sqrt(area*r))``, ``ch = round(sqrt(area/r))``; the first try with
   ``0 < cw <= w`` and ``0 < ch <= h`` wins, its offset uniform over the valid
   positions (``randint(0, h-ch+1)``); else the fallback: a centred crop of the whole
   image with its aspect ratio clamped into ``ratio``.
2. The box is resized to ``size x size`` as PIL's antialiased bilinear resize of the
   cropped image does: output pixel ``i`` has centre ``c_i = top + (i + 0.5) * s``
   (``s = ch / size``) and weights ``max(0, 1 - |j + 0.5 - c_i| / max(s, 1))`` over
   the rows ``j`` of the box only, normalised to sum 1 (PIL's ``precompute_coeffs``).
   These are two dense per-example matrices, ``out = Wy @ image @ Wx^T``: matrix
   products, which accelerators run fast, and exactly the crop-then-resize.
3. Horizontal flip with probability 0.5: the rows of ``Wx`` reversed.
4. ``ColorJitter(0.3, 0.3, 0.3, 0.3)`` in a random order of its four operations
   (a uniform permutation), each clipped to [0, 1], torchvision's formulas:
   brightness ``f*x``; contrast ``f*x + (1-f)*mean(gray(x))`` (the mean of the
   GRAYSCALE image); saturation ``f*x + (1-f)*gray(x)``; hue: ``H <- (H + d) mod 1``
   in HSV; ``f ~ U[0.7, 1.3]``, ``d ~ U[-0.3, 0.3]``.
5. ``RandomGrayscale(p=0.1)``: ``gray(x)`` in all three channels.
6. ImageNet normalisation ``(x - mean) / std``.

``gray = 0.299 R + 0.587 G + 0.114 B`` (PIL's ``convert("L")``, which DomainBed's
PIL pipeline uses). torchvision on PIL images rounds to uint8 after each operation;
we stay in float32 (differences of about 1/255 per operation).

Keys: example ``p`` of the global batch at step ``t`` of a run with seed ``s`` uses
``fold_in(fold_in(fold_in(key(s), TRAIN_STREAM), t), p)``, so a batch is a function of
``(s, t)`` alone (exact resume) and does not depend on how the batch is sharded.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_SCALE = (0.7, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
JITTER = 0.3
FLIP_PROB = 0.5
GRAYSCALE_PROB = 0.1
GRAY_WEIGHTS = (0.299, 0.587, 0.114)
# Key streams folded into the run's seed: training batches, augmented validation.
TRAIN_STREAM, EVAL_STREAM = 0x5A61, 0x5A62


# ---- parameters ------------------------------------------------------------------
def crop_box(key, height, width, scale=CROP_SCALE, ratio=CROP_RATIO, tries: int = 10):
    """torchvision's ``RandomResizedCrop.get_params`` for an image of ``height x width``
    (int32 scalars): returns int32 ``(top, left, crop_h, crop_w)``."""
    area_key, ratio_key, top_key, left_key = jax.random.split(key, 4)
    h_f, w_f = height.astype(jnp.float32), width.astype(jnp.float32)
    area = h_f * w_f * jax.random.uniform(area_key, (tries,), minval=scale[0], maxval=scale[1])
    log_r = jax.random.uniform(
        ratio_key, (tries,), minval=math.log(ratio[0]), maxval=math.log(ratio[1])
    )
    aspect = jnp.exp(log_r)
    cw = jnp.round(jnp.sqrt(area * aspect)).astype(jnp.int32)
    ch = jnp.round(jnp.sqrt(area / aspect)).astype(jnp.int32)
    fits = (cw > 0) & (cw <= width) & (ch > 0) & (ch <= height)
    first = jnp.argmax(fits)
    found = jnp.any(fits)

    in_ratio = w_f / h_f
    lo, hi = min(ratio), max(ratio)
    fb_w = jnp.where(in_ratio > hi, jnp.round(h_f * hi).astype(jnp.int32), width)
    fb_h = jnp.where(in_ratio < lo, jnp.round(w_f / lo).astype(jnp.int32), height)

    crop_h = jnp.where(found, ch[first], fb_h)
    crop_w = jnp.where(found, cw[first], fb_w)
    top = jnp.where(
        found, jax.random.randint(top_key, (), 0, height - crop_h + 1), (height - crop_h) // 2
    )
    left = jnp.where(
        found, jax.random.randint(left_key, (), 0, width - crop_w + 1), (width - crop_w) // 2
    )
    return top, left, crop_h, crop_w


def draw_params(key, height, width) -> dict:
    """Every random choice of one example's augmentation (module doc)."""
    crop_key, flip_key, order_key, factor_key, hue_key, gray_key = jax.random.split(key, 6)
    top, left, crop_h, crop_w = crop_box(crop_key, height, width)
    return {
        "box": jnp.stack([top, left, crop_h, crop_w]),
        "flip": jax.random.uniform(flip_key) < FLIP_PROB,
        "order": jax.random.permutation(order_key, 4),
        # brightness, contrast, saturation
        "factors": jax.random.uniform(factor_key, (3,), minval=1 - JITTER, maxval=1 + JITTER),
        "hue": jax.random.uniform(hue_key, minval=-JITTER, maxval=JITTER),
        "gray": jax.random.uniform(gray_key) < GRAYSCALE_PROB,
    }


# ---- pixels ----------------------------------------------------------------------
def resize_weights(start, length, in_size: int, out_size: int):
    """[out_size, in_size] float32: PIL's antialiased bilinear weights that resize the
    pixels ``[start, start + length)`` of an axis of ``in_size`` to ``out_size``."""
    scale = length.astype(jnp.float32) / out_size
    support = jnp.maximum(scale, 1.0)
    centre = start.astype(jnp.float32) + (jnp.arange(out_size, dtype=jnp.float32) + 0.5) * scale
    j = jnp.arange(in_size, dtype=jnp.float32)
    w = jnp.maximum(0.0, 1.0 - jnp.abs(j[None, :] + 0.5 - centre[:, None]) / support)
    inside = (j >= start) & (j < start + length)
    w = jnp.where(inside[None, :], w, 0.0)
    return w / jnp.sum(w, axis=1, keepdims=True)


def gray(x):
    return jnp.tensordot(x, jnp.asarray(GRAY_WEIGHTS, x.dtype), axes=[[-1], [0]])[..., None]


def _blend(x, other, factor):
    return jnp.clip(factor * x + (1.0 - factor) * other, 0.0, 1.0)


def rgb_to_hsv(x):
    """torchvision's ``_rgb2hsv`` on float RGB in [0, 1]; H, S, V in [0, 1]."""
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    maxc, minc = jnp.max(x, axis=-1), jnp.min(x, axis=-1)
    eqc = maxc == minc
    cr = maxc - minc
    s = cr / jnp.where(eqc, 1.0, maxc)
    cr_div = jnp.where(eqc, 1.0, cr)
    rc, gc, bc = (maxc - r) / cr_div, (maxc - g) / cr_div, (maxc - b) / cr_div
    hr = jnp.where(maxc == r, bc - gc, 0.0)
    hg = jnp.where((maxc == g) & (maxc != r), 2.0 + rc - bc, 0.0)
    hb = jnp.where((maxc != g) & (maxc != r), 4.0 + gc - rc, 0.0)
    h = jnp.mod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return jnp.stack([h, s, maxc], axis=-1)


def hsv_to_rgb(x):
    """torchvision's ``_hsv2rgb``."""
    h, s, v = x[..., 0], x[..., 1], x[..., 2]
    i = jnp.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.astype(jnp.int32) % 6
    p = jnp.clip(v * (1.0 - s), 0.0, 1.0)
    q = jnp.clip(v * (1.0 - s * f), 0.0, 1.0)
    t = jnp.clip(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
    table = jnp.stack(
        [
            jnp.stack([v, q, p, p, t, v], -1),
            jnp.stack([t, v, v, q, p, p], -1),
            jnp.stack([p, p, t, v, v, q], -1),
        ],
        axis=-2,
    )  # [..., 3, 6]
    return jnp.take_along_axis(table, i[..., None, None], axis=-1)[..., 0]


def adjust_hue(x, shift):
    hsv = rgb_to_hsv(x)
    hsv = hsv.at[..., 0].set(jnp.mod(hsv[..., 0] + shift, 1.0))
    return jnp.clip(hsv_to_rgb(hsv), 0.0, 1.0)


def color_jitter(x, order, factors, hue):
    """The four ColorJitter operations on float RGB in [0, 1], in ``order`` (0 brightness,
    1 contrast, 2 saturation, 3 hue).

    Under ``vmap`` a switch on a per-example index computes every branch, so the
    costly hue rotation is applied once, between the cheap operations that precede it
    and those that follow it (same composition, a quarter of the hue work)."""
    cheap = (
        lambda y: _blend(y, 0.0, factors[0]),
        lambda y: _blend(y, jnp.mean(gray(y)), factors[1]),
        lambda y: _blend(y, gray(y), factors[2]),
    )
    hue_at = jnp.argmax(order == 3)
    others = order[jnp.argsort(order == 3, stable=True)[:3]]  # order without hue, kept in order
    for j in range(3):
        x = jnp.where(j < hue_at, jax.lax.switch(others[j], cheap, x), x)
    x = adjust_hue(x, hue)
    for j in range(3):
        x = jnp.where(j >= hue_at, jax.lax.switch(others[j], cheap, x), x)
    return x


def normalize(x):
    return (x - jnp.asarray(IMAGENET_MEAN, x.dtype)) / jnp.asarray(IMAGENET_STD, x.dtype)


def augment_pixels(image_u8, params, size: int = 224):
    """One canvas ``[H, W, 3]`` uint8 and its parameters -> float RGB in [0, 1]
    ``[size, size, 3]``, before normalisation (module doc, steps 1-5)."""
    top, left, crop_h, crop_w = params["box"]
    wy = resize_weights(top, crop_h, image_u8.shape[0], size)
    wx = resize_weights(left, crop_w, image_u8.shape[1], size)
    wx = jnp.where(params["flip"], wx[::-1], wx)
    x = image_u8.astype(jnp.float32) / 255.0
    # Full float32 products: TF32 (GPUs) or bfloat16 passes (TPUs) would add ~1/255.
    exact = jax.lax.Precision.HIGHEST
    x = jnp.einsum("ih,hwc->iwc", wy, x, precision=exact)
    x = jnp.clip(jnp.einsum("jw,iwc->ijc", wx, x, precision=exact), 0.0, 1.0)
    x = color_jitter(x, params["order"], params["factors"], params["hue"])
    return jnp.where(params["gray"], jnp.broadcast_to(gray(x), x.shape), x)


def example_keys(seed: int, stream: int, step, positions):
    """One key per example from (seed, stream, step, position): module doc."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), step)
    return jax.vmap(lambda p: jax.random.fold_in(key, p))(positions)


def augment_batch(keys, images_u8, hw, size: int = 224):
    """Training inputs: ``[B, H, W, 3]`` uint8 canvases with true sizes ``hw`` [B, 2]
    -> normalised float32 ``[B, size, size, 3]``."""

    def one(key, image, shape):
        params = draw_params(key, shape[0], shape[1])
        return normalize(augment_pixels(image, params, size))

    return jax.vmap(one)(keys, images_u8, hw)


def model_inputs(batch: dict, seed: int, step, size: int = 224, stream: int = TRAIN_STREAM):
    """The batch a model takes, from the batch the host sent (inside jit):

    - ``hw`` present: uint8 canvases, augmented here (keys from ``seed``, ``stream``,
      ``step`` and ``batch['position']``);
    - uint8 ``image`` without ``hw``: evaluation images, normalised;
    - float ``image`` (in-memory datasets, the tf.data path): unchanged.
    """
    image = batch["image"]
    if "hw" in batch:
        keys = example_keys(seed, stream, step, batch["position"])
        image = augment_batch(keys, image, batch["hw"], size)
    elif image.dtype == jnp.uint8:
        image = normalize(image.astype(jnp.float32) / 255.0)
    rest = {k: v for k, v in batch.items() if k not in ("image", "hw", "position")}
    return {"image": image, **rest}
