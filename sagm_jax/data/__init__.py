"""DomainBed datasets, splits and input pipelines.

Owns: the data section of the config (``from_config``: the run's dataset), the
dataset registry (``DATASETS``, ``load``), the opened dataset and the interface of the
sources its batches come from (``DomainBedData``, ``Source``: ``dataset.py``),
DomainBed's split rule (``domainbed_splits``, ``splits.py``), sampling and batch layout
(``pipeline.py``), reading and checking image folders (``image_folder.py``, and where the
caches live: ``cache_folder``), and the sources: the in-memory MNIST-like datasets
(``mnist.py``, ``ArraySource``), the images decoded once into a store, or streamed, for
on-accelerator augmentation (``store.py``, ``jpeg_store.py``; ``canvas.py`` chooses and
serves them), tf.data on the host
(``tf_input.py``, with the augmentations of ``augment.py``); and the ``verify`` command
(``python -m sagm_jax.data.verify``).

TensorFlow is imported only when a tf.data source is opened (``tf_data_source``, the
default of ``load`` for image folders) or an augmentation is built, so importing this
package does not start TensorFlow, nor does a run with ``config.input='device'``.
"""

import functools

import jax

from sagm_jax.data.dataset import DomainBedData, Source
from sagm_jax.data.image_folder import (
    BadImageError,
    DatasetLayoutError,
    DatasetNotFoundError,
    cache_folder,
)
from sagm_jax.data.mnist import ArraySource
from sagm_jax.data.pipeline import (
    eval_batch_size,
    eval_blocks,
    eval_layout,
    sample_train_ids,
    sample_train_indices,
    to_global_batch,
)
from sagm_jax.data.registry import DATASETS, DatasetSpec, get_spec, load, tf_data_source
from sagm_jax.data.splits import (
    IMAGE_EXTENSIONS,
    domainbed_splits,
    holdout_split,
    in_domain_split,
    seed_hash,
    write_split_record,
)
from sagm_jax.data.canvas import CanvasSource, open_source
from sagm_jax.data.store import ImageStore
from sagm_jax.data.streaming import StreamingSource

__all__ = [
    "DATASETS",
    "IMAGE_EXTENSIONS",
    "ArraySource",
    "BadImageError",
    "CanvasSource",
    "DatasetLayoutError",
    "DatasetNotFoundError",
    "DatasetSpec",
    "DomainBedData",
    "ImageStore",
    "Source",
    "StreamingSource",
    "cache_folder",
    "domainbed_splits",
    "eval_batch_size",
    "eval_blocks",
    "eval_layout",
    "from_config",
    "get_spec",
    "holdout_split",
    "in_domain_split",
    "load",
    "open_source",
    "sample_train_ids",
    "sample_train_indices",
    "seed_hash",
    "tf_data_source",
    "to_global_batch",
    "write_split_record",
]


def from_config(config, *, open_images: bool = True):
    """The run's dataset, opened and split as the config says. An image folder with
    ``config.input='device'`` is served from its decoded store (built on first use),
    with ``'tf'`` by tf.data; ``open_images=False`` opens the split alone, for callers
    that need no batches."""
    cache_root = config.cache_dir or None
    if not open_images:
        source = None
    elif config.input == "device":
        source = functools.partial(
            CanvasSource.open,
            short_side=config.store_short_side,
            mode=config.image_store,
            budget_gb=config.store_budget_gb,
            cache_dir=cache_root,
            progress=jax.process_index() == 0,
        )
    else:
        source = tf_data_source
    return load(
        config.dataset,
        config.data_dir or None,
        trial_seed=config.trial_seed,
        holdout_fraction=config.holdout_fraction,
        split=config.split,
        skip_bad_files=config.skip_bad_files,
        data_seed=config.seed,
        image_size=config.image_size,
        cache_dir=cache_folder("verified", cache_root),
        open_images=source,
    )
