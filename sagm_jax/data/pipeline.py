"""``DomainBedData``: one opened, split dataset and its training and evaluation batches.

Training batches. For step ``t`` of a run with seed ``s`` and training environments
``train_envs`` (in that order), each environment ``e`` contributes ``batch_per_env``
indices drawn uniformly WITH replacement from its "in" split (DomainBed's
``InfiniteDataLoader`` with ``RandomSampler(replacement=True)``), using
``np.random.default_rng([s, t])``; the global batch is their concatenation in
environment order. An example's augmentation seed is derived from ``(s, t, position
in the global batch)``. A batch is therefore a function of ``(s, t)`` alone, and a
resumed run passes ``start_step=t`` to get exactly the batches it would have had.

Several hosts: every host computes the same global index list and keeps rows
``[p*B/P, (p+1)*B/P)`` for process ``p`` of ``P`` (B must divide by P), so the hosts'
parts are disjoint and together form the global batch in order; ``to_global_batch``
assembles them on the mesh with ``jax.make_array_from_process_local_data``.

Evaluation batches visit every example of a split exactly once, in split order: the
list is padded (with copies of its first example) to a whole number of global
batches of ``batch_size``, and ``'mask'`` is False on the padding. Each host takes the
same column block ``[p*b/P, (p+1)*b/P)`` of every batch, so all hosts yield the same
number of batches.

Image folders take one of two paths. The default (``attach_source``): images decoded
once (``store.py``); the host only gathers uint8 rows, training batches carry
``{'image': uint8 canvases, 'hw', 'label', 'position'}`` and the augmentation runs on
the accelerator (``device_augment.py``, keyed by the example's position in the global
batch); evaluation batches carry the cached uint8 224x224 evaluation images. The other
(no source attached): tf.data on the host (``tf_input.py``). The in-memory datasets are
indexed in NumPy and are not augmented.

``prefetch_to_mesh`` places the next batches on the mesh from a background thread
while the current step runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import queue
import threading
from typing import Iterator

import numpy as np

from sagm_jax.data import splits as splits_lib


def sample_train_indices(seed: int, step: int, in_splits, batch_per_env: int) -> list[np.ndarray]:
    """Per training environment, ``batch_per_env`` indices (into that environment) for step."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    rng = np.random.default_rng([seed, step])
    return [split[rng.integers(0, len(split), batch_per_env)] for split in in_splits]


def host_rows(global_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    if global_size % process_count:
        raise ValueError(
            f"Global batch {global_size} does not divide among {process_count} "
            "processes; choose a batch size that does."
        )
    local = global_size // process_count
    return process_index * local, (process_index + 1) * local


def eval_batch_size(n: int, batch_size: int, multiple: int = 1) -> int:
    """The global evaluation batch for a split of ``n`` examples: ``batch_size``, or, for
    a smaller split, the smallest ``multiple * 2**k`` that holds it, so that a tiny split
    is not padded to ``batch_size``. ``multiple`` (the devices the batch is sharded over)
    must divide ``batch_size``; powers of two keep the compiled shapes few."""
    if n >= batch_size:
        return batch_size
    size = multiple
    while size < n:
        size *= 2
    return min(size, batch_size)


def eval_layout(
    n: int, batch_size: int, process_index: int = 0, process_count: int = 1, multiple: int = 1
):
    """Positions into a split of ``n`` and the mask, shaped [num_batches, local batch];
    the batch is :func:`eval_batch_size` (``multiple``: the devices of the mesh)."""
    batch_size = eval_batch_size(n, batch_size, math.lcm(multiple, process_count))
    lo, hi = host_rows(batch_size, process_index, process_count)
    num_batches = math.ceil(n / batch_size)
    position = np.arange(num_batches * batch_size)
    mask = position < n
    position = np.where(mask, position, 0).reshape(num_batches, batch_size)[:, lo:hi]
    return position, mask.reshape(num_batches, batch_size)[:, lo:hi]


def _processes(process_index, process_count):
    if process_index is None or process_count is None:
        import jax

        return jax.process_index(), jax.process_count()
    return process_index, process_count


def to_global_batch(batch: dict, mesh, axis: str = "batch") -> dict:
    """Place each host's part of a batch on ``mesh``, sharded along ``axis`` (dim 0)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec(axis))
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
    }


def prefetch_to_mesh(batches: Iterator[dict], mesh, depth: int = 2) -> Iterator[dict]:
    """``to_global_batch`` of each host batch, ``depth`` batches ahead, from a
    background thread (gathering rows and the host-to-device copy overlap the step).
    An exception in the thread is raised here, at the batch where it happened.
    Closing the generator (``.close()``, or its end) stops and joins the thread, so
    no transfer is still running when the process exits."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for batch in batches:
                item = to_global_batch(batch, mesh)
                while not stop.is_set():
                    try:
                        slots.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, raised there
            slots.put(e)
            return
        slots.put(done)

    thread = threading.Thread(target=produce, daemon=True, name="prefetch_to_mesh")
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


@dataclasses.dataclass
class DomainBedData:
    """An opened dataset, split for one trial seed.

    ``splits[e]`` maps each part ('in', 'out', and 'test' for the in-domain split) to
    int64 indices into environment ``e``'s examples (ImageFolder order for folders).
    """

    name: str
    env_names: list[str]
    class_names: list[str]
    num_classes: int
    input_shape: tuple[int, int, int]
    splits: list[dict[str, np.ndarray]]
    fingerprint: dict
    skipped: list[dict]
    trial_seed: int
    holdout_fraction: float
    split_kind: str
    folder: object = None  # image_folder.FolderIndex for folder datasets
    arrays: object = None  # mnist.ArraySource for in-memory datasets
    source: object = None  # store.ImageStore / StreamingSource: the device input path

    # ---- construction -------------------------------------------------------------
    @staticmethod
    def _split(sizes, trial_seed, holdout_fraction, split):
        if split == "in_domain":
            return [splits_lib.in_domain_split(n, trial_seed, i) for i, n in enumerate(sizes)]
        return [
            splits_lib.holdout_split(n, trial_seed, i, holdout_fraction)
            for i, n in enumerate(sizes)
        ]

    @classmethod
    def from_folder(cls, name, index, *, trial_seed, holdout_fraction, split, image_size):
        sizes = [len(p) for p in index.paths]
        return cls(
            name,
            list(index.env_names),
            list(index.class_names),
            len(index.class_names),
            (image_size, image_size, 3),
            cls._split(sizes, trial_seed, holdout_fraction, split),
            index.fingerprint,
            index.skipped,
            trial_seed,
            holdout_fraction,
            split,
            folder=index,
        )

    @classmethod
    def from_arrays(cls, name, source, *, trial_seed, holdout_fraction, split):
        sizes = [len(y) for y in source.labels]
        digest = hashlib.sha256()
        for x, y in zip(source.images, source.labels):
            digest.update(np.ascontiguousarray(x).tobytes())
            digest.update(np.ascontiguousarray(y).tobytes())
        counts = {
            env: {str(k): int(np.sum(y == k)) for k in range(source.num_classes)}
            for env, y in zip(source.env_names, source.labels)
        }
        fingerprint = {
            "counts": counts,
            "domain_totals": {e: int(sum(c.values())) for e, c in counts.items()},
            "total": int(sum(sizes)),
            "arrays_sha256": digest.hexdigest(),
        }
        return cls(
            name,
            list(source.env_names),
            [str(k) for k in range(source.num_classes)],
            source.num_classes,
            tuple(source.images[0].shape[1:]),
            cls._split(sizes, trial_seed, holdout_fraction, split),
            fingerprint,
            [],
            trial_seed,
            holdout_fraction,
            split,
            arrays=source,
        )

    def attach_source(self, source) -> None:
        """Serve this folder dataset from ``source`` (``store.open_source``): uint8
        batches for the device augmentation instead of tf.data (module doc)."""
        if self.folder is None:
            raise ValueError(f"{self.name} is an in-memory dataset; only image folders take a source.")
        self.source = source

    @property
    def flat_labels(self) -> np.ndarray:
        return np.concatenate(self.folder.labels).astype(np.int32)

    # ---- facts --------------------------------------------------------------------
    @property
    def env_sizes(self) -> list[int]:
        src = self.folder.paths if self.folder is not None else self.arrays.labels
        return [len(x) for x in src]

    def _check_env(self, env):
        if not isinstance(env, (int, np.integer)) or not 0 <= env < len(self.env_names):
            raise ValueError(
                f"Environment index {env!r} out of range for {self.name} "
                f"(0..{len(self.env_names) - 1}: {self.env_names})"
            )

    # ---- batches ------------------------------------------------------------------
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
        ``start_step`` on: ``{'image': float32 [b,H,W,C], 'label': int32 [b]}`` with
        ``b = batch_per_env * len(train_envs) / process_count`` (module doc)."""
        train_envs = [int(e) for e in train_envs]
        if not train_envs or len(set(train_envs)) != len(train_envs):
            raise ValueError(f"train_envs must be distinct environment indices, got {train_envs}")
        for e in train_envs:
            self._check_env(e)
            if len(self.splits[e]["in"]) == 0:
                raise ValueError(f"Environment {e} ({self.env_names[e]}) has an empty 'in' split.")
        p, n_proc = _processes(process_index, process_count)
        lo, hi = host_rows(batch_per_env * len(train_envs), p, n_proc)
        in_splits = [self.splits[e]["in"] for e in train_envs]
        if self.folder is not None:
            offsets = np.cumsum([0] + self.env_sizes)

            def sampler(step):
                picks = sample_train_indices(seed, step, in_splits, batch_per_env)
                return np.concatenate([offsets[e] + k for e, k in zip(train_envs, picks)])[lo:hi]

            if self.source is not None:
                return self._source_train(sampler, start_step, lo, hi)
            from sagm_jax.data import tf_input

            ds = tf_input.train_dataset(
                self.folder,
                sampler,
                seed=seed,
                start_step=start_step,
                first_row=lo,
                rows=hi - lo,
                image_size=self.input_shape[0],
            )
            return ds.as_numpy_iterator()
        return self._array_train(train_envs, in_splits, seed, batch_per_env, start_step, lo, hi)

    def _source_train(self, sampler, start_step, lo, hi):
        labels, position = self.flat_labels, np.arange(lo, hi, dtype=np.int32)
        for step in itertools.count(start_step):
            ids = sampler(step)
            images, hw = self.source.gather(ids)
            yield {"image": images, "hw": hw, "label": labels[ids], "position": position}

    def _array_train(self, train_envs, in_splits, seed, batch_per_env, start_step, lo, hi):
        step = start_step
        while True:
            picks = sample_train_indices(seed, step, in_splits, batch_per_env)
            images = np.concatenate([self.arrays.images[e][k] for e, k in zip(train_envs, picks)])
            labels = np.concatenate([self.arrays.labels[e][k] for e, k in zip(train_envs, picks)])
            yield {"image": images[lo:hi], "label": labels[lo:hi].astype(np.int32)}
            step += 1

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
        than ``batch_size`` comes in one smaller batch (:func:`eval_batch_size`; pass
        the mesh's device count as ``batch_multiple``)."""
        self._check_env(env)
        if part not in self.splits[env]:
            raise ValueError(f"Split part {part!r} not in {sorted(self.splits[env])}")
        indices = self.splits[env][part]
        p, n_proc = _processes(process_index, process_count)
        position, mask = eval_layout(len(indices), batch_size, p, n_proc, batch_multiple)
        if self.folder is not None:
            offset = int(np.sum(self.env_sizes[:env]))
            ids = offset + indices[position] if len(indices) else position
            if self.source is not None:
                return self._source_eval(ids, mask, position, augment)
            from sagm_jax.data import tf_input

            ds = tf_input.eval_dataset(
                self.folder,
                ids,
                mask,
                position,
                augment=augment,
                seed=seed,
                image_size=self.input_shape[0],
            )
            return ds.as_numpy_iterator()
        return self._array_eval(env, indices, position, mask)

    def _source_eval(self, ids, mask, position, augment):
        """Evaluation images from the cache; with ``augment``, canvases for the device
        augmentation keyed by the example's position in the split."""
        labels = self.flat_labels
        for row_ids, row_mask, row_position in zip(ids, mask, position):
            batch = {"label": labels[row_ids], "mask": row_mask}
            if augment:
                batch["image"], batch["hw"] = self.source.gather(row_ids)
                batch["position"] = row_position.astype(np.int32)
            else:
                batch["image"] = self.source.eval_images(row_ids)
            yield batch

    def _array_eval(self, env, indices, position, mask):
        for pos, m in zip(position, mask):
            k = indices[pos]
            yield {
                "image": self.arrays.images[env][k],
                "label": self.arrays.labels[env][k].astype(np.int32),
                "mask": m,
            }

    # ---- records ------------------------------------------------------------------
    def write_split(self, workdir: str) -> str:
        """Write ``workdir/split.json`` (indices, file lists, fingerprint); returns its path."""
        relative = self.folder.relative_paths() if self.folder is not None else None
        return splits_lib.write_split_record(
            workdir,
            dataset=self.name,
            env_names=self.env_names,
            splits=self.splits,
            fingerprint=self.fingerprint,
            trial_seed=self.trial_seed,
            holdout_fraction=self.holdout_fraction,
            split_kind=self.split_kind,
            relative_paths=relative,
        )
