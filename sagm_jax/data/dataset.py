"""``DomainBedData``: one opened, split dataset; and ``Source``, where its batches come from.

The dataset owns the facts of a run's data (environments, classes, the split, the
fingerprint, the skipped files) and turns a step or a split part into the flat ids of
the examples a batch holds (sampling and layout: ``pipeline.py``). A ``Source`` turns
those ids into batches of host arrays. Examples are named by FLAT ID: environment 0's
examples, then environment 1's, ... (ImageFolder order for image folders), so flat id
``offset[e] + k`` is example ``k`` of environment ``e``.

The sources, one module each:

* ``mnist.ArraySource``: the in-memory MNIST-like datasets, indexed in NumPy, never
  augmented;
* ``canvas.CanvasSource``: an image folder decoded once (``store.ImageStore``) or on
  every call (``streaming.StreamingSource``); training batches carry uint8 canvases for the
  augmentation on the accelerator (``device_augment.py``);
* ``tf_input.TFDataSource``: an image folder read, decoded and augmented by tf.data on
  the host.

Training and evaluation batches are the same functions of (seed, step) and of the split
whatever the source (``pipeline.py``'s module doc states the rule).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Iterator, Protocol

import numpy as np

from sagm_jax.data import pipeline
from sagm_jax.data import splits as splits_lib


class Source(Protocol):
    """Where a dataset's batches come from. A new source (a compressed store, a decoder
    on the accelerator) is one class with these two methods, in its own module, passed
    to ``registry.load`` as ``open_images`` (a function of the ``FolderIndex`` and the
    image size that opens it); nothing else changes.

    Both methods yield dicts of host NumPy arrays, one per batch, with at least
    ``'image'`` (float32 [b, H, W, C], normalised, or uint8 canvases with ``'hw'`` int32
    [b, 2] and ``'position'`` int32 [b] for ``device_augment.model_inputs``) and
    ``'label'`` (int32 [b]). A batch must depend only on the arguments (the ids, the
    seed, the positions), never on timing or on earlier calls: resumed runs rely on it.
    """

    def train_batches(
        self,
        ids_at: Callable[[int], np.ndarray],
        positions: np.ndarray,
        *,
        start_step: int,
        seed: int,
    ) -> Iterator[dict]:
        """Infinite: for step = start_step, start_step + 1, ..., the training batch of the
        flat ids ``ids_at(step)`` (int64 [b], this host's rows), with the training
        augmentation as a function of ``seed``, the step and each row's ``positions``
        (int32 [b]: its row in the global batch). A source of canvases passes
        ``positions`` on and the accelerator augments; the in-memory one does not."""
        ...

    def eval_batches(
        self, ids: np.ndarray, mask: np.ndarray, position: np.ndarray, *, augment: bool, seed: int
    ) -> Iterator[dict]:
        """Finite: one batch per row of ``ids`` (int64 [num_batches, b] flat ids), with
        ``'mask'`` (that row of ``mask``, False on padding). Evaluation images, or, with
        ``augment``, the training augmentation seeded by ``seed`` and ``position`` (the
        examples' positions in the split part)."""
        ...


@dataclasses.dataclass
class DomainBedData:
    """An opened dataset, split for one trial seed.

    ``splits[e]`` maps each part ('in', 'out', and 'test' for the in-domain split) to
    int64 indices into environment ``e``'s examples (ImageFolder order for folders).
    ``source`` is None for a dataset opened for its split alone (no batches).
    """

    name: str
    env_names: list[str]
    class_names: list[str]
    num_classes: int
    input_shape: tuple[int, int, int]
    env_sizes: list[int]
    splits: list[dict[str, np.ndarray]]
    fingerprint: dict
    skipped: list[dict]
    trial_seed: int
    holdout_fraction: float
    split_kind: str
    source: Source | None
    folder: object = None  # image_folder.FolderIndex: the files, for image folders

    # ---- construction -------------------------------------------------------------
    @staticmethod
    def _split(sizes, trial_seed, holdout_fraction, split):
        if split == "in_domain":
            return [splits_lib.in_domain_split(n, trial_seed, i) for i, n in enumerate(sizes)]
        if split == "full_data":  # ERM++'s second stage
            return [
                splits_lib.full_data_split(n, trial_seed, i, holdout_fraction)
                for i, n in enumerate(sizes)
            ]
        return [
            splits_lib.holdout_split(n, trial_seed, i, holdout_fraction)
            for i, n in enumerate(sizes)
        ]

    @classmethod
    def from_folder(cls, name, index, source, *, trial_seed, holdout_fraction, split, image_size):
        """An image folder (``FolderIndex``) whose batches come from ``source`` (or None)."""
        sizes = [len(p) for p in index.paths]
        return cls(
            name,
            list(index.env_names),
            list(index.class_names),
            len(index.class_names),
            (image_size, image_size, 3),
            sizes,
            cls._split(sizes, trial_seed, holdout_fraction, split),
            index.fingerprint,
            index.skipped,
            trial_seed,
            holdout_fraction,
            split,
            source,
            folder=index,
        )

    @classmethod
    def from_arrays(cls, name, arrays, *, trial_seed, holdout_fraction, split):
        """An in-memory dataset (``mnist.ArraySource``), its own source."""
        sizes = [len(y) for y in arrays.labels]
        return cls(
            name,
            list(arrays.env_names),
            [str(k) for k in range(arrays.num_classes)],
            arrays.num_classes,
            tuple(arrays.images[0].shape[1:]),
            sizes,
            cls._split(sizes, trial_seed, holdout_fraction, split),
            _arrays_fingerprint(arrays),
            [],
            trial_seed,
            holdout_fraction,
            split,
            arrays,
        )

    # ---- batches ------------------------------------------------------------------
    def _check_env(self, env):
        if not isinstance(env, (int, np.integer)) or not 0 <= env < len(self.env_names):
            raise ValueError(
                f"Environment index {env!r} out of range for {self.name} "
                f"(0..{len(self.env_names) - 1}: {self.env_names})"
            )

    def _opened_source(self) -> Source:
        if self.source is None:
            raise ValueError(
                f"{self.name} was opened for its split alone (open_images=None); open it "
                "with a source to get batches."
            )
        return self.source

    def _offsets(self) -> np.ndarray:
        """Flat id of each environment's first example."""
        return np.cumsum([0] + self.env_sizes)

    def train_iterator(
        self,
        train_envs,
        *,
        seed: int,
        batch_per_env: int = 32,
        start_step: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> Iterator[dict]:
        """Infinite iterator of this host's part of each step's training batch, from
        ``start_step`` on (``pipeline.py``'s module doc): ``{'image', 'label'}`` (and
        ``'hw'``, ``'position'`` for canvases; ``Source``) with
        ``b = batch_per_env * len(train_envs) / process_count`` rows."""
        train_envs = [int(e) for e in train_envs]
        if not train_envs or len(set(train_envs)) != len(train_envs):
            raise ValueError(f"train_envs must be distinct environment indices, got {train_envs}")
        for e in train_envs:
            self._check_env(e)
            if len(self.splits[e]["in"]) == 0:
                raise ValueError(f"Environment {e} ({self.env_names[e]}) has an empty 'in' split.")
        source = self._opened_source()
        p, n_proc = pipeline.processes(process_index, process_count)
        lo, hi = pipeline.host_rows(batch_per_env * len(train_envs), p, n_proc)
        in_splits = [self.splits[e]["in"] for e in train_envs]
        offsets = self._offsets()[train_envs]

        def ids_at(step):
            return pipeline.sample_train_ids(seed, step, in_splits, offsets, batch_per_env)[lo:hi]

        positions = np.arange(lo, hi, dtype=np.int32)
        return source.train_batches(ids_at, positions, start_step=start_step, seed=seed)

    def eval_iterator(
        self,
        env: int,
        part: str = "in",
        *,
        batch_size: int = 128,
        augment: bool = False,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        batch_multiple: int = 1,
    ) -> Iterator[dict]:
        """Finite iterator over split ``part`` of environment ``env``:
        ``{'image', 'label', 'mask'}``, every example once, padding masked out.
        ``augment=True`` applies the training augmentation (DomainBed's old default for
        validation), seeded by ``seed`` and the example's position. A split smaller
        than ``batch_size`` comes in one smaller batch, and so does the rest after the whole
        batches (``pipeline.eval_blocks``; pass the mesh's device count as
        ``batch_multiple``)."""
        self._check_env(env)
        if part not in self.splits[env]:
            raise ValueError(f"Split part {part!r} not in {sorted(self.splits[env])}")
        source = self._opened_source()
        indices = self.splits[env][part]
        p, n_proc = pipeline.processes(process_index, process_count)
        blocks = pipeline.eval_blocks(len(indices), batch_size, p, n_proc, batch_multiple)
        offset = self._offsets()[env]

        def batches():  # checked above, when called; read when iterated
            for position, mask in blocks:
                ids = offset + indices[position]
                yield from source.eval_batches(ids, mask, position, augment=augment, seed=seed)

        return batches()

    # ---- records ------------------------------------------------------------------
    def write_split(self, workdir: str) -> str:
        """Write ``workdir/split.json`` (indices, file lists, fingerprint); returns its path."""
        return splits_lib.write_split_record(workdir, self)


def _arrays_fingerprint(arrays) -> dict:
    """Counts per environment and class, and the SHA-256 of every image and label."""
    digest = hashlib.sha256()
    for x, y in zip(arrays.images, arrays.labels):
        digest.update(np.ascontiguousarray(x).tobytes())
        digest.update(np.ascontiguousarray(y).tobytes())
    counts = {
        env: {str(k): int(np.sum(y == k)) for k in range(arrays.num_classes)}
        for env, y in zip(arrays.env_names, arrays.labels)
    }
    return {
        "counts": counts,
        "domain_totals": {e: int(sum(c.values())) for e, c in counts.items()},
        "total": int(sum(len(y) for y in arrays.labels)),
        "arrays_sha256": digest.hexdigest(),
    }
