"""The compressed image store: every image decoded ONCE, kept as JPEG bytes in a few large files.

Owns the store for image folders whose decoded store (``store.py``) exceeds the disk
budget (DomainNet: about 250-270 GiB decoded): ``CompressedStore`` has the interface of
``store.ImageStore`` (``gather``, ``eval_images``, ``len``, ``close``), so
``canvas.CanvasSource`` serves it unchanged, and ``canvas.open_source(mode="compressed")``
(or ``"auto"``, when the decoded store is over budget) opens it. No TensorFlow here.

What is stored, per image (flat id order, as ``FolderIndex.paths``):

* the training image: the original decoded with torchvision's loader
  (``Image.open(p).convert("RGB")``) and shrunk exactly as the decoded store does
  (``decode.stored_shape``, ``decode.decode_file``), then re-encoded as JPEG at
  ``QUALITY`` 95 without chroma subsampling (4:4:4). Where the original file is a JPEG
  already within the bounded size AND its bytes decode (with this module's decoder) to
  exactly PIL's decode of it, checked at build time, the original bytes are kept as they
  are: those images are the reference's pixels exactly (``kept``).
* the evaluation image: PIL's ``resize((S, S), BILINEAR)`` of the full-size decode (what
  the decoded store keeps), re-encoded the same way.

Measured on this project's 2-core build machine (``experiments/bench_decode.py`` on a
DomainNet-like folder of 3,181 images, ``docs/data/bench_decode_cpu.txt``), images per
CPU-second of one thread:

================================  ==========================  ===========================
decoder                           training input (<=320 px)   evaluation input (224x224)
================================  ==========================  ===========================
simplejpeg, store's records       2,030                       4,480
PIL, store's records              1,370                       3,158
PIL ``draft``, original files     447                         638
simplejpeg scaled, original files 507                         783
PIL full, original files          440                         512
================================  ==========================  ===========================

16 cores feeding one H100 need 169 training images/s per core (2,700 a second) and,
for evaluation at the forward-pass rate (3 x 4,964), 931 per core: only the store's
records meet the second. Making the evaluation image at read time from the stored
training image (decode, then PIL's resize) ran 701 per core, below it, and resizes
twice; so the evaluation image is stored (17.7 KB of the 55.0 KB per image; the
decoded store takes 526 KB). Pixel difference from PIL's decode of the original file
(+ PIL's resize), mean / max over pixels and channels, in grey levels: training images
0.68 / 22 (re-encoded ones alone 0.92 / 22; kept originals 0), evaluation images
0.88 / 23 (``tests/data/test_jpeg_store.py`` bounds them on its own images).

Decoder: ``simplejpeg`` (libjpeg-turbo inside its wheel, no system library; its
``decode_jpeg`` runs libjpeg-turbo inside ``with nogil``: a Python thread kept 100% of
its speed beside a decoding thread, 48% beside pure Python), in a thread pool of one
thread per usable core. It decodes the store's records 42-48% faster than PIL (same
library: PIL's plug-in and mode conversion cost the rest); PIL's ``draft`` helps only where the wanted size is at most half the
stored one, never the case for the store's records. PyTurboJPEG needs a system
``libturbojpeg`` (absent here; the project depends on no system library); NVIDIA DALI's
nvJPEG is a GPU path, not measured (no GPU on the build machine).

Layout of a store, ``<cache root>/stores/<key>/``: two streams of JPEG records,
``train`` and ``eval``; each is a few shard files (``train-00000.jpgs``, ...) of about
``SHARD_BYTES`` (1 GiB) holding whole records back to back, with ``<stream>_offsets.npy``
(int64 [N+1]: record i is bytes ``offsets[i]:offsets[i+1]`` of the stream's shards
concatenated) and ``<stream>_shards.npy`` (int64 [K+1]: shard k holds records
``first[k]:first[k+1]``); ``shapes.npy`` (int32 [N, 2] stored (h, w)), ``kept.npy``
(bool [N], original bytes kept) and ``manifest.json`` (written last; format
``FORMAT``, each data file's byte size and CRC-32). ``key`` is ``build.store_key`` with
this store's own kind string (``KIND``), so it never collides with a decoded store.

Build and open use ``build.py``'s machinery, as the decoded store does: the atomic build
in a temporary folder renamed into place (two concurrent builds: the first rename wins, the
other uses it), spawned worker processes that die with their parent, orphaned build folders
removed, the manifest's sizes and CRC-32 checked at every open (a stale or corrupt store is
logged and rebuilt, never used). Workers decode and encode chunks of files; the
building process appends their records to the shards in id order. Every batch is a
function of the ids only (exact resume).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import time

import numpy as np
import simplejpeg

from sagm_jax.data.build import (
    MANIFEST,
    StoreError,
    check_data_files,
    job_plan,
    locate,
    new_build_folder,
    open_existing_store,
    read_manifest,
    rename_into_place,
    run_decode_jobs,
    write_manifest,
)
from sagm_jax.data.decode import (
    check_ids,
    cpu_count,
    decode_file,
    place,
    read_sizes,
    stored_shapes,
)
from sagm_jax.data.image_folder import BadImageError
from sagm_jax.data.store import estimate_store_bytes

log = logging.getLogger(__name__)

FORMAT = "jpeg store v1"
KIND = "compressed image store v1"  # build.store_key's kind: never a decoded store's key
QUALITY = 95
SUBSAMPLING = "444"
SHARD_BYTES = 1 << 30
STREAMS = ("train", "eval")
SHAPES, KEPT = "shapes.npy", "kept.npy"
# Estimate of the store's bytes per stored pixel (training image plus S x S evaluation image),
# for open_source's choice. Measured at QUALITY 95, 4:4:4 (docs/data/bench_decode_cpu.txt): 0.31
# over the DomainNet-like folder; by domain 0.09 (quickdraw, kept originals) to 0.44
# (painting), photos 0.41. 0.5 bounds every domain, so the estimate errs large.
BYTES_PER_PIXEL = 0.5


def estimate_bytes(sizes: np.ndarray, image_size: int, short_side: int) -> int:
    """Estimated bytes of a compressed store for images of original ``sizes`` ([N, 2] (h, w)):
    ``BYTES_PER_PIXEL`` times the stored pixels plus the evaluation pixels."""
    pixels = estimate_store_bytes(sizes, image_size, short_side) / 3
    return int(pixels * BYTES_PER_PIXEL)


def decode(record) -> np.ndarray:
    """uint8 [h, w, 3] of one stored JPEG record (bytes or a uint8 buffer), with simplejpeg's
    accurate DCT and fancy upsampling (libjpeg's defaults, as PIL's)."""
    return simplejpeg.decode_jpeg(record, colorspace="RGB")


def encode(image: np.ndarray) -> bytes:
    """The JPEG record of a uint8 [h, w, 3] image (``QUALITY``, ``SUBSAMPLING``)."""
    return simplejpeg.encode_jpeg(
        np.ascontiguousarray(image), quality=QUALITY, colorspace="RGB", colorsubsampling=SUBSAMPLING
    )


def _keepable(path: str, small: np.ndarray, size, stored) -> bytes | None:
    """The original file's bytes if they can stand for ``small`` (PIL's decode, not resized):
    a JPEG that ``decode`` turns into exactly ``small``; else None."""
    if tuple(int(x) for x in size) != tuple(int(x) for x in stored):
        return None
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\xff\xd8":  # not a JPEG
        return None
    try:
        same = np.array_equal(decode(data), small)
    except ValueError:  # simplejpeg cannot decode it (e.g. an unusual colour space)
        return None
    return data if same else None


def _encode_chunk(job) -> tuple[int, list[bytes], list[bytes], list[bool]]:
    """Decode files (PIL, as the decoded store) and make their records (a worker)."""
    image_size, paths, sizes, shapes = job
    train, evals, kept = [], [], []
    for path, size, stored in zip(paths, sizes, shapes):
        small, evaluation = decode_file(path, size, stored, image_size)
        original = _keepable(path, small, size, stored)
        train.append(original if original is not None else encode(small))
        evals.append(encode(evaluation))
        kept.append(original is not None)
    return len(paths), train, evals, kept


class _ShardWriter:
    """Appends one stream's records to shard files of about ``shard_bytes``, in id order."""

    def __init__(self, folder: str, stream: str, shard_bytes: int):
        self.folder, self.stream, self.shard_bytes = folder, stream, shard_bytes
        self.offsets, self.first = [0], []
        self.names: list[str] = []
        self._file = None
        self._in_shard = 0

    def add(self, record: bytes) -> None:
        if self._file is None or self._in_shard >= self.shard_bytes:
            self._next_shard()
        self._file.write(record)
        self._in_shard += len(record)
        self.offsets.append(self.offsets[-1] + len(record))

    def _next_shard(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"{self.stream}-{len(self.names):05d}.jpgs"
        self.names.append(name)
        self.first.append(len(self.offsets) - 1)
        self._file = open(os.path.join(self.folder, name), "wb")  # noqa: SIM115 (kept open)
        self._in_shard = 0

    def finish(self) -> list[str]:
        """Close the last shard; save the offsets and shard starts; the file names written."""
        if self._file is not None:
            self._file.close()
        n = len(self.offsets) - 1
        np.save(os.path.join(self.folder, f"{self.stream}_offsets.npy"), np.asarray(self.offsets))
        shards = np.asarray([*self.first, n], np.int64)
        np.save(os.path.join(self.folder, f"{self.stream}_shards.npy"), shards)
        return [*self.names, f"{self.stream}_offsets.npy", f"{self.stream}_shards.npy"]


class _Stream:
    """One stream's records, read from memory-mapped shards."""

    def __init__(self, path: str, stream: str, files: dict, n: int):
        try:
            offsets = np.load(os.path.join(path, f"{stream}_offsets.npy"))
            first = np.load(os.path.join(path, f"{stream}_shards.npy"))
        except (OSError, ValueError) as e:
            raise StoreError(
                f"{stream}'s offsets or shards are unreadable ({type(e).__name__}: {e})"
            )
        names = [f"{stream}-{k:05d}.jpgs" for k in range(len(first) - 1)]
        if (
            offsets.shape != (n + 1,)
            or offsets[0] != 0
            or np.any(np.diff(offsets) <= 0)
            or first.ndim != 1
            or (n and len(first) < 2)
            or (len(first) and (first[0] != 0 or first[-1] != n or np.any(np.diff(first) <= 0)))
            or any(name not in files for name in names)
            or any(
                files[name]["bytes"] != offsets[first[k + 1]] - offsets[first[k]]
                for k, name in enumerate(names)
            )
        ):
            raise StoreError(f"{stream}'s offsets, shard starts and shard sizes disagree")
        self.offsets = offsets.astype(np.int64)
        self.first = first.astype(np.int64)
        # Plain arrays over the maps (slicing a np.memmap is slower), and each record's shard
        # and start within it: a lookup is a few array reads (less time holding the GIL).
        self.shards = [
            np.memmap(os.path.join(path, name), np.uint8, "r").view(np.ndarray) for name in names
        ]
        self._shard_of = np.repeat(np.arange(len(names)), np.diff(self.first))
        self._start = self.offsets[:-1] - self.offsets[self.first[self._shard_of]]

    def record(self, i: int) -> np.ndarray:
        """Record ``i``'s bytes (a view into its shard)."""
        start = int(self._start[i])
        return self.shards[int(self._shard_of[i])][
            start : start + int(self.offsets[i + 1] - self.offsets[i])
        ]


class CompressedStore:
    """A compressed store, memory-mapped read-only and decoded by a thread pool (module doc).
    Open with ``CompressedStore.open``, ``open_store`` or ``canvas.open_source``."""

    def __init__(self, path, manifest, shapes, kept, streams, threads=None):
        self.path = path
        self.manifest = manifest
        self.shapes = shapes  # int32 [N, 2] stored (h, w)
        self.kept = kept  # bool [N]: the training record is the original file's bytes
        self.canvas = tuple(int(x) for x in shapes.max(axis=0)) if len(shapes) else (0, 0)
        self.image_size = int(manifest["image_size"])
        self._train, self._eval = streams
        self._pool = concurrent.futures.ThreadPoolExecutor(threads or cpu_count())

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        return int(sum(f["bytes"] for f in self.manifest["files"].values()))

    def close(self) -> None:
        self._pool.shutdown()

    @classmethod
    def open(
        cls,
        path: str,
        *,
        key: str | None = None,
        num_images: int | None = None,
        check_data: bool = True,
        threads: int | None = None,
    ) -> CompressedStore:
        """Open and check the store at ``path``; ``StoreError`` says why it is unusable."""
        manifest = read_manifest(path, key=key, num_images=num_images, format=FORMAT)
        try:
            files = dict(manifest["files"])
            n, s = int(manifest["num_images"]), int(manifest["image_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{MANIFEST} lacks a field ({type(e).__name__}: {e})")
        check_data_files(path, files, check_data=check_data)
        try:
            shapes = np.load(os.path.join(path, SHAPES))
            kept = np.load(os.path.join(path, KEPT))
        except (OSError, ValueError) as e:
            raise StoreError(f"{SHAPES} or {KEPT} is unreadable ({type(e).__name__}: {e})")
        if shapes.shape != (n, 2) or kept.shape != (n,) or s < 1:
            raise StoreError(f"{SHAPES} or {KEPT} does not hold {n} images")
        streams = [_Stream(path, stream, files, n) for stream in STREAMS]
        return cls(path, manifest, shapes.astype(np.int32), kept.astype(bool), streams, threads)

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As ``store.ImageStore.gather``: uint8 [n, canvas_h, canvas_w, 3] (each decoded
        training image at the top-left, zeros elsewhere) and int32 [n, 2] (h, w)."""
        ids = check_ids(ids, len(self))
        out = np.empty((len(ids), *self.canvas, 3), np.uint8)

        def one(k):
            i = ids[k]
            image = self._decode(self._train, i)
            if image.shape[:2] != tuple(self.shapes[i]):
                raise StoreError(
                    f"{self.path}: image {i} decodes to {image.shape[:2]}, its shape is "
                    f"{tuple(self.shapes[i])}"
                )
            place(out[k], image)

        list(self._pool.map(one, range(len(ids))))
        return out, self.shapes[ids]

    def eval_images(self, ids: np.ndarray) -> np.ndarray:
        """uint8 [n, S, S, 3]: each image's stored evaluation input (PIL's bilinear resize of
        the full-size decode, re-encoded: module doc for its distance from PIL's)."""
        ids = check_ids(ids, len(self))
        s = self.image_size
        out = np.empty((len(ids), s, s, 3), np.uint8)

        def one(k):
            out[k] = self._decode(self._eval, ids[k])

        list(self._pool.map(one, range(len(ids))))
        return out

    def _decode(self, stream: _Stream, i: int) -> np.ndarray:
        try:
            return decode(stream.record(i))
        except ValueError as e:
            raise StoreError(f"{self.path}: record {i} does not decode ({e})") from e


def _open(path, *, key=None, num_images=None):
    return CompressedStore.open(path, key=key, num_images=num_images)


def open_store(
    index,
    *,
    image_size: int = 224,
    short_side: int = 320,
    stores_dir: str,
    sizes: np.ndarray | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> CompressedStore:
    """The compressed store of the folder ``index`` in ``stores_dir``: the existing valid one
    (``open_existing``), else a new one (``build``)."""
    found = open_existing(
        index, image_size=image_size, short_side=short_side, stores_dir=stores_dir
    )
    if found is not None:
        return found
    return build(
        index,
        image_size=image_size,
        short_side=short_side,
        stores_dir=stores_dir,
        sizes=sizes,
        workers=workers,
        progress=progress,
    )


def open_existing(
    index, *, image_size: int = 224, short_side: int = 320, stores_dir: str
) -> CompressedStore | None:
    """The valid compressed store of ``index`` in ``stores_dir``, or None: a corrupt one is
    logged and discarded, stale ones (the folder's files changed) are logged."""
    paths, key, final = locate(index, image_size, short_side, stores_dir, KIND)
    return open_existing_store(
        stores_dir,
        final,
        index.root,
        key,
        len(paths),
        image_size,
        short_side,
        opener=_open,
        format=FORMAT,
        kind="compressed store",
    )


def build(
    index,
    *,
    image_size: int = 224,
    short_side: int = 320,
    stores_dir: str,
    sizes: np.ndarray | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> CompressedStore:
    """Build the compressed store of ``index`` in ``stores_dir`` (another process's store, if
    it places one first). ``sizes``: the files' header (h, w), if already read. OSError when
    the disk has clearly too little room (``estimate_bytes``)."""
    paths, key, final = locate(index, image_size, short_side, stores_dir, KIND)
    if sizes is None:
        sizes = read_sizes(paths, progress=progress)
    need, free = estimate_bytes(sizes, image_size, short_side), shutil.disk_usage(stores_dir).free
    if need > free:
        raise OSError(
            f"The compressed store of {index.root} needs about {need / 2**30:.1f} GiB but "
            f"{stores_dir} has {free / 2**30:.1f} GiB free; free space, set cache_dir "
            "elsewhere, or stream."
        )
    log.info("Encoding %d images of %s once into %s.", len(paths), index.root, final)
    return _build(index, paths, sizes, key, final, image_size, short_side, workers, progress)


def _build(index, paths, sizes, key, final, image_size, short_side, workers, progress):
    """Decode and encode ``paths`` into a new store, renamed into place at ``final``; open it."""
    n = len(paths)
    if n == 0:
        raise BadImageError(f"{index.root}: no images to store")
    shapes = stored_shapes(sizes, short_side)
    tmp = new_build_folder(final, key)
    start = time.perf_counter()
    try:
        writers = {s: _ShardWriter(tmp, s, SHARD_BYTES) for s in STREAMS}
        kept: list[bool] = []

        def consume(result):
            count, train, evals, kept_chunk = result
            for record in train:
                writers["train"].add(record)
            for record in evals:
                writers["eval"].add(record)
            kept.extend(kept_chunk)
            return count

        workers, chunk = job_plan(n, workers, 64)
        jobs = [
            (image_size, paths[i : i + chunk], sizes[i : i + chunk], shapes[i : i + chunk])
            for i in range(0, n, chunk)
        ]
        run_decode_jobs(
            jobs, workers, n, progress=progress, decode=_encode_chunk, consume=consume
        )
        names = [name for w in writers.values() for name in w.finish()]
        np.save(os.path.join(tmp, SHAPES), shapes)
        np.save(os.path.join(tmp, KEPT), np.asarray(kept, bool))
        manifest = write_manifest(
            tmp,
            key,
            n,
            image_size,
            short_side,
            shapes,
            os.path.realpath(index.root),
            start,
            names=(*names, SHAPES, KEPT),
            format=FORMAT,
            extra={
                "quality": QUALITY,
                "subsampling": SUBSAMPLING,
                "decoder": f"simplejpeg {simplejpeg.__version__}",
                "kept_originals": int(np.sum(kept)),
            },
        )
        theirs = rename_into_place(tmp, final, key, n, opener=_open)
        if theirs is not None:
            return theirs
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "Built %s: %d images (%d kept as their original bytes), %.2f GiB, in %.1f s.",
        final,
        n,
        manifest["kept_originals"],
        sum(f["bytes"] for f in manifest["files"].values()) / 2**30,
        manifest["build_seconds"],
    )
    return CompressedStore.open(final, key=key, num_images=n, check_data=False)
