"""SWAD in a training run: the loss valley (on the host) driving the averages (on the device).

``SwadRun`` is what ``sagm_jax.training.train`` calls around its loop when ``config.swad``:

* after evaluation ``k`` (its record written): the segment that ended moves into the
  averages' window (``averaging.close_segment``); the valley (``swad.LossValley``) reads
  the training environments' mean ``out`` loss of that record (SWAD's ``tr_outloss``) and
  says which segments join the final mean now; the train state, averages included, is
  then checkpointed, so a kill at any point resumes exactly (the valley is rebuilt by
  replaying the recorded losses, which is the state it had);
* when the valley ends, training stops (``swad_stop_at_valley_end``, the reference's
  behaviour; False trains to ``steps``, so the same run also gives the full schedule's
  un-averaged results);
* at the end: the valley's last additions, the final model's evaluation, its record
  (``swad.jsonl``) and its variables (``swad_model/``).

BatchNorm: frozen (the default, SWAD's) needs nothing; trainable BatchNorm gets its
statistics recomputed for the averaged weights, as the reference's ``update_bn`` does
(``recompute_batchnorm``).
"""

from __future__ import annotations

import jax
import numpy as np

from sagm_jax.averaging import swad_averages as averaging
from sagm_jax.averaging import valley as swad
from sagm_jax.training.checkpoints import save_swad_variables
from sagm_jax.training.rundir import make_record


def validation_loss(record: dict, train_envs) -> float:
    """SWAD's ``tr_outloss``: the mean over the training environments of their ``out``
    split's mean cross-entropy (each environment weighted equally)."""
    return float(np.mean([record[f"env{e}_out_loss"] for e in train_envs]))


class SwadRun:
    """The SWAD state of one run: its valley, rebuilt from ``records`` on a resume."""

    def __init__(self, config, train_envs, records):
        self.config, self.train_envs = config, list(train_envs)
        self.options = dict(
            n_converge=config.swad_n_converge,
            n_tolerance=config.swad_n_tolerance,
            tolerance_ratio=config.swad_tolerance_ratio,
            fix_quirks=config.swad_fix_quirks,
        )
        self.window = swad.segment_window(config.swad_n_tolerance, config.swad_n_converge)
        self.losses = [validation_loss(r, self.train_envs) for r in records]
        self.valley = swad.LossValley.from_losses(self.losses, **self.options)
        self.steps = [r["step"] for r in records]  # the step at which each segment ends
        self.dead = self.valley.dead

    @property
    def stopped(self) -> bool:
        """Whether training stops here: the valley ended and the run stops with it."""
        return self.dead and self.config.swad_stop_at_valley_end

    def _slot(self, segment: int) -> int:
        if len(self.steps) - 1 - segment >= self.window:  # swad.segment_window's bound
            raise AssertionError(f"SWAD segment {segment} left the window of {self.window}")
        return segment % self.window

    def after_evaluation(self, state, record: dict):
        """The state once the segment ending at ``record``'s step is closed and the
        valley's decisions of that evaluation are applied."""
        self.steps.append(record["step"])
        averages = averaging.close_segment(state.averages, self._slot(len(self.steps) - 1))
        self.losses.append(validation_loss(record, self.train_envs))
        decision = self.valley.update(self.losses[-1])
        if decision.seed is not None:
            averages = averaging.set_final(averages, self._slot(decision.seed))
        for segment in decision.add:
            averages = averaging.add_to_final(averages, self._slot(segment))
        self.dead = self.dead or decision.dead
        if decision.dead and self.config.swad_stop_at_valley_end:
            print(
                f"SWAD: the loss valley ended at step {record['step']} (validation loss "
                f"above its tolerance for {self.config.swad_n_tolerance} evaluations); "
                "training stops here, as SWAD's does "
                "(--config.swad_stop_at_valley_end=False trains on)."
            )
        return state.replace(averages=averages)

    def finish(self, state, program, rundir, last_record: dict) -> dict:
        """The final model: the valley's last segments added, evaluated, its record
        written to swad.jsonl and its variables to swad_model/; returns the record."""
        averages = state.averages
        ending = self.valley.finish()
        if ending.fallback is not None:
            print("SWAD: the validation loss never converged; the final model is the last segment.")
            averages = averaging.set_final(averages, self._slot(ending.fallback))
        for segment in ending.add:
            averages = averaging.add_to_final(averages, self._slot(segment))
        final = state.replace(params=averages.final)
        if not self.config.freeze_batchnorm:
            final = recompute_batchnorm(final, program, self.config)
        chosen = swad.select_segments(self.losses, **self.options)
        record = self._record(final, program, rundir, last_record, chosen)
        rundir.write_swad_record(record)
        save_swad_variables(
            rundir.workdir,
            jax.device_get({"params": final.params, "batch_stats": final.batch_stats}),
        )
        return record

    def _record(self, final, program, rundir, last_record, chosen) -> dict:
        segments, dead_at = chosen
        starts = [0 if k == 0 else self.steps[k - 1] + 1 for k in segments]
        results = program.evaluator(final)
        record = make_record(
            self.config.to_dict(),
            rundir.workdir,
            step=last_record["step"],
            loss=validation_loss(results, self.train_envs),
            accuracies=results,
            test_envs=program.test_envs,
            smallest_env=min(len(program.dataset.splits[e]["in"]) for e in self.train_envs),
        )
        record["swad"] = {
            "first_step": int(min(starts)),
            "last_step": int(max(self.steps[k] for k in segments)),
            "segments": len(segments),
            "dead_at_step": None if dead_at is None else int(self.steps[dead_at]),
        }
        return record


def recompute_batchnorm(state, program, config):
    """The averaged weights' BatchNorm statistics, recomputed as the reference's
    ``update_bn`` does: the plain mean, over the next ``config.swad_batchnorm_batches``
    training minibatches (the reference's 500, augmented as in training), of each
    batch's statistics in training mode.

    A training forward from running statistics (0, 0) returns ``(1 - m) x`` the batch
    statistics (Flax's update ``m old + (1 - m) batch``, ``m`` the momentum), so each
    batch's are read by dividing by ``1 - m``. The variance is the biased batch variance
    (Flax's; torch's update_bn averages the unbiased one, ``n / (n - 1)`` larger)."""
    from sagm_jax.data import device_augment
    from sagm_jax.data.pipeline import prefetch_to_mesh
    from sagm_jax.models.resnet import BATCHNORM_MOMENTUM
    from sagm_jax.training.train_step import apply_model

    zeros = jax.tree.map(jax.numpy.zeros_like, state.batch_stats)
    start = int(state.step)

    @jax.jit
    def batch_statistics(params, batch, step):
        batch = device_augment.model_inputs(batch, config.seed, step, config.image_size)
        _, updated = apply_model(
            program.model, params, zeros, batch["image"], jax.numpy.dtype(config.compute_dtype),
            train=True, mutable=["batch_stats"], rngs={"dropout": jax.random.key(0)},
        )
        return jax.tree.map(lambda x: x / (1 - BATCHNORM_MOMENTUM), updated["batch_stats"])

    batches = prefetch_to_mesh(
        program.dataset.train_iterator(
            program.train_envs, seed=config.seed, batch_per_env=config.batch_per_env,
            start_step=start,
        ),
        program.mesh,
    )
    total = zeros
    try:
        for k in range(config.swad_batchnorm_batches):
            stats = batch_statistics(state.params, next(batches), start + k)
            total = jax.tree.map(lambda t, s, n=k: t + (s - t) / (n + 1), total, stats)
    finally:
        batches.close()
    return state.replace(batch_stats=total)
