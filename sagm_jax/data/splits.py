"""DomainBed's file order and split rules, and the record of a run's split.

File order (torchvision ``ImageFolder``, which DomainBed uses and whose order its
splits depend on):

* environments are the sub-folders of the dataset folder, sorted by name;
* classes are the sorted names of the sub-folders of each environment;
* for each class in that order, ``sorted(os.walk(class_dir, followlinks=True))``
  (sorted by the walked folder's path string), and in each folder its file names
  sorted; a file is kept when its lower-cased name ends with one of
  ``IMAGE_EXTENSIONS``. Nested sub-folders of a class therefore count as that class.

Split rule (DomainBed ``misc.split_dataset``), for environment ``i`` with ``n``
examples and a trial seed::

    seed_hash(*args) = int(md5(str(args).encode('utf-8')).hexdigest(), 16) % 2**31
    keys = list(range(n)); np.random.RandomState(seed_hash(trial_seed, i)).shuffle(keys)
    out = keys[:int(n * holdout_fraction)]; in = keys[int(n * holdout_fraction):]

Both index lists keep the shuffled order, as DomainBed's ``_SplitDataset`` does.

Full-data split (ERM++'s second stage, :func:`full_data_split`): 'in' is every key, 'out'
DomainBed's 'out' (inside 'in', for the record's keys only).

In-domain split (the 60/20/20 train/val/test of the paper's Table 2), defined here
with the same shuffled keys, so that its validation part IS DomainBed's "out" split
and the model selection data are unchanged between the two experiments::

    v = int(n * 0.2); t = int(n * 0.2)
    val = keys[:v]; test = keys[v:v + t]; train = keys[v + t:]
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from sagm_jax.training import rundir

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def seed_hash(*args) -> int:
    """DomainBed's seed derivation: md5 of ``str(args)``, modulo 2**31."""
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def shuffled_keys(n: int, trial_seed: int, env_index: int) -> np.ndarray:
    keys = list(range(n))
    np.random.RandomState(seed_hash(trial_seed, env_index)).shuffle(keys)
    return np.asarray(keys, dtype=np.int64)


def holdout_split(
    n: int, trial_seed: int, env_index: int, holdout_fraction: float = 0.2
) -> dict[str, np.ndarray]:
    """DomainBed's split of one environment: ``{'in': ..., 'out': ...}`` indices."""
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    keys = shuffled_keys(n, trial_seed, env_index)
    n_out = int(n * holdout_fraction)
    return {"in": keys[n_out:], "out": keys[:n_out]}


def in_domain_split(
    n: int, trial_seed: int, env_index: int, val_fraction: float = 0.2, test_fraction: float = 0.2
) -> dict[str, np.ndarray]:
    """The 60/20/20 split: ``{'in': train, 'out': val, 'test': test}`` (see module doc)."""
    keys = shuffled_keys(n, trial_seed, env_index)
    n_val, n_test = int(n * val_fraction), int(n * test_fraction)
    return {"in": keys[n_val + n_test :], "out": keys[:n_val], "test": keys[n_val : n_val + n_test]}


def full_data_split(
    n: int, trial_seed: int, env_index: int, holdout_fraction: float = 0.2
) -> dict[str, np.ndarray]:
    """ERM++'s second stage (DomainBed ``scripts/train_autolr.py``, ``holdout_fraction =
    0``): ``'in'`` is the whole environment (the shuffled keys), so a training
    environment trains on all of it and a test environment's ``'in'`` accuracy is the
    whole environment's (the reference's ``fd_env{i}_in_acc``); ``'out'`` is the DomainBed
    split's ``'out'``, a part of ``'in'`` kept so that a record has every key a run's
    has: its accuracies are not held out, and no model selection should read them."""
    keys = shuffled_keys(n, trial_seed, env_index)
    return {"in": keys, "out": holdout_split(n, trial_seed, env_index, holdout_fraction)["out"]}


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def list_classes(domain_dir: str) -> list[str]:
    return sorted(e.name for e in os.scandir(domain_dir) if e.is_dir())


def list_class_files(class_dir: str, check_folder=None) -> list[str]:
    """Image files under one class folder, nested folders included, in ImageFolder order.
    ``check_folder(folder, sub_folders)`` sees each folder before its sub-folders are
    entered: ``image_folder`` refuses a symlink loop there, before following it."""
    walked = []
    for folder, sub_folders, names in os.walk(class_dir, followlinks=True):
        if check_folder is not None:
            check_folder(folder, sub_folders)
        walked.append((folder, names))
    files = []
    for folder, names in sorted(walked):
        files.extend(os.path.join(folder, name) for name in sorted(names) if is_image_file(name))
    return files


def list_domains(root: str) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir())


def domainbed_splits(
    root: str, trial_seed: int, holdout_fraction: float = 0.2
) -> list[tuple[list[str], list[str]]]:
    """For each environment (sorted domain folder) of ``root``: ``(in_paths, out_paths)``.

    ``root`` is a dataset folder, e.g. ``<data_dir>/PACS``. Files are listed in
    ImageFolder order and split by DomainBed's rule (module doc). This only lists
    files; ``sagm_jax.data.load`` also checks the layout and that the images decode.
    """
    result = []
    for env_index, domain in enumerate(list_domains(root)):
        domain_dir = os.path.join(root, domain)
        paths = [
            p
            for c in list_classes(domain_dir)
            for p in list_class_files(os.path.join(domain_dir, c))
        ]
        split = holdout_split(len(paths), trial_seed, env_index, holdout_fraction)
        result.append(([paths[k] for k in split["in"]], [paths[k] for k in split["out"]]))
    return result


def split_record(dataset) -> dict:
    """The record of ``dataset``'s (``DomainBedData``) split, as JSON reads it back: its
    fingerprint and split rule and, per environment, the index lists of each split part
    (indices into the environment's example order) and, for image folders, the relative
    file paths of each part."""
    relative_paths = dataset.folder.relative_paths() if dataset.folder is not None else None
    envs = []
    for env_index, (name, parts) in enumerate(zip(dataset.env_names, dataset.splits)):
        entry = {
            "env": env_index,
            "name": name,
            "indices": {part: [int(i) for i in idx] for part, idx in parts.items()},
        }
        if relative_paths is not None:
            entry["files"] = {
                part: [relative_paths[env_index][int(i)] for i in idx]
                for part, idx in parts.items()
            }
        envs.append(entry)
    record = {
        "dataset": dataset.name,
        "trial_seed": dataset.trial_seed,
        "holdout_fraction": dataset.holdout_fraction,
        "split": dataset.split_kind,
        "fingerprint": dataset.fingerprint,
        "environments": envs,
    }
    return json.loads(json.dumps(record))


def write_split_record(workdir: str, dataset) -> str:
    """Write ``<workdir>/split.json``, the :func:`split_record` of ``dataset``. Returns
    the file path. Only a run that starts from step 0 writes it; a resumed or finished
    one checks it (:func:`check_split_record`)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, rundir.SPLIT)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(split_record(dataset), f)
    os.replace(tmp, path)
    return path


class DataChangedError(ValueError):
    """The dataset differs from the one a run's ``split.json`` records."""


def check_split_record(workdir: str, dataset) -> None:
    """Raises :class:`DataChangedError` unless ``dataset`` is the data and split recorded
    in ``<workdir>/split.json``: a run that resumed, or a finished run relaunched, on
    other data would mix records of two datasets (or report one it was not trained on)."""
    path = os.path.join(workdir, rundir.SPLIT)
    advice = (
        "restore the data as it was when the run started, or start over with a new "
        "--workdir."
    )
    try:
        with open(path) as f:
            recorded = json.load(f)
    except (OSError, ValueError) as error:
        raise DataChangedError(
            f"{path}: cannot read the run's split record ({error}), so the data of this "
            f"run cannot be checked. Restore the file, or start over with a new --workdir."
        ) from None
    changes = split_changes(recorded, split_record(dataset))
    if changes:
        raise DataChangedError(
            f"{path}: the dataset changed since this run started: {'; '.join(changes)}. "
            f"Its records and checkpoints come from the recorded data; {advice}"
        )


KEPT = ("indices", "files")  # what split.json keeps of each part


def split_changes(recorded: dict, current: dict) -> list[str]:
    """What differs between two :func:`split_record` s, in words (``[]``: the same)."""
    changes = [
        f"{key} {recorded.get(key)!r} -> {current.get(key)!r}"
        for key in ("dataset", "trial_seed", "holdout_fraction", "split")
        if recorded.get(key) != current.get(key)
    ]
    changes += fingerprint_changes(recorded.get("fingerprint", {}), current["fingerprint"])
    old_envs = {e["name"]: e for e in recorded.get("environments", [])}
    for env in current["environments"]:
        old = old_envs.get(env["name"], {})
        parts = [
            part
            for part in sorted(set(env["indices"]) | set(old.get("indices", {})))
            if any(old.get(k, {}).get(part) != env.get(k, {}).get(part) for k in KEPT)
        ]
        if parts:
            changes.append(f"environment `{env['name']}`: {_parts(parts)} of the split differ")
    return changes


def fingerprint_changes(recorded: dict, current: dict) -> list[str]:
    """What differs between two dataset fingerprints: image counts per environment and
    class, the file list, the arrays, the skipped files."""
    changes = []
    old_totals, new_totals = recorded.get("domain_totals", {}), current.get("domain_totals", {})
    for env in list(old_totals) + [e for e in new_totals if e not in old_totals]:
        old_counts = recorded.get("counts", {}).get(env, {})
        new_counts = current.get("counts", {}).get(env, {})
        classes = [
            f"class `{c}`: {old_counts.get(c, 0)} -> {new_counts.get(c, 0)}"
            for c in sorted(set(old_counts) | set(new_counts))
            if old_counts.get(c) != new_counts.get(c)
        ]
        old, new = old_totals.get(env, "no"), new_totals.get(env, "no")
        if old != new:
            detail = f" ({', '.join(classes)})" if classes else ""
            changes.append(f"environment `{env}`: {old} -> {new} images{detail}")
        elif classes:
            changes.append(f"environment `{env}`: {', '.join(classes)}")
    counted = {"counts", "domain_totals", "total"}
    if changes:  # the digests of the files or arrays then differ too
        counted |= {"files_sha256", "arrays_sha256"}
    for key in sorted((set(recorded) | set(current)) - counted):
        if recorded.get(key) != current.get(key):
            changes.append(FINGERPRINT_WORDS.get(key, f"fingerprint `{key}` differs"))
    return changes


FINGERPRINT_WORDS = {
    "files_sha256": "the list of image files differs (files renamed, moved or replaced)",
    "arrays_sha256": "the images or labels differ",
    "skipped": "the skipped unreadable files differ",
}


def _parts(parts: list[str]) -> str:
    return "the " + " and ".join(f"'{p}'" for p in parts) + " lists"
