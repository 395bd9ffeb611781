"""ERM++'s learning rate on the host: stage 1's plateau and stage 2's replay.

This module owns the decisions of DomainBed HEAD's ``ERMPlusPlus.set_lr``
(``domainbed/algorithms.py``) as ``scripts/train_autolr.py`` calls it at every
evaluation; ``sagm_jax.averaging.erm_plusplus`` runs the two stages around it and
``sagm_jax.training.train`` calls :class:`LearningRateRun` after each evaluation.

Stage 1 (``config.lr_plateau``): after every evaluation that follows the linear phase
(``set_lr`` acts once ``global_iter > linear_steps``, global_iter counting the updates
so far), the validation loss ``l`` (the mean over the training environments of the
moving average's 'out' loss) steps torch's ``ReduceLROnPlateau(mode='min', factor=0.1,
patience=1, threshold=1e-4, threshold_mode='rel', cooldown=0, min_lr=0, eps=1e-8)``::

    better = l < best * (1 - 1e-4);   best = l if better      (best starts at +inf)
    bad    = 0 if better else bad + 1
    if bad > 1:  lr' = max(0.1 lr, 0);  lr = lr' if lr - lr' > 1e-8;  bad = 0

and each evaluation whose lr differs from the previous evaluation's is a change; at the
third change the lr is 0 and stage 1 stops. Stage 2 (``config.lr_schedule``): the
factor after each evaluation past the linear phase is the schedule's next entry.

The lr is carried on the device as a factor of ``config.lr`` in the train state
(``TrainState.lr_factor``; scaling Adam's update is exact, its step is linear in lr),
set after the evaluation, before its checkpoint; on a resume the plateau's counters are
rebuilt by replaying the recorded losses (as ``SwadRun`` rebuilds its valley).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, 'min', patience=1)'s settings.
FACTOR, PATIENCE, THRESHOLD, EPS = 0.1, 1, 1e-4, 1e-8
CHANGES = 3  # the reference's set_lr: the third change sets the lr to 0 and stops


class ReduceLROnPlateau:
    """torch's ``ReduceLROnPlateau`` in mode 'min', threshold mode 'rel', no cooldown,
    min_lr 0, on one learning rate ``lr``: :meth:`step` takes a loss, returns the lr."""

    def __init__(self, lr: float, factor=FACTOR, patience=PATIENCE, threshold=THRESHOLD,
                 eps=EPS):
        self.lr, self.factor, self.patience = float(lr), factor, patience
        self.threshold, self.eps = threshold, eps
        self.best, self.bad = math.inf, 0

    def step(self, loss: float) -> float:
        loss = float(loss)
        if loss < self.best * (1 - self.threshold):
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        if self.bad > self.patience:
            reduced = max(self.lr * self.factor, 0.0)
            if self.lr - reduced > self.eps:
                self.lr = reduced
            self.bad = 0
        return self.lr


def validation_loss(record: dict, train_envs) -> float:
    """The mean over the training environments of their 'out' loss (the run's
    prediction: its moving average with ``config.moving_average``)."""
    return float(np.mean([record[f"env{e}_out_loss"] for e in train_envs]))


def after_linear_phase(step: int, linear_steps: int) -> bool:
    """Whether the evaluation after update ``step`` steps the schedule: the linear phase
    is over (``global_iter = step + 1`` updates so far; the reference's ``linear_steps``
    is ours minus one, ``methods.linear_probe``)."""
    return step + 1 >= linear_steps


class LearningRateRun:
    """The host side of a run's learning rate: stage 1's plateau (``config.lr_plateau``)
    or stage 2's replay (``config.lr_schedule``); rebuilt from ``records`` on a resume."""

    def __init__(self, config, train_envs, records=()):
        self.config, self.train_envs = config, list(train_envs)
        self.plateau = ReduceLROnPlateau(config.lr)
        self.factors: list[float] = []  # the factor after each evaluation past the probe
        self.changes = 0
        for record in records:
            self._observe(record)

    @property
    def stopped(self) -> bool:
        """Stage 1 stops at the third change (its lr is then 0)."""
        return self.config.lr_plateau and self.changes >= CHANGES

    def _observe(self, record: dict):
        if self.stopped or not after_linear_phase(record["step"], self.config.linear_steps):
            return None
        if self.config.lr_plateau:
            lr = self.plateau.step(validation_loss(record, self.train_envs))
            factor = lr / self.config.lr
            if self.factors and factor != self.factors[-1]:
                self.changes += 1
            factor = 0.0 if self.changes >= CHANGES else factor
        else:
            schedule = self.config.lr_schedule
            factor = float(schedule[min(len(self.factors), len(schedule) - 1)])
        self.factors.append(factor)
        return factor

    def after_evaluation(self, state, record: dict):
        """The state with the lr factor this evaluation sets (unchanged before the
        linear phase ends)."""
        factor = self._observe(record)
        if factor is None:
            return state
        if self.stopped:
            print(f"ERM++: the learning rate changed a third time at step {record['step']}; "
                  "stage 1 stops here, as train_autolr.py does.")
        return state.replace(lr_factor=jnp.asarray(factor, jnp.float32))


def learning_rate_run(config, train_envs, records):
    """A :class:`LearningRateRun` for a run with ``lr_plateau`` or ``lr_schedule``, else
    None."""
    if config.lr_plateau or config.lr_schedule:
        return LearningRateRun(config, train_envs, records)
    return None
