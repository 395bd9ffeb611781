"""Training-pipeline throughput (images/s) of sagm_jax.data on JPEG files it writes.

Writes an ImageFolder tree of random-texture JPEGs (4 domains x 7 classes) at a
PACS-like size (227x227) and a photo-like size (640x480), opens each with
``sagm_jax.data.load('ImageFolder', ...)`` and times the training iterator (read,
decode, RandomResizedCrop, flip, ColorJitter, grayscale, normalise, batch of
32 per domain x 3 training domains = 96), after a warm-up. Reports images/s
overall and per CPU core, and compares with the demand of one GPU training SAGM on
ResNet-50 (see DEMAND below).

    python experiments/bench_input.py [--images_per_class 40] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from PIL import Image

# Demand (an estimate, stated as such): an A100 trains ResNet-50 at 224x224 with mixed
# precision at about 2,500 images/s fwd+bwd (NVIDIA's published ResNet-50 v1.5 training
# throughput for one A100 80GB is around 2,500-2,700 img/s; an H100 roughly 1.5-2x that).
# SAGM takes two forward+backward passes per image, so one A100 consumes about
# 2,500 / 2 = 1,250 images/s, one H100 about 2,000-2,500 images/s.
GPU_FWD_BWD_IMAGES_PER_S = {"A100": 2500, "H100": 4000}


def write_tree(root, width, height, images_per_class, domains=4, classes=7):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), np.uint8)
    for d in range(domains):
        for c in range(classes):
            folder = os.path.join(root, f"domain{d}", f"class{c}")
            os.makedirs(folder, exist_ok=True)
            for k in range(images_per_class):
                # Smooth texture (upsampled noise) plus grain: JPEG sizes like photos'.
                small = np.roll(base, (k * 3 + c, d * 5 + k), axis=(0, 1))
                big = np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR))
                grain = rng.integers(-12, 13, big.shape)
                image = np.clip(big.astype(np.int16) + grain, 0, 255).astype(np.uint8)
                Image.fromarray(image).save(os.path.join(folder, f"{k}.jpg"), quality=90)


def bench(root, steps, warmup, batch_per_env=32):
    import sagm_jax.data as data

    ds = data.load("ImageFolder", root, trial_seed=0, cache_dir=None)
    it = ds.train_iterator(
        [0, 1, 2], seed=0, batch_per_env=batch_per_env, process_index=0, process_count=1
    )
    batch = None
    for _ in range(warmup):
        batch = next(it)
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
    elapsed = time.perf_counter() - start
    assert batch["image"].shape == (3 * batch_per_env, 224, 224, 3)
    return steps * 3 * batch_per_env / elapsed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--images_per_class", type=int, default=40)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"CPU cores available: {cores}")
    for name, (w, h) in {"PACS-like 227x227": (227, 227), "photo-like 640x480": (640, 480)}.items():
        with tempfile.TemporaryDirectory() as tmp:
            write_tree(tmp, w, h, args.images_per_class)
            rate = bench(tmp, args.steps, args.warmup)
        print(f"{name}: {rate:,.0f} images/s overall, {rate / cores:,.0f} images/s per core")
        for gpu, fwd_bwd in GPU_FWD_BWD_IMAGES_PER_S.items():
            demand = fwd_bwd / 2
            print(
                f"  {gpu} SAGM demand ~{demand:,.0f} images/s -> needs ~{demand / (rate / cores):,.0f} "
                f"cores at this per-core rate"
            )


if __name__ == "__main__":
    main()
