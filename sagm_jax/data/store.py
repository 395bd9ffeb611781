"""Decoded image-folder datasets: each image decoded ONCE with PIL into a uint8 store.

Owns the host side of the image-folder input for on-accelerator augmentation
(``device_augment.py``): the host only gathers uint8 images onto a zero-padded canvas
with each image's true ``(h, w)``, and the evaluation images; ``canvas.CanvasSource``
serves a dataset's batches from them (the ``dataset.Source`` of ``config.input='device'``). No
TensorFlow here.

Decoding is torchvision's loader, ``Image.open(path).convert("RGB")``, so the pixels
equal the reference's. From the full-resolution image, one pass makes:

* the stored image: kept byte-for-byte when its shorter side is at most ``short_side``
  (PACS's 227x227), else shrunk with PIL's antialiased ``resize(..., BILINEAR)`` so the
  shorter side is ``short_side`` (``stored_shape``). With the default 320, every crop
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
and offsets; the data files are allocated, then worker processes (spawned, so a parent
that already runs JAX threads is safe) decode contiguous chunks of files and write
them straight into the memory-mapped files. The build happens in a temporary folder
next to the final one and is renamed into place (atomic): when two processes build
at once, the first rename wins and the other uses that store and deletes its own.
A build killed outright (SIGKILL, out of memory) leaks nothing for long: its workers get
a death signal when the building process dies (``_die_with_parent``), and the build
folder, named ``.build-<key>-<pid>-<host>-*``, is removed by the next build in that
cache once no process of that PID runs on that host (``_remove_orphaned_builds``;
other hosts' build folders on a shared file system are left alone).

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
use; it reuses this module's key, manifest, checks, atomic build and worker processes.
``canvas.open_source`` chooses between the kinds (its doc).

``StreamingSource`` has the same interface and decodes the original files on every call,
for datasets too big for either store. It uses PIL's ``draft("RGB", (w, h))``: JPEGs are
decoded with libjpeg's scaled IDCT at 1/2, 1/4 or 1/8 of full size when that is still at
least the wanted size, then resized exactly to the stored shape (or S x S). Its pixels equal
the store's when no reduction applies (non-JPEG files, and JPEGs less than twice the
wanted size: PACS, and 640x480 to 320x427); when one does, the DCT-domain reduction
(about a box average) stands in for part of PIL's antialiased bilinear shrink, so
pixels differ. Measured: a 2048x1536 photo-like JPEG to 320x427 (1/4 draft) differs by
0.5 levels on average, 3 at most (its 224x224 eval image 0.3, 2); the worst case, a
fine texture reduced exactly 2x, by 3.1 on average, 36 at most
(``tests/data/test_store.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import ctypes.util
import datetime
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
import zlib

import numpy as np
from PIL import Image
from tqdm import tqdm

from sagm_jax.data.image_folder import BadImageError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODES = ("auto", "cache", "compressed", "stream")
MANIFEST = "manifest.json"
PIXELS, EVAL, SHAPES, OFFSETS = "pixels.u8", "eval.u8", "shapes.npy", "offsets.npy"
_CRC_CHUNK = 16 << 20


class StoreError(Exception):
    """A store on disk that must not be used (incomplete, corrupt or not this dataset's)."""


def stored_shape(height: int, width: int, short_side: int) -> tuple[int, int]:
    """Images whose shorter side exceeds short_side are shrunk (aspect kept, sides rounded) so
    the shorter side equals short_side; others are kept as they are."""
    height, width, short_side = int(height), int(width), int(short_side)
    short = min(height, width)
    if short <= short_side:
        return height, width

    def scaled(side):  # round(side * short_side / short), halves up, in integers
        return max(1, (2 * side * short_side + short) // (2 * short))

    if height <= width:
        return short_side, scaled(width)
    return scaled(height), short_side


def _stored_shapes(sizes: np.ndarray, short_side: int) -> np.ndarray:
    shapes = [stored_shape(int(h), int(w), short_side) for h, w in sizes]
    return np.asarray(shapes, dtype=np.int32).reshape(-1, 2)


def estimate_store_bytes(sizes: np.ndarray, image_size: int, short_side: int) -> int:
    """Bytes of a store for images of original ``sizes`` ([N, 2] (h, w))."""
    shapes = _stored_shapes(sizes, short_side).astype(np.int64)
    return int(np.sum(shapes[:, 0] * shapes[:, 1] * 3) + len(shapes) * image_size**2 * 3)


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _flat_paths(index) -> list[str]:
    return [p for env in index.paths for p in env]


def store_key(root: str, paths: list[str], image_size: int, short_side: int, kind: str = "") -> str:
    """SHA-256 over the store kind and version (``kind``: '' is this decoded store's
    ``image store v1``; another kind of store names its own, so the two never share a key),
    the sizes and every file's (relative path, size, mtime_ns)."""
    kind = kind or f"image store v{FORMAT_VERSION}"
    digest = hashlib.sha256(f"sagm_jax {kind}\0{image_size}\0{short_side}\n".encode())
    for path in paths:
        st = os.stat(path)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def crc32_file(path: str) -> str:
    crc = 0
    buf = bytearray(_CRC_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _check_ids(ids, n: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise IndexError(f"ids must be in [0, {n}), got min {ids.min()}, max {ids.max()}")
    return ids.astype(np.intp)


def _place(canvas: np.ndarray, image: np.ndarray) -> None:
    """Image at the top-left of one canvas row, zeros elsewhere."""
    h, w = image.shape[:2]
    canvas[:h, :w] = image
    canvas[h:] = 0
    canvas[:h, w:] = 0


# ---- decoding ----------------------------------------------------------------------
def read_size(path: str) -> tuple[int, int]:
    """(h, w) from the file's header, without decoding."""
    try:
        with Image.open(path) as image:
            w, h = image.size
    except Exception as e:  # PIL raises many types
        raise BadImageError(f"{path}: cannot read the image header ({type(e).__name__}: {e})")
    return h, w


def read_sizes(paths: list[str], *, progress: bool = True) -> np.ndarray:
    """int32 [N, 2] (h, w) of every file, from headers (threads: mostly file I/O)."""
    with concurrent.futures.ThreadPoolExecutor(min(32, 2 * _cpu_count())) as pool:
        sizes = list(
            tqdm(
                pool.map(read_size, paths, chunksize=64),
                total=len(paths),
                desc="Reading image headers",
                unit="img",
                disable=not progress,
            )
        )
    return np.asarray(sizes, dtype=np.int32).reshape(-1, 2)


def decode_file(path: str, size, stored, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Full decode (torchvision's loader): (stored uint8 [h, w, 3], eval uint8 [S, S, 3]).
    ``size`` is the (h, w) the header gave, ``stored`` the stored (h, w)."""
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except Exception as e:  # PIL raises many types
        raise BadImageError(f"{path}: does not decode ({type(e).__name__}: {e})")
    if rgb.size != (size[1], size[0]):
        raise BadImageError(
            f"{path}: decodes to {rgb.size[1]}x{rgb.size[0]} (h x w) but its header said "
            f"{size[0]}x{size[1]}; was it rewritten while the store was built?"
        )
    small = (
        rgb
        if rgb.size == (stored[1], stored[0])
        else rgb.resize((int(stored[1]), int(stored[0])), Image.BILINEAR)
    )
    evaluation = rgb.resize((image_size, image_size), Image.BILINEAR)
    return np.asarray(small), np.asarray(evaluation)


def decode_draft(path: str, shape) -> np.ndarray:
    """uint8 [h, w, 3] of ``shape`` (h, w): reduced-size JPEG decoding (``draft``) to at
    least ``shape``, then PIL's bilinear resize to exactly ``shape``."""
    h, w = int(shape[0]), int(shape[1])
    try:
        with Image.open(path) as image:
            image.draft("RGB", (w, h))
            rgb = image.convert("RGB")
    except Exception as e:  # PIL raises many types
        raise BadImageError(f"{path}: does not decode ({type(e).__name__}: {e})")
    if rgb.size != (w, h):
        rgb = rgb.resize((w, h), Image.BILINEAR)
    return np.asarray(rgb)


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


# ---- the store ---------------------------------------------------------------------
def _read_manifest(
    path: str, *, key: str | None, num_images: int | None, format=FORMAT_VERSION
) -> dict:
    """The store's manifest, checked against the expected format (this store's version, or
    another kind's ``format``), key and image count."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"no {MANIFEST} (the build did not finish, or it was removed)")
    except (OSError, ValueError) as e:
        raise StoreError(f"{manifest_path} is unreadable ({type(e).__name__}: {e})")
    expected = {"format": format, "key": key, "num_images": num_images}
    for name, want in expected.items():
        if want is not None and manifest.get(name) != want:
            raise StoreError(f"{MANIFEST} has {name}={manifest.get(name)!r}, expected {want!r}")
    return manifest


def _check_data_files(path: str, files: dict, *, check_data: bool) -> None:
    """StoreError unless every data file has the manifest's size (and CRC-32 if check_data)."""
    for name, info in files.items():
        file_path = os.path.join(path, name)
        try:
            size = os.path.getsize(file_path)
        except OSError:
            raise StoreError(f"{name} is missing")
        if size != info["bytes"]:
            raise StoreError(
                f"{name} has {size:,} bytes, the manifest says {info['bytes']:,} "
                "(truncated or overwritten)"
            )
        if check_data and crc32_file(file_path) != info["crc32"]:
            raise StoreError(
                f"{name}'s CRC-32 differs from the manifest's (its bytes changed on disk)"
            )


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
        manifest = _read_manifest(path, key=key, num_images=num_images)
        try:
            files = {name: manifest["files"][name] for name in (PIXELS, EVAL, SHAPES, OFFSETS)}
            n, s = int(manifest["num_images"]), int(manifest["image_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{MANIFEST} lacks a field ({type(e).__name__}: {e})")
        _check_data_files(path, files, check_data=check_data)
        shapes, offsets = _load_layout(path, files, n, s)
        pixels = np.memmap(os.path.join(path, PIXELS), np.uint8, "r", shape=(int(offsets[-1]),))
        evals = np.memmap(os.path.join(path, EVAL), np.uint8, "r", shape=(n, s, s, 3))
        return cls(path, manifest, shapes.astype(np.int32), offsets.astype(np.int64), pixels, evals)

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [n, canvas_h, canvas_w, 3] (each image at the top-left, zeros elsewhere) and
        int32 [n, 2] (h, w), for flat file ids (index over all environments concatenated, in
        FolderIndex order: env 0's paths, then env 1's, ...)."""
        ids = _check_ids(ids, len(self))
        out = np.empty((len(ids), *self.canvas, 3), np.uint8)
        for k, i in enumerate(ids):
            h, w = self.shapes[i]
            image = self._pixels[self._offsets[i] : self._offsets[i + 1]].reshape(h, w, 3)
            _place(out[k], image)
        return out, self.shapes[ids]

    def eval_images(self, ids: np.ndarray) -> np.ndarray:
        """uint8 [n, image_size, image_size, 3]: the evaluation input of each image, which is
        PIL's ``image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)`` of the
        ORIGINAL full-resolution file (what torchvision's Resize((224,224)) does on PIL images)."""
        return np.asarray(self._eval[_check_ids(ids, len(self))])


class StreamingSource:
    """``ImageStore``'s interface, decoding on every call with ``draft`` (module doc), in a
    thread pool (PIL releases the GIL while decoding)."""

    def __init__(
        self,
        paths,
        sizes,
        *,
        image_size: int = 224,
        short_side: int = 320,
        threads: int | None = None,
    ):
        self.paths = list(paths)
        self.shapes = _stored_shapes(np.asarray(sizes), short_side)  # int32 [N, 2]
        self.canvas = tuple(int(x) for x in self.shapes.max(axis=0))
        self.image_size = int(image_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads or _cpu_count())

    def __len__(self) -> int:
        return len(self.paths)

    def close(self) -> None:
        self._pool.shutdown()

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As ``ImageStore.gather``."""
        ids = _check_ids(ids, len(self))
        out = np.empty((len(ids), *self.canvas, 3), np.uint8)

        def one(k):
            i = ids[k]
            _place(out[k], decode_draft(self.paths[i], self.shapes[i]))

        list(self._pool.map(one, range(len(ids))))
        return out, self.shapes[ids]

    def eval_images(self, ids: np.ndarray) -> np.ndarray:
        """As ``ImageStore.eval_images`` (reduced-size decoding to at least S x S first)."""
        ids = _check_ids(ids, len(self))
        s = self.image_size
        out = np.empty((len(ids), s, s, 3), np.uint8)

        def one(k):
            out[k] = decode_draft(self.paths[ids[k]], (s, s))

        list(self._pool.map(one, range(len(ids))))
        return out


# ---- building and finding stores ---------------------------------------------------
def _discard(path: str) -> None:
    """Remove a store folder: renamed away first (atomic), so no one opens it half-gone."""
    gone = os.path.join(os.path.dirname(path), f".discard-{uuid.uuid4().hex}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:  # another process removed it already
        return
    shutil.rmtree(gone, ignore_errors=True)


def _warn_stale(
    stores_dir: str,
    root: str,
    key: str,
    image_size: int,
    short_side: int,
    *,
    format=FORMAT_VERSION,
    kind: str = "decoded store",
):
    """Log the stores of the same dataset folder and ``format`` (a kind of store) that its files
    no longer match."""
    root = os.path.realpath(root)
    for name in sorted(os.listdir(stores_dir)):
        try:
            with open(os.path.join(stores_dir, name, MANIFEST)) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            continue
        if (
            manifest.get("root") == root
            and manifest.get("format") == format
            and manifest.get("key") != key
            and manifest.get("image_size") == image_size
            and manifest.get("short_side") == short_side
        ):
            size_gb = sum(f["bytes"] for f in manifest["files"].values()) / 2**30
            log.warning(
                "The files under %s changed since the %s %s was built (file list, "
                "sizes or modification times differ), so a new store is built. The old one "
                "(%.2f GiB) is not used any more: delete it to free the space.",
                root,
                kind,
                os.path.join(stores_dir, name),
                size_gb,
            )


def _owner_host() -> str:
    """This host and PID namespace, hashed to 8 hex digits: a PID means one process only
    within them (a container with its own PID namespace has another tag)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _build_prefix(key: str) -> str:
    """Name prefix of a build folder: the store key, the owner's PID and host (``_BUILD_NAME``)."""
    return f".build-{key[:16]}-{os.getpid()}-{_owner_host()}-"


_BUILD_NAME = re.compile(r"\.build-[0-9a-f]{16}-(\d+)-([0-9a-f]{8})-[^-]+")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _remove_orphaned_builds(stores_dir: str) -> None:
    """Remove the ``.build-*`` folders of builds whose owner process on this host is gone
    (killed mid-build), and ``.discard-*`` folders (garbage by definition). A build
    folder of a live owner, of another host (a shared file system: its PIDs mean nothing
    here), or of a version before owners were recorded is left alone; a dead owner's PID
    reused by another process only delays the removal until that one ends."""
    here = _owner_host()
    for name in os.listdir(stores_dir):
        path = os.path.join(stores_dir, name)
        owner = _BUILD_NAME.fullmatch(name)
        if name.startswith(".discard-"):
            shutil.rmtree(path, ignore_errors=True)
        elif owner and owner[2] == here and not _pid_alive(int(owner[1])):
            log.warning("Removing %s, left by a build whose process %s is gone.", path, owner[1])
            try:
                _discard(path)
            except OSError as e:  # another user's folder: not ours to remove
                log.warning("Could not remove %s (%s); delete it by hand.", path, e)


def _die_with_parent(parent_pid: int) -> None:
    """Worker initializer: end this worker when the building process dies (SIGKILL gives it
    no chance to stop its pool), instead of leaving it blocked on a pipe. Linux: the
    kernel's parent-death signal (sent when the thread that started the pool exits: the
    pool lives inside one call, so that thread outlives it); elsewhere a thread that
    polls the parent's PID."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _build(index, paths, sizes, key, final, *, image_size, short_side, workers, progress):
    """Decode ``paths`` into a new store, renamed into place at ``final`` (atomic); open it."""
    n = len(paths)
    shapes = _stored_shapes(sizes, short_side)
    offsets = np.concatenate([[0], np.cumsum(shapes.astype(np.int64).prod(axis=1) * 3)])
    _remove_orphaned_builds(os.path.dirname(final))
    tmp = tempfile.mkdtemp(prefix=_build_prefix(key), dir=os.path.dirname(final))
    start = time.perf_counter()
    try:
        pixels_path, eval_path = _allocate(tmp, shapes, offsets, n * image_size * image_size * 3)
        workers = max(1, workers or _cpu_count())
        chunk = max(1, min(256, math.ceil(n / (workers * 8))))
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
        _run_decode_jobs(jobs, workers, n, progress=progress)
        manifest = _write_manifest(
            tmp, key, n, image_size, short_side, shapes, os.path.realpath(index.root), start
        )
        theirs = _rename_into_place(tmp, final, key, n)
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


def _run_decode_jobs(
    jobs: list, workers: int, n: int, *, progress: bool, decode=None, consume=None
) -> None:
    """Run ``decode`` (default ``_decode_chunk``, which returns its image count) on every job,
    here or in spawned worker processes, with a bar. With ``consume``, each result is passed to
    ``consume`` IN JOB ORDER (it returns the image count), at most ``4 * workers`` jobs ahead of
    the oldest unconsumed one, so results wait in memory for a few jobs at most."""
    decode = decode or _decode_chunk
    bar = tqdm(total=n, desc=f"Decoding {n:,} images once", unit="img", disable=not progress)
    with bar:
        if workers == 1 or len(jobs) == 1:
            for job in jobs:
                result = decode(job)
                bar.update(consume(result) if consume else result)
            return
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            min(workers, len(jobs)),
            mp_context=context,
            initializer=_die_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            try:
                if consume is None:
                    futures = [pool.submit(decode, job) for job in jobs]
                    for future in concurrent.futures.as_completed(futures):
                        bar.update(future.result())
                else:
                    _consume_in_order(pool, decode, jobs, 4 * workers, consume, bar)
            except concurrent.futures.process.BrokenProcessPool as e:
                raise RuntimeError(
                    "A decoding worker process died: out of memory, or the main script "
                    "cannot be imported again by a spawned process (run it from a file "
                    "or module with an `if __name__ == '__main__':` guard), or pass "
                    "workers=1 to decode in this process."
                ) from e
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise


def _consume_in_order(pool, decode, jobs, window: int, consume, bar) -> None:
    """Submit ``decode(job)`` with at most ``window`` jobs in flight; consume results in order."""
    pending = collections.deque()
    todo = iter(jobs)
    for job in itertools.islice(todo, window):
        pending.append(pool.submit(decode, job))
    while pending:
        result = pending.popleft().result()
        for job in itertools.islice(todo, 1):
            pending.append(pool.submit(decode, job))
        bar.update(consume(result))


def _write_manifest(
    tmp,
    key,
    n,
    image_size,
    short_side,
    shapes,
    root,
    start,
    *,
    names=(PIXELS, EVAL, SHAPES, OFFSETS),
    format=FORMAT_VERSION,
    extra=None,
) -> dict:
    """Checksum the data files ``names`` and write the manifest (last: it marks the store
    complete); ``format`` names the kind of store, ``extra`` adds fields."""
    files = {}
    for name in names:
        file_path = os.path.join(tmp, name)
        files[name] = {"bytes": os.path.getsize(file_path), "crc32": crc32_file(file_path)}
    manifest = {
        "format": format,
        "key": key,
        "num_images": n,
        "image_size": image_size,
        "short_side": short_side,
        "canvas": [int(x) for x in shapes.max(axis=0)],
        "root": root,
        "files": files,
        "build_seconds": round(time.perf_counter() - start, 3),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        **(extra or {}),
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:  # last: marks the store complete
        json.dump(manifest, f, indent=1)
    return manifest


def _rename_into_place(tmp: str, final: str, key: str, n: int, opener=None):
    """Rename ``tmp`` to ``final``; if another process placed a usable store first, return it
    (opened with ``opener(path, key=, num_images=)``, default ``ImageStore.open``)."""
    opener = opener or ImageStore.open
    try:
        os.rename(tmp, final)
    except OSError:  # another process placed its store first
        try:
            theirs = opener(final, key=key, num_images=n)
            log.info("Another process built %s first; using it.", final)
            return theirs
        except StoreError as e:
            log.warning("The store another process placed at %s is unusable (%s).", final, e)
            _discard(final)
            os.rename(tmp, final)
    return None


def _open_existing(
    stores_dir,
    final,
    root,
    key,
    n,
    image_size,
    short_side,
    *,
    opener=None,
    format=FORMAT_VERSION,
    kind: str = "decoded store",
):
    """The valid store at ``final`` (opened with ``opener``, default ``ImageStore.open``), or
    None (a bad one is discarded; stale ones of the same ``format`` are logged)."""
    opener = opener or ImageStore.open
    if os.path.exists(final):
        try:
            return opener(final, key=key, num_images=n)
        except StoreError as e:
            log.warning("The %s %s is unusable: %s. Rebuilding it.", kind, final, e)
            _discard(final)
    else:
        _warn_stale(stores_dir, root, key, image_size, short_side, format=format, kind=kind)
    return None
