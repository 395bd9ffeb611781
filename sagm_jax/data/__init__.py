"""DomainBed datasets, splits and input pipelines.

Owns: the dataset registry (``DATASETS``, ``load``), DomainBed's split rule
(``domainbed_splits``, ``splits.py``), reading and checking image folders
(``image_folder.py``), the images decoded once into a store, or streamed, for
on-accelerator augmentation (``store.py``, ``open_source``), the in-memory MNIST-like
datasets (``mnist.py``), the augmentations (``augment.py``, TensorFlow) and the batches
(``pipeline.py``, ``tf_input.py``), and the ``verify`` command (``python -m
sagm_jax.data.verify``).

TensorFlow is imported only when an image-folder pipeline or an augmentation is
built, so importing this package does not start TensorFlow.
"""

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
