"""Evaluation: the accuracy and loss of a train state on the split parts a run evaluates.

``Evaluator(state) -> {'env{i}_{part}_acc': accuracy, 'env{i}_{part}_loss': loss,
'eval_batch_size': the batch it predicted in}`` for the parts ``evaluated_parts`` selects (``config.eval_splits``: "fast", the default, is
what the selection methods read; "all" is every part of every environment, DomainBed's
records), over EVERY example of each part (padding of the last batch is masked out), in
eval mode and in the compute dtype; the loss is the mean cross-entropy per example
(SWAD's evaluator's: the sum over batches of the batch mean times its size, over the
part's size), which SWAD's loss valley reads. With ``config.augment_validation`` the
'out' parts of the training environments are augmented as in training (DomainBed's old
default).

Speed: the inputs are read from the source once per run and kept resident as the
budgets allow (``Evaluator``'s doc), and the batch defaults to a throughput size per
platform (``batch_size``), so that an evaluation runs at the rate of the forward pass
(``experiments/device_report.py --sections eval`` measures the ratio).

Training-domain validation (``sagm_jax.results.selection.validation_accuracy``) is the mean
'out' accuracy of the training environments; an empty split part has no accuracy, so
the evaluator refuses one when it is built, before the run writes anything, instead of
recording a NaN that no checkpoint comparison can rank.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from sagm_jax.data import device_augment
from sagm_jax.data.pipeline import prefetch_to_mesh
from sagm_jax.methods.adaptive import EVAL_NOISE_SEED
from sagm_jax.methods.networks import MethodModel
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.training.train_step import apply_model


def evaluated_parts(splits: list[dict], train_envs, eval_splits: str) -> list[tuple[int, str]]:
    """The (environment, part) pairs an evaluation covers, in record order.

    ``"all"``: every part of every environment (DomainBed's records). ``"fast"`` (SWAD's
    evaluator's ``evalmode="fast"``, the SAGM authors' default): what the selection
    methods read and nothing else: the training environments' ``out`` (training-domain
    validation) and ``test`` parts (the in-domain split's test accuracy), and every part
    of the test environments (their ``in`` is the test accuracy, their ``out`` the
    oracle's validation; leave-one-domain-out's validation domain is a test environment
    of its pair run)."""
    if eval_splits not in ("fast", "all"):
        raise ValueError(f"eval_splits must be 'fast' or 'all', got {eval_splits!r}")
    train_envs = set(int(e) for e in train_envs)
    return [
        (env, part)
        for env, parts in enumerate(splits)
        for part in parts
        if eval_splits == "all" or env not in train_envs or part != "in"
    ]


def batch_size(config, num_devices: int, platform: str, model=None) -> int:
    """``config.eval_batch_size``; for 0, the reference's evaluation batch that a method
    whose prediction depends on the evaluated batch declares (``model`` a
    ``MethodModel`` whose ``MethodNetwork.eval_batch_size`` is set: ARM's and MTL's 64,
    DomainBed's), else the throughput default: 128 per device on a
    CPU, where larger batches gain nothing (measured, ResNet-18 forward at 112x112 on the
    2-core development CPU: 69, 66 and 55 images/s at batch 32, 128 and 512), and 512 per
    GPU or TPU, where a convolution's throughput grows with the batch (not yet measured
    on a GPU: ``experiments/device_report.py --sections eval`` does it)."""
    if config.eval_batch_size:
        return int(config.eval_batch_size)
    declared = model.network.eval_batch_size if isinstance(model, MethodModel) else None
    if declared:
        return int(declared)
    return (128 if platform == "cpu" else 512) * num_devices


PARTS = ("in", "out", "test")


def batch_key(seed, env: int, part: str, index: int) -> jax.Array:
    """The PRNG key of a prediction's draws (MTL's noise) on batch ``index`` of part
    ``part`` of environment ``env`` in a run of seed ``seed``:
    ``fold_in(fold_in(fold_in(fold_in(PRNGKey(EVAL_NOISE_SEED), seed), env), p), index)``,
    p the part's place in :data:`PARTS`. Each batch draws afresh (as the reference's
    every call), the same at every evaluation of the run, so a record is reproducible."""
    key = jax.random.PRNGKey(EVAL_NOISE_SEED)
    for value in (seed, env, PARTS.index(part), index):
        key = jax.random.fold_in(key, value)
    return key


def make_eval_step(model, compute_dtype, seed: int = 0, image_size: int = 224):
    """Jitted ``eval_step(params, batch_stats, batch, key=None) -> (correct, counted,
    loss_sum)``; ``key`` (:func:`batch_key`) draws the prediction's noise (MTL's), None
    the fixed key of ``adaptive.EVAL_NOISE_SEED``."""
    step = seeded_eval_step(model, compute_dtype, image_size)
    fixed = jax.random.PRNGKey(EVAL_NOISE_SEED)
    return lambda params, batch_stats, batch, key=None: step(
        params, batch_stats, batch, seed, fixed if key is None else key
    )


def seeded_eval_step(model, compute_dtype, image_size: int = 224):
    """Jitted ``eval_step(params, batch_stats, batch, seed, key) -> (correct, counted,
    loss_sum)``; ``seed`` (traced) draws the augmentation of augmented validation
    batches, so the runs of a pack share one compiled evaluation; ``key`` the batch's
    draws of a prediction that uses one (:func:`batch_key`)."""

    def eval_step(params, batch_stats, batch, seed, key):
        batch = device_augment.model_inputs(
            batch, seed, 0, image_size, stream=device_augment.EVAL_STREAM
        )
        # A prediction that pools over the batch (ARM, MTL) leaves the padding rows out.
        pooled = {"mask": batch["mask"], "key": key} if isinstance(model, MethodModel) else {}
        logits = apply_model(model, params, batch_stats, batch["image"], compute_dtype, **pooled)
        correct = (jnp.argmax(logits, -1) == batch["label"]) & batch["mask"]
        losses = per_example_cross_entropy(logits, batch["label"])
        return jnp.sum(correct), jnp.sum(batch["mask"]), jnp.sum(jnp.where(batch["mask"], losses, 0))

    return jax.jit(eval_step)


DEVICE, HOST = "device", "host"


def available_host_bytes() -> int:
    """The host memory a process can still take: ``MemAvailable`` of ``/proc/meminfo``,
    elsewhere the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def residency_budgets(config, device) -> dict[str, int]:
    """Bytes of evaluation inputs that may be kept, per place: on the accelerator
    ``min(config.eval_cache_gb, half its free memory)``; in host memory half the host's
    available memory. A CPU's device memory is the host's, so there everything kept is
    kept "on the device" (no copy at all) and the host tier is empty."""
    cap = int(config.eval_cache_gb * 2**30)
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return {DEVICE: min(cap, free // 2), HOST: available_host_bytes() // 2}
    return {DEVICE: min(cap, available_host_bytes() // 2), HOST: 0}


class Evaluator:
    """Accuracies and losses of a train state on the split parts ``evaluated_parts``
    selects (``config.eval_splits``).

    Evaluation inputs are read from the dataset's source ONCE per run: the first
    evaluation keeps each batch where the next evaluation reads it fastest, as the
    budgets allow (``residency_budgets``), in evaluation order: on the accelerator
    (global arrays, no transfer at all), else in host memory (transferred a batch ahead
    of the step that needs it, ``prefetch_to_mesh``), else, for a part that fits
    neither, read from the source again at every evaluation (prefetched as well). The
    batches are the same either way (a batch depends only on the split and the seed,
    ``dataset.Source``), so the results are too. ``kept_bytes`` says how much is where.
    """

    def __init__(self, model, dataset, mesh, config, train_envs):
        empty = [
            f"env{env} ({dataset.env_names[env]}) '{part}'"
            for env in range(len(dataset.env_names))
            for part, indices in dataset.splits[env].items()
            if len(indices) == 0
        ]
        if empty:
            raise ValueError(
                f"Empty split parts: {', '.join(empty)}; their accuracy is undefined and "
                "training-domain validation needs every 'out' part. Add images, or raise "
                f"config.holdout_fraction={config.holdout_fraction}."
            )
        self.dataset, self.mesh, self.config = dataset, mesh, config
        self.train_envs = list(train_envs)
        self.parts = evaluated_parts(dataset.splits, self.train_envs, config.eval_splits)
        self.batch_size = batch_size(config, mesh.devices.size, mesh.devices.flat[0].platform,
                                     model)
        # A ``seeded_eval_step``; the runs of a pack that predict alike share one
        # (``sagm_jax.training.packed``), compiled once.
        self.shared_step = seeded_eval_step(
            model, jnp.dtype(config.compute_dtype), config.image_size
        )
        self.step = lambda params, batch_stats, batch, key: self.shared_step(
            params, batch_stats, batch, config.seed, key
        )
        self._kept: dict[tuple[int, str], list | None] = {}  # None: read again each time
        self._room: dict[str, int] | None = None  # bytes left per place, from the first call
        self.kept_bytes = {DEVICE: 0, HOST: 0}

    def _batches(self, env: int, part: str):
        augment = self.config.augment_validation and part == "out" and env in self.train_envs
        return self.dataset.eval_iterator(
            env,
            part,
            batch_size=self.batch_size,
            augment=augment,
            seed=self.config.seed,
            batch_multiple=self.mesh.devices.size,
        )

    def _first_pass(self, env: int, part: str):
        """The part's global batches from the source, keeping each where it fits; a part
        that does not fit whole is not kept at all (its batches are read again)."""
        host_batches, kept = [], []

        def recorded():
            for batch in self._batches(env, part):
                host_batches.append(batch)
                yield batch

        for k, batch in enumerate(prefetch_to_mesh(recorded(), self.mesh)):
            yield batch
            host, host_batches[k] = host_batches[k], None
            if kept is None:
                continue
            size = sum(np.asarray(v).nbytes for v in host.values())
            place = next((p for p in (DEVICE, HOST) if size <= self._room[p]), None)
            if place is None:  # give back what this part took
                for p, _, n in kept:
                    self._room[p] += n
                kept = None
                continue
            self._room[place] -= size
            kept.append((place, batch if place == DEVICE else host, size))
        self._kept[(env, part)] = kept
        for place, _, size in kept or ():
            self.kept_bytes[place] += size

    def _replay(self, kept):
        """Kept batches in order: those on the device as they are, those in host memory
        transferred one batch ahead."""
        transferred = prefetch_to_mesh((b for p, b, _ in kept if p == HOST), self.mesh)
        try:
            for place, batch, _ in kept:
                yield batch if place == DEVICE else next(transferred)
        finally:
            transferred.close()

    def _inputs(self, env: int, part: str):
        if (env, part) not in self._kept:
            return self._first_pass(env, part)
        kept = self._kept[(env, part)]
        if kept is None:
            return prefetch_to_mesh(self._batches(env, part), self.mesh)
        return self._replay(kept)

    def __call__(self, state) -> dict:
        if self._room is None:
            self._room = residency_budgets(self.config, self.mesh.devices.flat[0])
        # The records say which batch predicted (ARM's and MTL's prediction depends on it).
        results = {"eval_batch_size": self.batch_size}
        for env, part in self.parts:
            sums = [
                self.step(state.params, state.batch_stats, batch,
                          batch_key(self.config.seed, env, part, index))
                for index, batch in enumerate(self._inputs(env, part))
            ]
            correct, counted, loss = (sum(float(s[i]) for s in sums) for i in range(3))
            results[f"env{env}_{part}_acc"] = correct / counted
            results[f"env{env}_{part}_loss"] = loss / counted
        return results
