"""The decoded image store: each image of a folder decoded ONCE with PIL into uint8 files.

Owns the host side of the image-folder input for on-accelerator augmentation
(``device_augment.py``): the host only gathers uint8 images onto a zero-padded canvas
with each image's true ``(h, w)``, and the evaluation images; ``canvas.CanvasSource``
serves a dataset's batches from them (the ``dataset.Source`` of ``config.input='device'``). No
TensorFlow here.

Decoding is torchvision's loader, ``Image.open(path).convert("RGB")``, so the pixels
equal the reference's. From the full-resolution image, one pass makes:

* the stored image: kept byte-for-byte when its shorter side is at most ``short_side``
  (PACS's 227x227), else shrunk with PIL's antialiased ``resize(..., BILINEAR)`` so the
  shorter side is ``short_side`` (``decode.stored_shape``). With the default 320, every crop
  that ``RandomResizedCrop(scale=(0.7, 1), ratio=(3/4, 4/3))`` draws is still at least
  sqrt(0.7 * 320 * 320 * 3/4) = 232 px on both sides, so it is shrunk to 224, never
  enlarged;
* the evaluation image: ``resize((S, S), BILINEAR)`` of the full image, what
  torchvision's ``Resize((S, S))`` does on PIL images.

Layout of a store, ``<cache root>/stores/<key>/`` (``image_folder.cache_folder``):
``pixels.u8`` (every stored image's rows, flat, in flat id order: environment 0's
files, then 1's, ... as in ``FolderIndex.paths``), ``offsets.npy`` (int64 [N+1] byte
offsets into it), ``shapes.npy`` (int32 [N, 2] stored (h, w)), ``eval.u8`` (uint8
[N, S, S, 3]) and ``manifest.json`` (format, key, N, canvas, each data file's byte
size and CRC-32), written last. ``key`` is the SHA-256 over the format version, ``image_size``,
``short_side`` and every file's (relative path, size, mtime_ns), so a changed dataset
gets a new store (the old one is reported, not used).

Build: image headers are read first (``Image.open(p).size``, no decode) for the shapes
and offsets; the data files are allocated, then worker processes decode contiguous chunks
of files and write them straight into the memory-mapped files. The build, its worker
processes (spawned, so a parent that already runs JAX threads is safe; they die with the
building process), the atomic rename into place (when two processes build at once, the
first rename wins and the other uses that store and deletes its own) and the removal of
folders that killed builds left are ``build.py``'s, shared with the compressed store; the
decoding of one file is ``decode.py``'s.

Open: the manifest, the data files' sizes and their CRC-32 are checked every time; a
store that fails (no manifest, truncated, changed bytes) is logged with the reason and
rebuilt, never used. Cost of the full check, measured on this project's 2-core build
machine on a 1.5 GiB file in the page cache: ``zlib.crc32`` over 16 MiB chunks 0.57 s
(2.7 GB/s), ``hashlib.file_digest`` SHA-256 1.05 s, BLAKE2b 1.94 s, the bare read
0.15 s; CRC-32 is used (it finds truncation and flipped bytes; no adversary here).
A cold read is bounded by the disk instead (about 1-3 s per GB on a local SSD), and it
also warms the page cache the training then reads from.

Where the decoded store is over budget (DomainNet), ``jpeg_store.CompressedStore`` keeps
the same images as JPEG records in a few large files (decoded once from the originals as
here, re-encoded at quality 95 or kept as their original bytes) and decodes them at each
use; ``streaming.StreamingSource`` decodes the original files on every call, for datasets
too big for either store. ``canvas.open_source`` chooses between the kinds (its doc).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np

from sagm_jax.data.build import (
    MANIFEST,
    StoreError,
    check_data_files,
    job_plan,
    new_build_folder,
    open_existing_store,
    read_manifest,
    rename_into_place,
    run_decode_jobs,
    write_manifest,
)
from sagm_jax.data.decode import check_ids, decode_file, place, stored_shapes

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KIND = f"image store v{FORMAT_VERSION}"  # build.store_key's kind of the decoded store
PIXELS, EVAL, SHAPES, OFFSETS = "pixels.u8", "eval.u8", "shapes.npy", "offsets.npy"


def estimate_store_bytes(sizes: np.ndarray, image_size: int, short_side: int) -> int:
    """Bytes of a store for images of original ``sizes`` ([N, 2] (h, w))."""
    shapes = stored_shapes(sizes, short_side).astype(np.int64)
    return int(np.sum(shapes[:, 0] * shapes[:, 1] * 3) + len(shapes) * image_size**2 * 3)


def _load_layout(path: str, files: dict, n: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(shapes, offsets) from the store, checked against each other and the data files' sizes."""
    try:
        shapes = np.load(os.path.join(path, SHAPES))
        offsets = np.load(os.path.join(path, OFFSETS))
    except (OSError, ValueError) as e:
        raise StoreError(f"{SHAPES} or {OFFSETS} is unreadable ({type(e).__name__}: {e})")
    sizes = shapes.astype(np.int64).prod(axis=1) * 3 if shapes.ndim == 2 else None
    if (
        shapes.shape != (n, 2)
        or offsets.shape != (n + 1,)
        or offsets[0] != 0
        or not np.array_equal(np.diff(offsets), sizes)
        or offsets[-1] != files[PIXELS]["bytes"]
        or files[EVAL]["bytes"] != n * s * s * 3
    ):
        raise StoreError(f"{SHAPES}, {OFFSETS} and the data files' sizes disagree")
    return shapes, offsets


class ImageStore:
    """A decoded store, memory-mapped read-only (module doc). Open with ``ImageStore.open``
    or ``canvas.open_source``."""

    def __init__(self, path, manifest, shapes, offsets, pixels, evals):
        self.path = path
        self.manifest = manifest
        self.shapes = shapes  # int32 [N, 2] stored (h, w)
        self.canvas = tuple(int(x) for x in shapes.max(axis=0))
        self.image_size = int(manifest["image_size"])
        self._offsets = offsets
        self._pixels = pixels
        self._eval = evals

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        return int(sum(f["bytes"] for f in self.manifest["files"].values()))

    @classmethod
    def open(
        cls,
        path: str,
        *,
        key: str | None = None,
        num_images: int | None = None,
        check_data: bool = True,
    ) -> ImageStore:
        """Open and check the store at ``path``; ``StoreError`` says why it is unusable."""
        manifest = read_manifest(path, key=key, num_images=num_images, format=FORMAT_VERSION)
        try:
            files = {name: manifest["files"][name] for name in (PIXELS, EVAL, SHAPES, OFFSETS)}
            n, s = int(manifest["num_images"]), int(manifest["image_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{MANIFEST} lacks a field ({type(e).__name__}: {e})")
        check_data_files(path, files, check_data=check_data)
        shapes, offsets = _load_layout(path, files, n, s)
        pixels = np.memmap(os.path.join(path, PIXELS), np.uint8, "r", shape=(int(offsets[-1]),))
        evals = np.memmap(os.path.join(path, EVAL), np.uint8, "r", shape=(n, s, s, 3))
        return cls(path, manifest, shapes.astype(np.int32), offsets.astype(np.int64), pixels, evals)

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [n, canvas_h, canvas_w, 3] (each image at the top-left, zeros elsewhere) and
        int32 [n, 2] (h, w), for flat file ids (index over all environments concatenated, in
        FolderIndex order: env 0's paths, then env 1's, ...)."""
        ids = check_ids(ids, len(self))
        out = np.empty((len(ids), *self.canvas, 3), np.uint8)
        for k, i in enumerate(ids):
            h, w = self.shapes[i]
            image = self._pixels[self._offsets[i] : self._offsets[i + 1]].reshape(h, w, 3)
            place(out[k], image)
        return out, self.shapes[ids]

    def eval_images(self, ids: np.ndarray) -> np.ndarray:
        """uint8 [n, image_size, image_size, 3]: the evaluation input of each image, which is
        PIL's ``image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)`` of the
        ORIGINAL full-resolution file (what torchvision's Resize((224,224)) does on PIL images)."""
        return np.asarray(self._eval[check_ids(ids, len(self))])


# ---- building and finding the store ---------------------------------------------
def _decode_chunk(job) -> int:
    """Decode files ``first .. first+len(paths)-1`` into the store's files (a worker)."""
    pixels_path, eval_path, image_size, first, paths, sizes, shapes, offsets = job
    lo, hi = int(offsets[0]), int(offsets[-1])
    one = image_size * image_size * 3
    pixels = np.memmap(pixels_path, np.uint8, "r+", offset=lo, shape=(hi - lo,))
    evals = np.memmap(
        eval_path, np.uint8, "r+", offset=first * one, shape=(len(paths), image_size, image_size, 3)
    )
    for k, path in enumerate(paths):
        small, evaluation = decode_file(path, sizes[k], shapes[k], image_size)
        pixels[offsets[k] - lo : offsets[k + 1] - lo] = small.reshape(-1)
        evals[k] = evaluation
    pixels.flush()
    evals.flush()
    del pixels, evals
    return len(paths)


def open_existing(
    stores_dir, final, root, key, n, image_size, short_side
) -> ImageStore | None:
    """The valid decoded store at ``final`` (of ``key``, ``n`` images), or None: a corrupt one
    is logged and discarded, stale ones of the folder ``root`` (its files changed) are logged."""
    return open_existing_store(
        stores_dir,
        final,
        root,
        key,
        n,
        image_size,
        short_side,
        opener=ImageStore.open,
        format=FORMAT_VERSION,
        kind="decoded store",
    )


def build(index, paths, sizes, key, final, *, image_size, short_side, workers, progress):
    """Decode ``paths`` (the flat files of ``index``, of header ``sizes``) into a new store of
    ``key``, renamed into place at ``final`` (atomic); open it (another process's store, if
    it places one first)."""
    n = len(paths)
    shapes = stored_shapes(sizes, short_side)
    offsets = np.concatenate([[0], np.cumsum(shapes.astype(np.int64).prod(axis=1) * 3)])
    tmp = new_build_folder(final, key)
    start = time.perf_counter()
    try:
        pixels_path, eval_path = _allocate(tmp, shapes, offsets, n * image_size * image_size * 3)
        workers, chunk = job_plan(n, workers, 256)
        jobs = [
            (
                pixels_path,
                eval_path,
                image_size,
                i,
                paths[i : i + chunk],
                sizes[i : i + chunk],
                shapes[i : i + chunk],
                offsets[i : i + chunk + 1],
            )
            for i in range(0, n, chunk)
        ]
        run_decode_jobs(jobs, workers, n, progress=progress, decode=_decode_chunk)
        manifest = write_manifest(
            tmp,
            key,
            n,
            image_size,
            short_side,
            shapes,
            os.path.realpath(index.root),
            start,
            names=(PIXELS, EVAL, SHAPES, OFFSETS),
            format=FORMAT_VERSION,
        )
        theirs = rename_into_place(tmp, final, key, n, opener=ImageStore.open)
        if theirs is not None:
            return theirs
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "Built %s: %d images, %.2f GiB, in %.1f s.",
        final,
        n,
        sum(f["bytes"] for f in manifest["files"].values()) / 2**30,
        manifest["build_seconds"],
    )
    return ImageStore.open(final, key=key, num_images=n, check_data=False)


def _allocate(tmp: str, shapes, offsets, eval_bytes: int) -> tuple[str, str]:
    """Allocate the pixel and eval files (zero-filled) and save shapes and offsets in ``tmp``."""
    pixels_path, eval_path = os.path.join(tmp, PIXELS), os.path.join(tmp, EVAL)
    for file_path, size in ((pixels_path, int(offsets[-1])), (eval_path, eval_bytes)):
        with open(file_path, "wb") as f:
            f.truncate(size)
    np.save(os.path.join(tmp, SHAPES), shapes)
    np.save(os.path.join(tmp, OFFSETS), offsets)
    return pixels_path, eval_path


