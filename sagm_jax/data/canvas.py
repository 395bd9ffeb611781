"""Image folders served as canvases: which store holds a folder's images, and the source.

Owns the choice between the three ways a folder is held (``open_source``: the decoded store
of ``store.py``, the compressed store of ``jpeg_store.py``, or ``streaming.py``'s decode) and
``CanvasSource``, the ``dataset.Source`` that serves any of them (uint8 canvases for the
augmentation on the accelerator, ``device_augment.py``; the evaluation images). It sits
above the store modules and streaming, so none of them imports its user. No TensorFlow here.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil

import numpy as np

from sagm_jax.data import jpeg_store, store
from sagm_jax.data.build import locate
from sagm_jax.data.decode import flat_paths, read_sizes
from sagm_jax.data.image_folder import cache_folder
from sagm_jax.data.streaming import StreamingSource

log = logging.getLogger(__name__)

MODES = ("auto", "cache", "compressed", "stream")


class CanvasSource:
    """The ``dataset.Source`` of an image folder served from decoded ``images`` (an
    ``ImageStore`` or a ``StreamingSource``) with the int32 ``labels`` of its flat ids:
    the host only gathers uint8 rows, and the augmentation runs on the accelerator
    (``device_augment.py``, keyed by each example's position in the global batch).
    Training batches carry ``{'image': uint8 canvases, 'hw', 'label', 'position'}``;
    evaluation batches the decoded uint8 evaluation images."""

    def __init__(self, images: store.ImageStore | StreamingSource, labels: np.ndarray):
        self.images = images
        self.labels = np.asarray(labels, np.int32)

    @classmethod
    def open(cls, index, image_size: int, **options) -> CanvasSource:
        """The folder ``index``'s images through ``open_source(index, image_size=image_size,
        **options)``."""
        images = open_source(index, image_size=image_size, **options)
        return cls(images, np.concatenate(index.labels))

    def train_batches(self, ids_at, positions, *, start_step: int, seed: int):
        """``dataset.Source.train_batches``; ``seed`` is the device augmentation's."""
        del seed
        for step in itertools.count(start_step):
            ids = ids_at(step)
            images, hw = self.images.gather(ids)
            yield {"image": images, "hw": hw, "label": self.labels[ids], "position": positions}

    def eval_batches(self, ids, mask, position, *, augment: bool, seed: int):
        """``dataset.Source.eval_batches``: the evaluation images; with ``augment``,
        canvases for the device augmentation keyed by the example's position in the split."""
        del seed
        for row_ids, row_mask, row_position in zip(ids, mask, position):
            batch = {"label": self.labels[row_ids], "mask": row_mask}
            if augment:
                batch["image"], batch["hw"] = self.images.gather(row_ids)
                batch["position"] = row_position.astype(np.int32)
            else:
                batch["image"] = self.images.eval_images(row_ids)
            yield batch


def open_source(
    index,
    *,
    image_size: int = 224,
    short_side: int = 320,
    mode: str = "auto",
    budget_gb: float = 64.0,
    cache_dir: str | None = None,
    workers: int | None = None,
    progress: bool = True,
):
    """The images of the folder ``index`` as a ``store.ImageStore``, a
    ``jpeg_store.CompressedStore`` or a ``streaming.StreamingSource`` (one interface:
    ``gather``, ``eval_images``, ``len``, ``close``).

    mode 'cache': build (or reuse) the decoded store; 'compressed': build (or reuse) the
    compressed store (``jpeg_store``); 'stream': a StreamingSource; 'auto': in this order,

    1. a valid existing decoded store, whatever its size;
    2. the decoded store, if its estimated size (from the images' header sizes, stored
       shapes, plus the eval images: ``store.estimate_store_bytes``) fits ``budget_gb`` GiB and
       the free disk;
    3. else a valid existing compressed store, whatever its size; else a new one if its
       estimate (``jpeg_store.estimate_bytes``: measured bytes per stored pixel) fits both;
    4. else streaming.

    Each choice is logged with the sizes behind it. The compressed store is held to the
    same budget as the decoded one: ``budget_gb`` is what a store may take on disk.
    'cache' and 'compressed' raise OSError when the disk has too little free space.
    cache_dir: the cache root (None: the default, ``image_folder.cache_folder``), under a
    'stores' sub-folder. workers: decoding processes of a build (None = the usable CPU
    cores; 1 = decode in this process)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if image_size < 1 or short_side < 1:
        raise ValueError(f"image_size and short_side must be >= 1, got {image_size}, {short_side}")
    if mode == "stream":
        paths = flat_paths(index)
        sizes = read_sizes(paths, progress=progress)
        return StreamingSource(paths, sizes, image_size=image_size, short_side=short_side)

    stores_dir = cache_folder("stores", cache_dir)
    os.makedirs(stores_dir, exist_ok=True)
    options = {"image_size": image_size, "short_side": short_side, "workers": workers}
    if mode == "compressed":
        return jpeg_store.open_store(index, stores_dir=stores_dir, progress=progress, **options)
    paths, key, final = locate(index, image_size, short_side, stores_dir, store.KIND)
    reused = store.open_existing(
        stores_dir, final, index.root, key, len(paths), image_size, short_side
    )
    if reused is not None:
        return reused

    sizes = read_sizes(paths, progress=progress)
    need = store.estimate_store_bytes(sizes, image_size, short_side)
    if _too_big_to_store(index.root, stores_dir, need, mode=mode, budget_gb=budget_gb):
        return _compressed_or_streaming(
            index, paths, sizes, stores_dir, options, budget_gb=budget_gb, progress=progress
        )
    log.info("Decoding %d images of %s once into %s.", len(paths), index.root, final)
    return store.build(index, paths, sizes, key, final, progress=progress, **options)


def _compressed_or_streaming(index, paths, sizes, stores_dir, options, *, budget_gb, progress):
    """'auto' past the decoded store: a valid existing compressed store, whatever its size;
    else a new one if its estimate fits ``budget_gb`` and the free disk; else streaming.
    ``options``: the stores' ``image_size``, ``short_side`` and ``workers``."""
    image_size, short_side = options["image_size"], options["short_side"]
    found = jpeg_store.open_existing(
        index, image_size=image_size, short_side=short_side, stores_dir=stores_dir
    )
    if found is not None:  # like a decoded store, used whatever its size
        log.info("Using the existing compressed store %s.", found.path)
        return found
    compressed = jpeg_store.estimate_bytes(sizes, image_size, short_side)
    free = shutil.disk_usage(stores_dir).free
    if compressed <= min(budget_gb * 2**30, free):
        log.info(
            "Using the compressed store for %s: it is estimated at %.1f GiB (%.2f bytes "
            "per stored pixel), within the budget and the free space.",
            index.root,
            compressed / 2**30,
            jpeg_store.BYTES_PER_PIXEL,
        )
        return jpeg_store.build(
            index, sizes=sizes, stores_dir=stores_dir, progress=progress, **options
        )
    log.info(
        "Streaming %s: the compressed store would take about %.1f GiB too (budget %.1f "
        "GiB, %.1f GiB free in %s).",
        index.root,
        compressed / 2**30,
        budget_gb,
        free / 2**30,
        stores_dir,
    )
    return StreamingSource(paths, sizes, image_size=image_size, short_side=short_side)


def _too_big_to_store(root, stores_dir, need: int, *, mode: str, budget_gb: float) -> bool:
    """Whether 'auto' passes over (logged) a decoded store of ``need`` bytes; OSError if no room."""
    free = shutil.disk_usage(stores_dir).free
    if mode == "auto" and (need > budget_gb * 2**30 or need > free):
        log.info(
            "Not decoding %s into a store: it would take %.1f GiB (budget %.1f GiB, %.1f GiB "
            "free in %s).",
            root,
            need / 2**30,
            budget_gb,
            free / 2**30,
            stores_dir,
        )
        return True
    if need > free:
        raise OSError(
            f"The decoded store of {root} needs {need / 2**30:.1f} GiB but {stores_dir} "
            f"has {free / 2**30:.1f} GiB free; free space, set cache_dir elsewhere, or stream."
        )
    return False
