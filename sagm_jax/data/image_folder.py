"""Reading a DomainBed image-folder dataset from disk: listing, checking, fingerprinting.

Layout: ``<dataset folder>/<domain>/<class>/<image>`` (nested sub-folders inside a
class folder allowed). Files are listed ourselves in torchvision ``ImageFolder`` order
(``splits.py`` states the rule) rather than through tensorflow-datasets' ``ImageFolder``
builder: that builder reads only ``split/label/image`` one level deep, decides its own
file order and does not keep the order DomainBed's splits are defined on, so a split
made through it would not be DomainBed's. The listed files are read by a source
(``dataset.Source``: tf.data in ``tf_input.py``, or the decoded store in ``store.py``).

Before a run, ``layout_problems`` lists the folders alone (no image is opened) and
returns every problem of the tree at once, for the command line's checks: no domain
folder, a flat domain (images but no class folders), an empty domain, a class folder
with no image, domains whose class folders differ.

Checks, done when a dataset is opened (``scan_image_folder``):

* the folder exists and has domain folders (else ``DatasetNotFoundError`` with the
  expected layout and where to get the data);
* every domain has the same class folders, and no class folder is empty
  (``DatasetLayoutError`` naming the folders);
* symlinks are followed, as ImageFolder does, so a dataset may be assembled from links
  to domain folders, class folders or files elsewhere; but each folder and each image is
  reached once: a symlink loop (``ln -s . cat/loop``, or up to the dataset folder), a
  folder reached twice (a link into another class, which would relabel its images) or an
  image listed twice (a link next to its target) is a ``DatasetLayoutError`` naming the
  link and its target (``_LinkGuard``). torchvision follows such loops until the path is
  too deep and lists every image again at each level;
* every image file decodes with PIL (``Image.open().verify()``, then a full
  ``load()``): else ``BadImageError`` naming the files, or, with
  ``skip_bad_files=True``, the files are dropped and reported (returned and logged).
  DomainBed itself sets PIL's ``LOAD_TRUNCATED_IMAGES`` and trains on truncated
  files silently; we refuse them unless told to skip. The result of the check is
  cached under ``cache_dir`` by a key over every file's relative path, size and
  modification time, so a changed file is checked again. A damaged cache file is
  checked again and rewritten, and a cache that cannot be written (read-only) is only
  a warning: the images are then checked on every run.

The fingerprint of the files used: counts per domain and class, the total, and the
SHA-256 of the sorted relative file list (posix separators, one path a line).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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
    if cache_file:
        cached = _read_checks(cache_file)
        if cached is not None:
            return cached
    workers = min(32, (os.cpu_count() or 1) * 2)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = pool.map(check_image, files, chunksize=64)
        notable = {_relative(root, p): r for p, r in zip(files, results) if r[0] or r[1]}
    if cache_file:
        _write_checks(cache_dir, cache_file, notable)
    return notable


def _read_checks(cache_file: str) -> dict[str, tuple] | None:
    """The cached checks, or None if there are none. A damaged file is logged and None
    returned, so the images are checked again and the file rewritten (as a damaged
    store is rebuilt): a cache never decides what a run reads."""
    try:
        with open(cache_file) as f:
            cached = json.load(f)
        checks = {rel: (error, needs_pil) for rel, (error, needs_pil) in cached.items()}
        if not all(
            isinstance(error, (str, type(None))) and isinstance(needs_pil, bool)
            for error, needs_pil in checks.values()
        ):
            raise ValueError("an entry is not [error or null, needs_pil]")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:  # truncated, not a dict...
        log.warning(
            "The decode-check cache %s is damaged (%s: %s); the images are checked again "
            "and the file rewritten.",
            cache_file,
            type(e).__name__,
            e,
        )
        return None
    return checks


def _write_checks(cache_dir: str, cache_file: str, notable: dict) -> None:
    """Write the checks to ``cache_file`` (atomic). A cache that cannot be written (a
    read-only or shared folder) is logged, not an error: the run reads the images, and
    only the next run pays for checking them again."""
    tmp = f"{cache_file}.{os.getpid()}.tmp"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(notable, f)
        os.replace(tmp, cache_file)
    except OSError as e:
        log.warning(
            "The decode-check cache %s is read-only or cannot be written (%s): the images "
            "were checked, but the result is not cached and the next run checks them again. "
            "Make the folder writable or set cache_dir to a writable folder.",
            cache_dir,
            e,
        )
        with contextlib.suppress(OSError):
            os.remove(tmp)


def layout_problems(root: str) -> list[str]:
    """Every problem of the tree ``root/<domain>/<class>/<image>`` that listing its
    folders finds, one line each (empty: none): no domain folder, a domain holding images
    but no class folder (a flat layout), an empty domain, a class folder without an image
    file (nested folders included), and each domain that lacks class folders another has.
    Cheap: each class folder is listed only until its first image; nothing is decoded.
    ``scan_image_folder`` raises the first of them when the data is opened."""
    expected = f"expected {root}/<domain>/<class>/<image>"
    domains = splits_lib.list_domains(root)
    if not domains:
        loose = _image_names(root)
        held = f" (it holds {len(loose)} image file(s) directly: a flat layout)" if loose else ""
        return [f"Dataset folder {root} has no domain sub-folders{held}; {expected}."]
    problems, classes_of = [], {}
    for domain in domains:
        domain_dir = os.path.join(root, domain)
        classes = splits_lib.list_classes(domain_dir)
        if not classes:
            loose = _image_names(domain_dir)
            problems.append(
                f"Domain folder {domain_dir} holds {len(loose)} image file(s) but no class "
                f"sub-folders (a flat layout); {expected}, one folder per class."
                if loose
                else f"Domain folder {domain_dir} is empty (no class sub-folders); {expected}."
            )
            continue
        classes_of[domain] = classes
        problems += [
            f"Empty class folder {os.path.join(domain_dir, c)}: no files with an image "
            f"extension {splits_lib.IMAGE_EXTENSIONS} (case-insensitive), nested folders "
            "included."
            for c in classes
            if not _holds_an_image(os.path.join(domain_dir, c))
        ]
    every = sorted(set().union(*classes_of.values()))
    for domain, classes in classes_of.items():
        if missing := sorted(set(every) - set(classes)):
            having = [d for d, c in classes_of.items() if set(missing) & set(c)]
            problems.append(
                f"Domains have different class folders: domain {domain} lacks the class "
                f"folder(s) {missing} that {', '.join(having)} ha{'ve' if len(having) > 1 else 's'}"
                f" ({root}); every domain must have the same class folders (labels are "
                "their sorted order)."
            )
    return problems


def _image_names(folder: str) -> list[str]:
    return [e.name for e in os.scandir(folder) if e.is_file() and splits_lib.is_image_file(e.name)]


def _holds_an_image(folder: str) -> bool:
    """Whether ``folder`` or a folder below it (symlinks followed, each folder once, so a
    loop ends) holds a file with an image extension; stops at the first."""
    seen, stack = set(), [folder]
    while stack:
        path = stack.pop()
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        if any(splits_lib.is_image_file(e.name) and e.is_file() for e in entries):
            return True
        stack += [e.path for e in entries if e.is_dir()]
    return False


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
    links = _LinkGuard(root)
    class_names = _class_names(root, env_names, links)
    files_per_env = [
        _list_domain_files(os.path.join(root, domain), class_names, links) for domain in env_names
    ]
    links.check_linked_files()
    return class_names, files_per_env


def _class_names(root: str, env_names: list[str], links: _LinkGuard) -> list[str]:
    """The class folders every domain has; each domain and class folder reached once."""
    class_names = None
    for domain in env_names:
        domain_dir = os.path.join(root, domain)
        links.add(domain_dir, "domain folder", root)
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
        for cls in classes:  # all of them before any is walked: a link into one is caught
            links.add(os.path.join(domain_dir, cls), "class folder", domain_dir)
    return class_names


def _list_domain_files(domain_dir: str, classes: list[str], links) -> list[tuple[str, int]]:
    """(path, label) of one domain's files, class by class; DatasetLayoutError on an empty class."""
    env_files = []
    for label, cls in enumerate(classes):
        found = splits_lib.list_class_files(os.path.join(domain_dir, cls), links.add_sub_folders)
        if not found:
            raise DatasetLayoutError(
                f"Empty class folder {os.path.join(domain_dir, cls)}: no files with an image "
                f"extension {splits_lib.IMAGE_EXTENSIONS} (case-insensitive), nested folders "
                "included."
            )
        links.note_linked_files(found)
        env_files.extend((p, label) for p in found)
    return env_files


class _LinkGuard:
    """Symlinks are followed (datasets are often assembled from links to elsewhere), but
    each folder and each image of the tree is reached once: a loop would list the same
    images again and again, and a link into another class would relabel its images.

    ``reached``: real path of each folder -> (the path it was reached by, what it is, the
    symlink it was reached through or None); ``folders``: walked path -> (real path, that
    symlink). Folders below an unlinked one take their real path from it, so only links
    cost a ``realpath``."""

    def __init__(self, root: str):
        self.root = root
        self.reached: dict[str, tuple[str, str, str | None]] = {}
        self.folders: dict[str, tuple[str, str | None]] = {}
        self.listed: set[str] = set()  # real paths of the folders whose images are listed
        self.linked_files: list[tuple[str, str, str]] = []  # (real path, path, link text)
        self.add(root, "the dataset folder")

    def add(self, path: str, what: str, parent: str | None = None) -> None:
        """Register the folder ``path`` (in the walked folder ``parent``); raise if reached."""
        is_link = os.path.islink(path)
        link = f"{path} -> {os.readlink(path)}" if is_link else None
        if parent is None:
            real = os.path.realpath(path)
        elif is_link:
            real = os.path.realpath(path)
            self._refuse_loop(real, self.folders[parent][0], link)
        else:  # below an unlinked folder: no realpath needed
            parent_real, link = self.folders[parent]
            real = os.path.join(parent_real, os.path.basename(path))
        if real in self.reached:
            first, first_what, first_link = self.reached[real]
            links = " and ".join(dict.fromkeys(x for x in (link, first_link) if x))
            through = f", through the symlink {links}" if links else ""
            raise DatasetLayoutError(
                f"Folder {real} is reached twice under {self.root}: as {path} and as {first} "
                f"({first_what}){through}. Its images would be listed "
                "twice, under two labels if the two are in different classes. Remove the link "
                "(a folder may be linked into the dataset once)."
            )
        self.reached[real] = (path, what, link)
        self.folders[path] = (real, link)
        if what not in ("the dataset folder", "domain folder"):
            self.listed.add(real)

    def _refuse_loop(self, real: str, parent_real: str, link: str) -> None:
        def contains(folder, inner):
            return inner == folder or inner.startswith(folder.rstrip(os.sep) + os.sep)

        if contains(real, self.folders[self.root][0]):
            inside = f"the dataset folder {self.root}, so every class's images would be "
            inside += "listed again and again, labelled as this one"
        elif contains(real, parent_real):
            inside = "the folder the link is in, so its images would be listed again and again"
        else:
            return
        raise DatasetLayoutError(
            f"Symlink loop: {link} points to {real}, which contains {inside}. Remove the link."
        )

    def add_sub_folders(self, folder: str, sub_folders: list[str]) -> None:
        for name in sorted(sub_folders):
            self.add(os.path.join(folder, name), "sub-folder", folder)

    def note_linked_files(self, paths: list[str]) -> None:
        for path in paths:
            if os.path.islink(path):
                self.linked_files.append(
                    (os.path.realpath(path), path, f"{path} -> {os.readlink(path)}")
                )

    def check_linked_files(self) -> None:
        """A linked image whose target is listed too (directly or through another link)."""
        seen = {}
        for real, path, link in self.linked_files:
            if real in seen:
                first, first_link = seen[real]
            elif (
                os.path.dirname(real) in self.listed
                and splits_lib.is_image_file(real)
                and os.path.isfile(real)
            ):
                first, first_link = real, None
            else:
                seen[real] = (path, link)
                continue
            through = " and ".join(x for x in (link, first_link) if x)
            raise DatasetLayoutError(
                f"Image {real} is listed twice under {self.root}: as {path} and as {first}, "
                f"through the symlink {through}. Remove the extra link."
            )


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
            f"{listing}{more}\nRe-download or remove them, or pass "
            "--config.skip_bad_files=True (sagm_jax.data.verify: --skip_bad_files) to leave "
            "them out (the skipped files are then reported and recorded)."
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
