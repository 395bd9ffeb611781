"""Which examples a batch holds, how a batch is laid out over hosts, and its placement.

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

Evaluation batches visit every example of a split exactly once, in split order
(``eval_blocks``): whole global batches of ``batch_size``, then the rest in one
smaller batch (``eval_batch_size``: under ``batch_size / 8`` of padding), padded with
copies of the split's first example, with ``'mask'`` False on the padding. Padding of
PACS's fast evaluation (computed from its split sizes): 1.1% of the rows at batch 128
and 5.3% at 512 (before, with every part padded to whole batches: 8.9% and 21.8%), at
the cost of a few more compiled batch shapes. Each host takes the same column block ``[p*b/P, (p+1)*b/P)`` of
every batch, so all hosts yield the same number of batches.

The dataset (``dataset.py``) applies these rules and its ``Source`` reads the examples;
``prefetch_to_mesh`` places the next batches on the mesh from a background thread
while the current step runs.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Iterator

import numpy as np


def sample_train_indices(seed: int, step: int, in_splits, batch_per_env: int) -> list[np.ndarray]:
    """Per training environment, ``batch_per_env`` indices (into that environment) for step."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    rng = np.random.default_rng([seed, step])
    return [split[rng.integers(0, len(split), batch_per_env)] for split in in_splits]


def sample_train_ids(seed: int, step: int, in_splits, offsets, batch_per_env: int) -> np.ndarray:
    """The step's global training batch as flat ids: environment ``k``'s
    :func:`sample_train_indices` plus ``offsets[k]`` (the flat id of its first example),
    environments in order."""
    picks = sample_train_indices(seed, step, in_splits, batch_per_env)
    return np.concatenate([offset + k for offset, k in zip(offsets, picks)])


def host_rows(global_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """This process's rows ``[lo, hi)`` of a global batch of ``global_size``."""
    if global_size % process_count:
        raise ValueError(
            f"Global batch {global_size} does not divide among {process_count} "
            "processes; choose a batch size that does."
        )
    local = global_size // process_count
    return process_index * local, (process_index + 1) * local


def eval_batch_size(n: int, batch_size: int, multiple: int = 1) -> int:
    """The global evaluation batch for a split (or the rest of one) of ``n`` examples:
    ``batch_size``, or, for fewer, the smallest size that holds them among the
    ``multiple * 2**k`` up to ``step`` (the largest of them at most ``batch_size / 8``)
    and the multiples of ``step`` up to ``batch_size``. So a tiny split is not padded to
    ``batch_size``, padding is under ``step`` above it, and the compiled batch shapes
    stay few (at most eight multiples of ``step`` and the powers of two below it).
    ``multiple`` (the devices the batch is sharded over) must divide ``batch_size``."""
    if n >= batch_size:
        return batch_size
    step = multiple
    while step * 2 <= batch_size // 8:
        step *= 2
    size = multiple
    while size < min(n, step):
        size *= 2
    if size >= n:
        return size
    return min(-(-n // step) * step, batch_size)


def eval_layout(
    n: int, batch_size: int, process_index: int = 0, process_count: int = 1, multiple: int = 1
):
    """Positions into a split of ``n`` and the mask, shaped [num_batches, local batch];
    the batch is :func:`eval_batch_size` (``multiple``: the devices of the mesh)."""
    size = eval_batch_size(n, batch_size, math.lcm(multiple, process_count))
    return _layout(n, size, process_index, process_count)


def _layout(n: int, size: int, process_index: int, process_count: int):
    """``eval_layout`` in global batches of exactly ``size``, the last one padded."""
    lo, hi = host_rows(size, process_index, process_count)
    num_batches = math.ceil(n / size)
    position = np.arange(num_batches * size)
    mask = position < n
    position = np.where(mask, position, 0).reshape(num_batches, size)[:, lo:hi]
    return position, mask.reshape(num_batches, size)[:, lo:hi]


def eval_blocks(
    n: int, batch_size: int, process_index: int = 0, process_count: int = 1, multiple: int = 1
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The evaluation layout of a split of ``n`` as blocks of :func:`eval_layout`'s
    ``(position, mask)``: the whole batches of :func:`eval_batch_size` (no padding), then
    the rest in one batch of ``eval_batch_size(rest, batch_size)``; the positions run
    over the split in order."""
    multiple = math.lcm(multiple, process_count)
    size = eval_batch_size(n, batch_size, multiple)
    whole = n // size * size
    blocks = []
    if whole:
        blocks.append(_layout(whole, size, process_index, process_count))
    if n > whole:
        rest = eval_batch_size(n - whole, batch_size, multiple)
        position, mask = _layout(n - whole, rest, process_index, process_count)
        blocks.append((np.where(mask, position + whole, 0), mask))
    return blocks


def processes(process_index, process_count) -> tuple[int, int]:
    """(process index, process count): those given, or JAX's when either is None."""
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


def prefetch_to_mesh(
    batches: Iterator[dict], mesh, depth: int = 2, axis: str = "batch"
) -> Iterator[dict]:
    """``to_global_batch`` of each host batch (dim 0 sharded along ``axis``: a pack's
    stacked batches along its ``runs``), ``depth`` batches ahead, from a
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
                item = to_global_batch(batch, mesh, axis)
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
