"""Host input cost of image-folder training, before and after the decoded store.

Writes an ImageFolder tree of random-texture JPEGs (4 domains x 7 classes) at a
PACS-like size (227x227) and a photo-like size (640x480) and measures, per size:

* host work per training image, batch 96 (32 per domain x 3 training domains), in
  images per CPU-second of this process (all its threads: "per core"), with the wall
  rate beside it:
  (a) before: ``DomainBedData.train_iterator``, tf.data reading, decoding and augmenting
      on the host (skipped when TensorFlow is not installed);
  (b) after, cached store: ``ImageStore.gather`` of 96 random ids per step (all the host
      does now; the augmentation runs on the accelerator, ``device_augment.py``);
  (c) after, streaming: ``StreamingSource.gather`` of 96 random ids (decoding each time);
* the one-time store build (images/s, wall, with all cores) and the store's size on disk
  per image (stored image + its eval image);
* seconds per evaluation pass over every image: before, tf.data ``eval_iterator`` over
  every environment and split; after, ``eval_images`` over all ids in batches of 128,
  from the store and streaming;
* how far the streaming pixels are from the store's (mean and max absolute difference).

The store's files are in the page cache right after the build, and its pages are mapped
into the process (one gather pass over every id) before timing, as in a training run
after its first epoch; the first touch of a page costs a page fault (on this 2-core VM
the first gather of 96 640x480 images took ~140 ms, later ones ~11 ms). Results print
as Markdown tables.

    python experiments/bench_input.py [--images_per_class 40] [--steps 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
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
BATCH = 96  # 32 per domain x 3 training domains
EVAL_BATCH = 128


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


class Timer:
    """Wall seconds and CPU seconds of this process (all threads) and of its reaped children."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.child = _children_cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        self.child = _children_cpu() - self.child


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def rates(images, timer):
    """'<per CPU-second> (<wall>)' images/s."""
    return f"{images / timer.cpu:,.0f} ({images / timer.wall:,.0f} wall)", images / timer.cpu


def bench_tf_train(ds, steps, warmup):
    it = ds.train_iterator(
        [0, 1, 2], seed=0, batch_per_env=BATCH // 3, process_index=0, process_count=1
    )
    for _ in range(warmup):
        batch = next(it)
    with Timer() as t:
        for _ in range(steps):
            batch = next(it)
    assert batch["image"].shape == (BATCH, 224, 224, 3)
    return t


def bench_gather(source, steps, warmup, touch_all=False):
    rng = np.random.default_rng(0)
    if touch_all:  # map every page of the store once, as the first epoch of a run does
        for start in range(0, len(source), BATCH):
            source.gather(np.arange(start, min(start + BATCH, len(source))))
    for _ in range(warmup):
        source.gather(rng.integers(0, len(source), BATCH))
    with Timer() as t:
        for _ in range(steps):
            images, hw = source.gather(rng.integers(0, len(source), BATCH))
    assert images.shape == (BATCH, *source.canvas, 3) and hw.shape == (BATCH, 2)
    return t


def bench_tf_eval(ds):
    with Timer() as t:
        for env in range(len(ds.env_names)):
            for part in ds.splits[env]:
                for _ in ds.eval_iterator(
                    env, part, batch_size=EVAL_BATCH, process_index=0, process_count=1
                ):
                    pass
    return t


def bench_eval_images(source):
    with Timer() as t:
        for start in range(0, len(source), EVAL_BATCH):
            source.eval_images(np.arange(start, min(start + EVAL_BATCH, len(source))))
    return t


def bench_size(name, width, height, args, cores, have_tf):
    from sagm_jax import data

    row = {"name": name}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "data")
        write_tree(folder, width, height, args.images_per_class)
        tf_data = data.tf_data_source if have_tf else None  # None: the split alone
        ds = data.load(
            "ImageFolder",
            folder,
            trial_seed=0,
            cache_dir=None,
            verify_images=False,
            open_images=tf_data,
        )
        index = ds.folder
        n = sum(len(p) for p in index.paths)
        row["n"] = n
        row["jpeg_kib"] = sum(os.path.getsize(p) for env in index.paths for p in env) / n / 1024
        print(f"{name}: {n} JPEG files, {row['jpeg_kib']:.1f} KiB each on average", flush=True)

        if have_tf:
            row["tf_train"] = rates(args.steps * BATCH, bench_tf_train(ds, args.steps, args.warmup))
            row["tf_eval"] = bench_tf_eval(ds).wall
        with Timer() as t:
            cached = data.open_source(
                index,
                mode="cache",
                cache_dir=os.path.join(tmp, "cache"),
                workers=args.workers or cores,
                progress=False,
            )
        row["build"] = (n / t.wall, n / (t.cpu + t.child))
        row["store_kib"] = cached.nbytes / n / 1024
        row["eval_kib"] = cached.image_size**2 * 3 / 1024
        row["store_train"] = rates(
            args.steps * BATCH, bench_gather(cached, args.steps, args.warmup, touch_all=True)
        )
        row["store_eval"] = bench_eval_images(cached).wall

        streaming = data.open_source(index, mode="stream", progress=False)
        row["stream_train"] = rates(
            args.steps * BATCH, bench_gather(streaming, args.steps, args.warmup)
        )
        row["stream_eval"] = bench_eval_images(streaming).wall
        ids = np.random.default_rng(1).choice(n, min(n, 64), replace=False)
        a, hw = cached.gather(ids)
        b, _ = streaming.gather(ids)
        region = np.concatenate(
            [np.abs(x[:h, :w].astype(int) - y[:h, :w]).ravel() for x, y, (h, w) in zip(a, b, hw)]
        )
        e = np.abs(cached.eval_images(ids).astype(int) - streaming.eval_images(ids))
        row["diff"] = (region.mean(), region.max(), e.mean(), e.max())
        streaming.close()
        del cached
    return row


def print_tables(rows, cores, have_tf, args):
    skipped = "skipped (no TensorFlow)"
    print(f"\nCPU cores available: {cores}; batch {BATCH}, {args.steps} timed steps.")
    print("\nHost work per training image, images/s per CPU-second (wall rate in brackets):\n")
    print("| images | before: tf.data train_iterator | after: store gather | after: streaming |")
    print("|---|---|---|---|")
    for r in rows:
        before = r["tf_train"][0] if have_tf else skipped
        print(f"| {r['name']} | {before} | {r['store_train'][0]} | {r['stream_train'][0]} |")

    print("\nStore build, size, and one evaluation pass over every image:\n")
    print(
        "| images | files | JPEG KiB/img | build img/s wall (per CPU-s) | store KiB/img "
        "(of which eval) | eval pass before: tf.data s | eval pass store s | "
        "eval pass streaming s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        before = f"{r['tf_eval']:.2f}" if have_tf else skipped
        print(
            f"| {r['name']} | {r['n']} | {r['jpeg_kib']:.1f} | {r['build'][0]:,.0f} "
            f"({r['build'][1]:,.0f}) | {r['store_kib']:.0f} ({r['eval_kib']:.0f}) | {before} | "
            f"{r['store_eval']:.2f} | {r['stream_eval']:.2f} |"
        )

    print("\nStreaming vs store pixels (64 images), absolute difference in levels:\n")
    print("| images | stored mean | stored max | eval mean | eval max |")
    print("|---|---|---|---|---|")
    for r in rows:
        m, x, em, ex = r["diff"]
        print(f"| {r['name']} | {m:.2f} | {x} | {em:.2f} | {ex} |")

    print("\nCores of host work to feed one GPU running SAGM (demand = fwd+bwd rate / 2):\n")
    print("| images | path | " + " | ".join(GPU_FWD_BWD_IMAGES_PER_S) + " |")
    print("|---|---|" + "---|" * len(GPU_FWD_BWD_IMAGES_PER_S))
    for r in rows:
        paths = [("store gather", "store_train"), ("streaming", "stream_train")]
        if have_tf:
            paths.insert(0, ("tf.data", "tf_train"))
        for label, key in paths:
            cells = [
                f"{fwd_bwd / 2 / r[key][1]:.2f}" for fwd_bwd in GPU_FWD_BWD_IMAGES_PER_S.values()
            ]
            print(f"| {r['name']} | {label} | " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--images_per_class", type=int, default=40)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=0, help="store build; 0 = all cores")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    have_tf = importlib.util.find_spec("tensorflow") is not None
    if not have_tf:
        print("TensorFlow is not installed: the 'before' (tf.data) figures are skipped.")
    sizes = {"227x227": (227, 227), "640x480": (640, 480)}
    rows = [bench_size(name, w, h, args, cores, have_tf) for name, (w, h) in sizes.items()]
    print_tables(rows, cores, have_tf, args)


if __name__ == "__main__":
    main()
