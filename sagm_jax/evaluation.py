"""Evaluation: the accuracy and loss of a train state on every split part of every environment.

``Evaluator(state) -> {'env{i}_{part}_acc': accuracy, 'env{i}_{part}_loss': loss}`` over
EVERY example of each part (padding of the last batch is masked out), in eval mode; the
loss is the mean cross-entropy per example (SWAD's evaluator's: the sum over batches of
the batch mean times its size, over the part's size), which SWAD's loss valley reads. With
``config.augment_validation`` the 'out' parts of the training environments are
augmented as in training (DomainBed's old default).

Training-domain validation (``sagm_jax.selection.validation_accuracy``) is the mean
'out' accuracy of the training environments; an empty split part has no accuracy, so
the evaluator refuses one when it is built, before the run writes anything, instead of
recording a NaN that no checkpoint comparison can rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.data import device_augment
from sagm_jax.data.pipeline import prefetch_to_mesh
from sagm_jax.objectives import per_example_cross_entropy
from sagm_jax.train_step import apply_model


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


def batch_size(config, num_devices: int, platform: str) -> int:
    """``config.eval_batch_size``, or for 0 the throughput default: 128 per device on a
    CPU (larger batches gain nothing there), 512 per GPU or TPU (a ResNet-50 forward pass
    in bfloat16 fills an H100 only from a few hundred images)."""
    if config.eval_batch_size:
        return int(config.eval_batch_size)
    return (128 if platform == "cpu" else 512) * num_devices


def make_eval_step(model, compute_dtype, seed: int = 0, image_size: int = 224):
    """Jitted ``eval_step(params, batch_stats, batch) -> (correct, counted, loss_sum)``."""

    def eval_step(params, batch_stats, batch):
        batch = device_augment.model_inputs(
            batch, seed, 0, image_size, stream=device_augment.EVAL_STREAM
        )
        logits = apply_model(model, params, batch_stats, batch["image"], compute_dtype)
        correct = (jnp.argmax(logits, -1) == batch["label"]) & batch["mask"]
        losses = per_example_cross_entropy(logits, batch["label"])
        return jnp.sum(correct), jnp.sum(batch["mask"]), jnp.sum(jnp.where(batch["mask"], losses, 0))

    return jax.jit(eval_step)


class Evaluator:
    """Accuracies of a train state on every split part of ``dataset``."""

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
        self.batch_size = batch_size(config, mesh.devices.size, mesh.devices.flat[0].platform)
        self.step = make_eval_step(
            model, jnp.dtype(config.compute_dtype), config.seed, config.image_size
        )

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

    def __call__(self, state) -> dict:
        results = {}
        parts = evaluated_parts(self.dataset.splits, self.train_envs, self.config.eval_splits)
        for env, part in parts:
            sums = [
                self.step(state.params, state.batch_stats, batch)
                for batch in prefetch_to_mesh(self._batches(env, part), self.mesh)
            ]
            correct, counted, loss = (sum(float(s[i]) for s in sums) for i in range(3))
            results[f"env{env}_{part}_acc"] = correct / counted
            results[f"env{env}_{part}_loss"] = loss / counted
        return results
