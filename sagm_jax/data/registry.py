"""The dataset registry: name -> ``DatasetSpec``, and ``load``.

The one list of dataset names: each entry holds the dataset's environments, its config
file (``configs/*.py``) and whether the paper reports it; the config checks, the sweep
and the result tables import it (``PAPER_DATASETS``, ``CONFIG_FILES``).

Folder datasets read ``<data_dir>/<folder>/<domain>/<class>/<image>``; the published
counts are DomainBed's (per-domain counts where the dataset papers give them).
"ImageFolder" is any such tree a researcher brings: ``data_dir`` is then the folder
whose sub-folders are the domains. The MNIST-like datasets are built in memory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from sagm_jax.data import splits as splits_lib
from sagm_jax.data.mnist import COLOR_ENV_NAMES, ROTATIONS

DOWNLOAD_HELP = (
    "DomainBed's downloader (domainbed/scripts/download.py in "
    "https://github.com/facebookresearch/DomainBed) fetches each dataset into this layout, "
    'one function per dataset, from a clone: python -c "from domainbed.scripts import '
    "download; download.download_pacs('DATA_DIR')\" (README 'Getting the data'). Then pass "
    "--config.data_dir=DATA_DIR to sagm_jax.main (--data_dir=DATA_DIR to sagm_jax.data.verify)."
)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    kind: str  # 'folder' | 'array'
    folder: str | None = None  # sub-folder of data_dir ('folder' kind)
    domains: tuple[str, ...] | None = None  # environments: published domain folders, sorted
    num_classes: int | None = None
    total: int | None = None  # published image count
    domain_totals: dict | None = None  # published per-domain counts, if known
    homepage: str = ""
    note: str = ""
    build: Callable | None = None  # 'array' kind: (data_dir, data_seed) -> ArraySource
    config_file: str | None = None  # its get_config(), relative to the repository
    in_paper: bool = False  # one of the paper's five benchmarks (Table 1's columns)
    env_unit: str = ""  # after an environment's name in tables and summaries: "°" (15°)

    def missing_help(self, data_dir: str) -> str:
        if self.name == "ImageFolder":
            return (
                "Expected layout: DATA_DIR/<domain>/<class>/<image> (domains and classes "
                "are folder names; every domain has the same class folders)."
            )
        domains = ", ".join(self.domains)
        return (
            f"Expected layout: {os.path.join(data_dir, self.folder)}/<domain>/<class>/<image> "
            f"with domains [{domains}], {self.num_classes} classes, {self.total:,} images"
            f"{' (' + self.note + ')' if self.note else ''}.\n{DOWNLOAD_HELP}\n"
            f"Dataset homepage: {self.homepage}"
        )


# The paper's five benchmarks, in the order of its tables: (name, folder under
# data_dir, classes, published images, homepage).
_BENCHMARKS = (
    ("PACS", "PACS", 7, 9991, "https://domaingeneralization.github.io/"),
    ("VLCS", "VLCS", 5, 10729, "https://github.com/belaalb/G2DM#download-vlcs"),
    ("OfficeHome", "office_home", 65, 15588, "https://www.hemanthdv.org/officeHomeDataset.html"),
    (
        "TerraIncognita",
        "terra_incognita",
        10,
        24788,
        "https://lila.science/datasets/caltech-camera-traps",
    ),
    ("DomainNet", "domain_net", 345, 586575, "http://ai.bu.edu/M3SDA/"),
)
# Their domain folders, sorted, with each one's published image count where known.
_DOMAINS = {
    "PACS": {"art_painting": 2048, "cartoon": 2344, "photo": 1670, "sketch": 3929},
    "VLCS": {"Caltech101": 1415, "LabelMe": 2656, "SUN09": 3282, "VOC2007": 3376},
    "OfficeHome": {"Art": 2427, "Clipart": 4365, "Product": 4439, "Real World": 4357},
    "TerraIncognita": dict.fromkeys(["location_100", "location_38", "location_43", "location_46"]),
    "DomainNet": dict.fromkeys(["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]),
}
_NOTES = {
    "TerraIncognita": "DomainBed's download.py selects the four locations and ten classes",
    "DomainNet": "before DomainBed's download.py removes its listed duplicates, so a "
    "DomainBed download has slightly fewer",
}


def _benchmark(name, folder, num_classes, total, homepage) -> DatasetSpec:
    """One of the paper's image-folder benchmarks (the tables above)."""
    domains = _DOMAINS[name]
    return DatasetSpec(
        name,
        "folder",
        folder,
        tuple(domains),
        num_classes,
        total,
        domains if None not in domains.values() else None,
        homepage=homepage,
        note=_NOTES.get(name, ""),
        config_file=f"configs/{folder.lower()}.py",
        in_paper=True,
    )


def _array(name, build_name, domains, num_classes, env_unit="") -> DatasetSpec:
    """An in-memory dataset built by ``mnist.<build_name>``, configured by
    ``configs/<build_name>.py``."""

    def build(data_dir, data_seed):
        from sagm_jax.data import mnist

        return getattr(mnist, build_name)(data_dir, data_seed)

    return DatasetSpec(
        name=name,
        kind="array",
        domains=domains,
        num_classes=num_classes,
        build=build,
        config_file=f"configs/{build_name}.py",
        env_unit=env_unit,
    )


_ROTATION_ENVS = tuple(str(angle) for angle in ROTATIONS)

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        *(_benchmark(*row) for row in _BENCHMARKS),
        # Its environments are the folders of the researcher's data_dir.
        DatasetSpec("ImageFolder", "folder", config_file="configs/image_folder.py"),
        _array("RotatedMNIST", "rotated_mnist", _ROTATION_ENVS, 10, env_unit="°"),
        _array("ColoredMNIST", "colored_mnist", COLOR_ENV_NAMES, 2),
        _array("RotatedDigits", "rotated_digits", _ROTATION_ENVS, 10, env_unit="°"),
    )
}

# The paper's five benchmarks, in the order of its tables.
PAPER_DATASETS = tuple(name for name, spec in DATASETS.items() if spec.in_paper)
# The config file of every dataset that has one.
CONFIG_FILES = {name: spec.config_file for name, spec in DATASETS.items() if spec.config_file}


def env_label(dataset: str, env: int, env_names=None) -> str:
    """How the result tables and the run summary name environment ``env`` of ``dataset``:
    its name from ``env_names`` with the dataset's unit (RotatedMNIST's ``15°``, PACS's
    ``cartoon``), or ``env{env}`` where the names are not known."""
    if not env_names:
        return f"env{env}"
    spec = DATASETS.get(dataset)
    return env_names[env] + (spec.env_unit if spec else "")


def get_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid names: {sorted(DATASETS)}")
    return DATASETS[name]


def dataset_root(spec: DatasetSpec, data_dir: str) -> str:
    return data_dir if spec.folder is None else os.path.join(data_dir, spec.folder)


def _check_layout(spec: DatasetSpec, index, data_dir: str) -> None:
    """Raises DatasetLayoutError if the folder's classes or domains are not the published ones."""
    from sagm_jax.data import image_folder

    if spec.num_classes is not None and len(index.class_names) != spec.num_classes:
        raise image_folder.DatasetLayoutError(
            f"{spec.name} at {index.root} has {len(index.class_names)} classes, expected "
            f"{spec.num_classes}.\n{spec.missing_help(data_dir)}"
        )
    if spec.domains is not None and tuple(index.env_names) != spec.domains:
        raise image_folder.DatasetLayoutError(
            f"{spec.name} at {index.root} has domains {index.env_names}, expected "
            f"{list(spec.domains)}.\n{spec.missing_help(data_dir)}"
        )


def folder_problems(spec: DatasetSpec, data_dir: str) -> list[str]:
    """Every problem of an image-folder dataset's tree under ``data_dir`` that listing
    its folders finds (``image_folder.layout_problems``; no image is opened), and, for a
    published dataset, class folders or domains other than the published ones (what
    :func:`_check_layout` raises once the data is opened), one line each."""
    from sagm_jax.data import image_folder

    root = dataset_root(spec, data_dir)
    problems = image_folder.layout_problems(root)
    domains = splits_lib.list_domains(root)
    classes = sorted({c for d in domains for c in splits_lib.list_classes(os.path.join(root, d))})
    where = f"{spec.name} at {root}"
    if spec.num_classes is not None and classes and len(classes) != spec.num_classes:
        problems.append(
            f"{where} has {len(classes)} class folders ({', '.join(classes)}), expected "
            f"{spec.num_classes}: is data_dir the folder holding {spec.folder}/, or is this "
            f"another dataset? `python -m sagm_jax.data.verify --dataset={spec.name} "
            "--data_dir=DATA_DIR` compares it with the published counts."
        )
    if spec.domains is not None and domains and tuple(domains) != spec.domains:
        problems.append(
            f"{where} has domains {', '.join(domains)}, expected {', '.join(spec.domains)} "
            "(the domain folders' names)."
        )
    return problems


def tf_data_source(index, image_size: int):
    """The tf.data source of an image folder (imports TensorFlow: called only when chosen)."""
    from sagm_jax.data import tf_input

    return tf_input.TFDataSource(index, image_size)


# The split rules ``load`` takes (``splits.py``).
SPLITS = ("domainbed", "in_domain", "full_data")


def load(
    name: str,
    data_dir: str | None,
    *,
    trial_seed: int,
    holdout_fraction: float = 0.2,
    split: str = "domainbed",
    skip_bad_files: bool = False,
    verify_images: bool = True,
    cache_dir: str | None = "default",
    data_seed: int = 0,
    image_size: int = 224,
    check_layout: bool = True,
    open_images: Callable | None = tf_data_source,
):
    """Open dataset ``name`` and split it for ``trial_seed``; returns ``DomainBedData``.

    split: 'domainbed' (in/out by ``holdout_fraction``), 'in_domain' (the 60/20/20
    train/val/test of the paper's Table 2 as 'in'/'out'/'test') or 'full_data' (ERM++'s
    second stage: 'in' the whole environment; see ``splits.py``).
    skip_bad_files: drop files that do not decode instead of raising (reported in
    ``.skipped`` and the fingerprint). verify_images: decode-check every file (cached
    in ``cache_dir``; None disables the cache). data_seed: the shuffle and coin flips
    of the MNIST-like datasets. image_size: side of the model input for image folders.
    check_layout=False opens a folder whose domains or class count differ from the
    published ones (``verify`` reports the differences after printing the counts).
    open_images: for image folders, ``(FolderIndex, image_size) -> dataset.Source``,
    where the batches come from (default tf.data, :func:`tf_data_source`;
    ``canvas.CanvasSource.open`` for the decoded store); None opens the split alone.
    """
    from sagm_jax.data import image_folder
    from sagm_jax.data.dataset import DomainBedData

    spec = get_spec(name)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    if spec.kind == "array":
        source = spec.build(data_dir, data_seed)
        return DomainBedData.from_arrays(
            name, source, trial_seed=trial_seed, holdout_fraction=holdout_fraction, split=split
        )
    if not data_dir or not os.path.isdir(data_dir):
        raise image_folder.DatasetNotFoundError(
            f"Data directory not found: {data_dir!r}\n{spec.missing_help(data_dir or 'DATA_DIR')}"
        )
    index = image_folder.scan_image_folder(
        dataset_root(spec, data_dir),
        missing_help=spec.missing_help(data_dir),
        skip_bad_files=skip_bad_files,
        verify_images=verify_images,
        cache_dir=cache_dir,
    )
    if check_layout:
        _check_layout(spec, index, data_dir)
    source = open_images(index, image_size) if open_images is not None else None
    return DomainBedData.from_folder(
        name,
        index,
        source,
        trial_seed=trial_seed,
        holdout_fraction=holdout_fraction,
        split=split,
        image_size=image_size,
    )
