"""Reading a DomainBed image-folder dataset from disk: listing, checking, fingerprinting.

Layout: ``<dataset folder>/<domain>/<class>/<image>`` (nested sub-folders inside a
class folder allowed). Files are listed ourselves in torchvision ``ImageFolder`` order
(``splits.py`` states the rule) rather than through tensorflow-datasets' ``ImageFolder``
builder: that builder reads only ``split/label/image`` one level deep, decides its own
file order and does not keep the order DomainBed's splits are defined on, so a split
made through it would not be DomainBed's. The listed files are read by a source
(``dataset.Source``: tf.data in ``tf_input.py``, or the decoded store in ``store.py``).

Checks, done when a dataset is opened (``scan_image_folder``):

* the folder exists and has domain folders (else ``DatasetNotFoundError`` with the
  expected layout and where to get the data);
* every domain has the same class folders, and no class folder is empty
  (``DatasetLayoutError`` naming the folders);
* every image file decodes with PIL (``Image.open().verify()``, then a full
  ``load()``): else ``BadImageError`` naming the files, or, with
  ``skip_bad_files=True``, the files are dropped and reported (returned and logged).
  DomainBed itself sets PIL's ``LOAD_TRUNCATED_IMAGES`` and trains on truncated
  files silently; we refuse them unless told to skip. The result of the check is
  cached under ``cache_dir`` by a key over every file's relative path, size and
  modification time, so a changed file is checked again.

The fingerprint of the files used: counts per domain and class, the total, and the
SHA-256 of the sorted relative file list (posix separators, one path a line).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os

import numpy as np

from sagm_jax.data import splits as splits_lib

log = logging.getLogger(__name__)

# Formats tf.io.decode_image reads itself; the rest (TIFF, WebP, PPM/PGM, CMYK JPEG)
# are decoded with PIL inside the tf.data pipeline.
TF_NATIVE_FORMATS = frozenset({"JPEG", "MPO", "PNG", "BMP", "GIF"})


class DatasetNotFoundError(FileNotFoundError):
    """The data directory or the dataset folder is missing or empty."""


class DatasetLayoutError(ValueError):
    """The folder exists but is not a ``domain/class/image`` tree DomainBed can use."""


class BadImageError(ValueError):
    """Files with an image extension that do not decode."""


@dataclasses.dataclass
class FolderIndex:
    root: str
    env_names: list[str]
    class_names: list[str]
    paths: list[list[str]]  # per environment, ImageFolder order
    labels: list[np.ndarray]  # per environment, int32 class indices
    needs_pil: list[np.ndarray]  # per environment, bool: tf cannot decode it
    skipped: list[dict]  # [{'path': ..., 'reason': ...}] with skip_bad_files
    fingerprint: dict

    def relative_paths(self) -> list[list[str]]:
        return [[_relative(self.root, p) for p in env] for env in self.paths]


def _relative(root: str, path: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def check_image(path: str) -> tuple[str | None, bool]:
    """Returns ``(error, needs_pil)``: why the file does not decode (None if it does),
    and whether tf.io.decode_image cannot read it."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            image.load()
            needs_pil = image.format not in TF_NATIVE_FORMATS or image.mode == "CMYK"
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError...)
        return f"{type(e).__name__}: {e}", False
    return None, needs_pil


def cache_folder(name: str, cache_root: str | None = None) -> str:
    """``<cache root>/<name>``, where the data caches live: the decode checks ('verified')
    and the decoded stores ('stores', ``store.py``). The cache root is ``cache_root``,
    else ``$SAGM_JAX_CACHE``, else ``~/.cache/sagm_jax``."""
    if not cache_root:
        cache_root = os.environ.get("SAGM_JAX_CACHE", os.path.expanduser("~/.cache/sagm_jax"))
    return os.path.join(cache_root, name)


def _check_all(root: str, files: list[str], cache_dir: str | None) -> dict[str, tuple]:
    """Decode-check every file, with the cache. Returns {relative path: (error, needs_pil)}
    for the files that fail or need PIL (the rest are fine)."""
    key = hashlib.sha256()
    for path in files:
        st = os.stat(path)
        key.update(f"{_relative(root, path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    cache_file = os.path.join(cache_dir, key.hexdigest() + ".json") if cache_dir else None
    if cache_file and os.path.exists(cache_file):
        with open(cache_file) as f:
            return {rel: tuple(v) for rel, v in json.load(f).items()}
    workers = min(32, (os.cpu_count() or 1) * 2)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = pool.map(check_image, files, chunksize=64)
        notable = {_relative(root, p): r for p, r in zip(files, results) if r[0] or r[1]}
    if cache_file:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(notable, f)
        os.replace(tmp, cache_file)
    return notable


def scan_image_folder(
    root: str,
    *,
    missing_help: str,
    skip_bad_files: bool = False,
    verify_images: bool = True,
    cache_dir: str | None = "default",
) -> FolderIndex:
    """List, check and fingerprint ``root/<domain>/<class>/<image>`` (module doc)."""
    if cache_dir == "default":
        cache_dir = cache_folder("verified")
    if not os.path.isdir(root):
        raise DatasetNotFoundError(f"Dataset folder not found: {root}\n{missing_help}")
    env_names = splits_lib.list_domains(root)
    if not env_names:
        raise DatasetNotFoundError(
            f"Dataset folder {root} has no domain sub-folders.\n{missing_help}"
        )
    class_names, files_per_env = _list_files(root, env_names)

    notable = {}
    if verify_images:
        notable = _check_all(root, [p for env in files_per_env for p, _ in env], cache_dir)
    files_per_env, skipped = _leave_out_bad_files(
        root, env_names, class_names, files_per_env, notable, skip_bad_files
    )

    paths = [[p for p, _ in env] for env in files_per_env]
    labels = [np.asarray([y for _, y in env], dtype=np.int32) for env in files_per_env]
    needs_pil = [
        np.asarray([notable.get(_relative(root, p), (None, False))[1] for p in env], dtype=bool)
        for env in paths
    ]
    fingerprint = make_fingerprint(root, env_names, class_names, paths, labels)
    fingerprint["skipped"] = skipped
    return FolderIndex(root, env_names, class_names, paths, labels, needs_pil, skipped, fingerprint)


def _list_files(root: str, env_names: list[str]) -> tuple[list[str], list[list[tuple[str, int]]]]:
    """Class names and every domain's (path, label) list; DatasetLayoutError on a bad tree."""
    class_names = None
    files_per_env: list[list[tuple[str, int]]] = []
    for domain in env_names:
        domain_dir = os.path.join(root, domain)
        classes = splits_lib.list_classes(domain_dir)
        if not classes:
            raise DatasetLayoutError(
                f"Domain folder {domain_dir} has no class sub-folders; expected "
                f"{root}/<domain>/<class>/<image>."
            )
        if class_names is None:
            class_names, first_domain = classes, domain
        elif classes != class_names:
            only_here = sorted(set(classes) - set(class_names))
            only_there = sorted(set(class_names) - set(classes))
            raise DatasetLayoutError(
                f"Domains have different class folders: {domain_dir} has {len(classes)} "
                f"classes, {os.path.join(root, first_domain)} has {len(class_names)}; only in "
                f"{domain!r}: {only_here}; only in {first_domain!r}: {only_there}. Every domain "
                "must have the same class folders (labels are their sorted order)."
            )
        files_per_env.append(_list_domain_files(domain_dir, classes))
    return class_names, files_per_env


def _list_domain_files(domain_dir: str, classes: list[str]) -> list[tuple[str, int]]:
    """(path, label) of one domain's files, class by class; DatasetLayoutError on an empty class."""
    env_files = []
    for label, cls in enumerate(classes):
        found = splits_lib.list_class_files(os.path.join(domain_dir, cls))
        if not found:
            raise DatasetLayoutError(
                f"Empty class folder {os.path.join(domain_dir, cls)}: no files with an image "
                f"extension {splits_lib.IMAGE_EXTENSIONS} (case-insensitive), nested folders "
                "included."
            )
        env_files.extend((p, label) for p in found)
    return env_files


def _leave_out_bad_files(root, env_names, class_names, files_per_env, notable, skip_bad_files):
    """(files_per_env, skipped) without the files that do not decode; raises unless skipping."""
    bad = [
        (p, notable[_relative(root, p)][0])
        for env in files_per_env
        for p, _ in env
        if notable.get(_relative(root, p), (None,))[0]
    ]
    if not bad:
        return files_per_env, []
    listing = "\n".join(f"  {p}: {why}" for p, why in bad[:20])
    more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
    if not skip_bad_files:
        raise BadImageError(
            f"{len(bad)} file(s) under {root} have an image extension but do not decode:\n"
            f"{listing}{more}\nRe-download or remove them, or pass skip_bad_files=True "
            "to leave them out (the skipped files are then reported and recorded)."
        )
    bad_set = {p for p, _ in bad}
    skipped = [{"path": _relative(root, p), "reason": why} for p, why in bad]
    log.warning(
        "Skipping %d file(s) under %s that do not decode:\n%s%s", len(bad), root, listing, more
    )
    files_per_env = [[(p, y) for p, y in env if p not in bad_set] for env in files_per_env]
    for domain, env in zip(env_names, files_per_env):
        present = {y for _, y in env}
        for label, cls in enumerate(class_names):
            if label not in present:
                raise DatasetLayoutError(
                    f"Class folder {os.path.join(root, domain, cls)} has no decodable "
                    "image left after skipping bad files."
                )
    return files_per_env, skipped


def make_fingerprint(root, env_names, class_names, paths, labels) -> dict:
    counts = {
        domain: {cls: int(np.sum(env_labels == k)) for k, cls in enumerate(class_names)}
        for domain, env_labels in zip(env_names, labels)
    }
    relative = sorted(_relative(root, p) for env in paths for p in env)
    return {
        "counts": counts,
        "domain_totals": {d: int(sum(c.values())) for d, c in counts.items()},
        "total": int(sum(len(env) for env in paths)),
        "files_sha256": hashlib.sha256("\n".join(relative).encode("utf-8")).hexdigest(),
    }
