"""Building, finding and checking stores on disk: the machinery both kinds of store share.

Owns what the decoded store (``store.py``) and the compressed store (``jpeg_store.py``) do
alike around their own data files: the key (``store_key``: SHA-256 over the kind of store,
the sizes and every file's relative path, size and mtime) and the store's folder
(``locate``); the manifest, written last (``write_manifest``), and the checks at every open
(``read_manifest``, ``check_data_files``: sizes and CRC-32, ``StoreError`` naming why a
store is unusable); finding a valid store or logging stale ones (``open_existing_store``);
and the build: a temporary folder named after its owner (``new_build_folder``, which first
removes the folders of builds whose process died), the decoding jobs run in spawned worker
processes that die with their parent (``run_decode_jobs``), and the atomic rename into place
(``rename_into_place``: when two processes build at once, the first rename wins and the other
uses that store). A build killed outright (SIGKILL, out of memory) leaks nothing for long:
its workers get a death signal when the building process dies (``_die_with_parent``), and
its folder, ``.build-<key>-<pid>-<host>-*``, is removed by the next build in that cache once
no process of that PID runs on that host (other hosts' build folders on a shared file
system are left alone). Each store module passes its own format, opener and decoding job.
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

from sagm_jax import formatting
from sagm_jax.data.decode import cpu_count, flat_paths

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_CRC_CHUNK = 16 << 20


class StoreError(Exception):
    """A store on disk that must not be used (incomplete, corrupt or not this dataset's)."""


def store_key(root: str, paths: list[str], image_size: int, short_side: int, kind: str) -> str:
    """SHA-256 over the store's ``kind`` and version (each kind of store names its own, so two
    kinds never share a key), the sizes and every file's (relative path, size, mtime_ns)."""
    digest = hashlib.sha256(f"sagm_jax {kind}\0{image_size}\0{short_side}\n".encode())
    for path in paths:
        st = os.stat(path)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def locate(index, image_size: int, short_side: int, stores_dir: str, kind: str):
    """(the folder ``index``'s files in flat id order, the store's key, its folder)."""
    paths = flat_paths(index)
    key = store_key(index.root, paths, image_size, short_side, kind)
    return paths, key, os.path.join(stores_dir, key)


def crc32_file(path: str) -> str:
    crc = 0
    buf = bytearray(_CRC_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


# ---- opening -----------------------------------------------------------------------
def read_manifest(path: str, *, key: str | None, num_images: int | None, format) -> dict:
    """The store's manifest, checked against the expected ``format`` (the kind of store), key
    and image count."""
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


def check_data_files(path: str, files: dict, *, check_data: bool) -> None:
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


def discard(path: str) -> None:
    """Remove a store folder: renamed away first (atomic), so no one opens it half-gone."""
    gone = os.path.join(os.path.dirname(path), f".discard-{uuid.uuid4().hex}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:  # another process removed it already
        return
    shutil.rmtree(gone, ignore_errors=True)


def _warn_stale(
    stores_dir: str, root: str, key: str, image_size: int, short_side: int, *, format, kind: str
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


def open_existing_store(
    stores_dir, final, root, key, n, image_size, short_side, *, opener, format, kind: str
):
    """The valid store at ``final`` (opened with ``opener(path, key=, num_images=)``), or None
    (a bad one is discarded; stale ones of the same ``format`` are logged, named ``kind``)."""
    if os.path.exists(final):
        try:
            return opener(final, key=key, num_images=n)
        except StoreError as e:
            log.warning("The %s %s is unusable: %s. Rebuilding it.", kind, final, e)
            discard(final)
    else:
        _warn_stale(stores_dir, root, key, image_size, short_side, format=format, kind=kind)
    return None


# ---- build folders -----------------------------------------------------------------
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
                discard(path)
            except OSError as e:  # another user's folder: not ours to remove
                log.warning("Could not remove %s (%s); delete it by hand.", path, e)


def new_build_folder(final: str, key: str) -> str:
    """A new temporary folder next to ``final`` for a build of the store ``key``, named
    ``.build-<key>-<pid>-<host>-*``; orphaned build folders there are removed first."""
    _remove_orphaned_builds(os.path.dirname(final))
    return tempfile.mkdtemp(prefix=_build_prefix(key), dir=os.path.dirname(final))


def rename_into_place(tmp: str, final: str, key: str, n: int, *, opener):
    """Rename ``tmp`` to ``final``; if another process placed a usable store first, return it
    (opened with ``opener(path, key=, num_images=)``)."""
    try:
        os.rename(tmp, final)
    except OSError:  # another process placed its store first
        try:
            theirs = opener(final, key=key, num_images=n)
            log.info("Another process built %s first; using it.", final)
            return theirs
        except StoreError as e:
            log.warning("The store another process placed at %s is unusable (%s).", final, e)
            discard(final)
            os.rename(tmp, final)
    return None


def write_manifest(
    tmp, key, n, image_size, short_side, shapes, root, start, *, names, format, extra=None
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


# ---- worker processes --------------------------------------------------------------
def job_plan(n: int, workers: int | None, most: int) -> tuple[int, int]:
    """(worker processes, files per job) for ``n`` files: ``workers`` (None = the usable
    cores), jobs of at most ``most`` files, about 8 jobs a worker."""
    workers = max(1, workers or cpu_count())
    return workers, max(1, min(most, math.ceil(n / (workers * 8))))


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


def run_decode_jobs(
    jobs: list, workers: int, n: int, *, progress: bool, decode, consume=None
) -> None:
    """Run ``decode`` (without ``consume``, it returns its image count) on every job, here or
    in spawned worker processes, with a bar. With ``consume``, each result is passed to
    ``consume`` IN JOB ORDER (it returns the image count), at most ``4 * workers`` jobs ahead of
    the oldest unconsumed one, so results wait in memory for a few jobs at most."""
    bar = formatting.progress(total=n, desc=f"Decoding {n:,} images once", unit="img",
                              disable=not progress)
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
