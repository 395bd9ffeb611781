"""DomainBed datasets, splits and input pipelines.

Owns: the data section of the config (``from_config``: the run's dataset), the
dataset registry (``DATASETS``, ``load``), DomainBed's split rule
(``domainbed_splits``, ``splits.py``), reading and checking image folders
(``image_folder.py``), the images decoded once into a store, or streamed, for
on-accelerator augmentation (``store.py``, ``open_source``), the in-memory MNIST-like
datasets (``mnist.py``), the augmentations (``augment.py``, TensorFlow) and the batches
(``pipeline.py``, ``tf_input.py``), and the ``verify`` command (``python -m
sagm_jax.data.verify``).

TensorFlow is imported only when an image-folder pipeline or an augmentation is
built, so importing this package does not start TensorFlow.
"""

import os

import jax

from sagm_jax.data.image_folder import BadImageError, DatasetLayoutError, DatasetNotFoundError
from sagm_jax.data.pipeline import (
    DomainBedData,
    eval_batch_size,
    eval_layout,
    sample_train_indices,
    to_global_batch,
)
from sagm_jax.data.registry import DATASETS, DatasetSpec, get_spec, load
from sagm_jax.data.splits import (
    IMAGE_EXTENSIONS,
    domainbed_splits,
    holdout_split,
    in_domain_split,
    seed_hash,
    write_split_record,
)
from sagm_jax.data.store import ImageStore, StreamingSource, open_source

__all__ = [
    "BadImageError",
    "DATASETS",
    "DatasetLayoutError",
    "DatasetNotFoundError",
    "DatasetSpec",
    "DomainBedData",
    "IMAGE_EXTENSIONS",
    "ImageStore",
    "StreamingSource",
    "domainbed_splits",
    "from_config",
    "eval_batch_size",
    "eval_layout",
    "get_spec",
    "holdout_split",
    "in_domain_split",
    "load",
    "open_source",
    "sample_train_indices",
    "seed_hash",
    "to_global_batch",
    "write_split_record",
]


def from_config(config, *, open_images: bool = True):
    """The run's dataset, opened and split as the config says. An image folder with
    ``config.input='device'`` is served from its decoded store (built on first use;
    ``open_images=False`` skips that, for callers that only need the split)."""
    cache_dir = config.cache_dir or None
    dataset = load(
        config.dataset,
        config.data_dir or None,
        trial_seed=config.trial_seed,
        holdout_fraction=config.holdout_fraction,
        split=config.split,
        skip_bad_files=config.skip_bad_files,
        data_seed=config.seed,
        image_size=config.image_size,
        **({"cache_dir": os.path.join(cache_dir, "verified")} if cache_dir else {}),
    )
    if open_images and dataset.folder is not None and config.input == "device":
        dataset.attach_source(
            open_source(
                dataset.folder,
                image_size=config.image_size,
                short_side=config.store_short_side,
                mode=config.image_store,
                budget_gb=config.store_budget_gb,
                cache_dir=cache_dir,
                progress=jax.process_index() == 0,
            )
        )
    return dataset

