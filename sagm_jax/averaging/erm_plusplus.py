"""ERM++'s training length: the learning-rate plateau of stage 1 and its replay in stage 2.

ERM++ (Teterwak et al.) is DomainBed HEAD's ``ERMPlusPlus`` (``domainbed/algorithms.py``:
a linear phase, ``sagm_jax.methods.linear_probe``; the simple moving average of the
weights from update 600, ``sagm_jax.averaging.moving_average``; the AugMix ResNet-50;
the config preset ``erm_plusplus``) trained by ``domainbed/scripts/train_autolr.py``,
whose two stages this module runs::

    python -m sagm_jax.averaging.erm_plusplus \\
        --config=configs/rotated_digits.py:erm_plusplus --workdir DIR

Stage 1 (``DIR/stage1``, ``config.lr_plateau``): the DomainBed split (training on the
'in' parts). After every evaluation that follows the linear phase (``ERMPlusPlus.set_lr``
acts once ``global_iter > linear_steps``, global_iter counting the updates so far), the
validation loss ``l`` (the mean over the training environments of the moving average's
'out' loss) steps torch's ``ReduceLROnPlateau(mode='min', factor=0.1, patience=1,
threshold=1e-4, threshold_mode='rel', cooldown=0, min_lr=0, eps=1e-8)`` on the lr::

    better = l < best * (1 - 1e-4);   best = l if better
    bad    = 0 if better else bad + 1
    if bad > 1:  lr' = max(0.1 lr, 0);  lr = lr' if lr - lr' > 1e-8;  bad = 0

and the lr after it is recorded; each evaluation whose lr differs from the previous
evaluation's is a change; at the third change the lr is 0 and stage 1 stops (the
reference breaks there). The lr is carried on the device as a factor of ``config.lr``
in the train state (``TrainState.lr_factor``; scaling Adam's update is exact, its step
is linear in lr), set on the host after the evaluation, and, on a resume, rebuilt by
replaying the recorded losses (as ``SwadRun`` rebuilds its valley).

Stage 2 (``DIR/stage2``, ``config.lr_schedule``, ``config.split = "full_data"``):
trains again from scratch on the whole of every training environment (the reference's
``holdout_fraction = 0``) with the schedule replayed (the factor after each evaluation
past the linear phase, stage 1's) and stops where stage 1 stopped (``steps`` = stage
1's last step + 1). Its test environments' ``env{i}_in_acc`` is the whole environment's
(the reference's ``fd_env{i}_in_acc``); the 'out' parts it also records are DomainBed's
'out' parts, trained on here (``data.splits.full_data_split``): no model selection
should read them; stage 2's result is its last record. Its records are labelled "ERM++"
(``rundir.record_algorithm``).

Differences from the reference, stated:
* The validation loss is the per-example mean over each 'out' part
  (``training.evaluation``); the reference's ``set_lr`` takes each loader's mean of its
  64-example batches' means (the last, smaller batch weighs as a full one). Its loaders
  (``lib/fast_data_loader.py`` ``FastDataLoader``) draw the batches with torch's
  ``RandomSampler``, so which examples share the smaller batch is random; each batch's
  mean then has the part's mean as its expectation, and so has the reference's loss:
  ours is that expectation, not a draw of it.
* The reference's stage 1 breaks at the third change before writing that evaluation's
  record; ours writes it (its accuracies are the moving average's after that step) and
  stops. Its stage 2 pops one schedule entry per evaluation and breaks where the NEXT
  entry is 0, one evaluation before stage 1's last, again without that record; ours
  trains to stage 1's last evaluation step and records it (the lr it replays there is
  the one stage 1 trained with up to it).
* Stage 2 starts from stage 1's initialisation (the same ``seed``); the reference's
  stage 2 builds a new algorithm with torch's generator where stage 1 left it, so its
  classifier starts elsewhere.
* The reference has no resume; ours resumes each stage exactly (the factor is in the
  checkpoint, the plateau replayed from the records).
"""

from __future__ import annotations

import copy
import math
import os

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


def stage_configs(config, full_data: bool = True):
    """``(stage 1's config, a function of stage 1's records and training environments ->
    stage 2's config)``. Stage 2 trains on the whole of each environment (the split
    ``full_data``) unless ``full_data`` is False (its own split: the same as stage 1's)."""
    first = copy.deepcopy(config)
    first.lr_plateau, first.lr_schedule = True, ()

    def second(records, train_envs):
        run = LearningRateRun(first, train_envs, records)
        config2 = copy.deepcopy(config)
        config2.lr_plateau = False
        config2.lr_schedule = tuple(run.factors) or (1.0,)
        config2.steps = int(records[-1]["step"]) + 1
        if full_data:
            config2.split = "full_data"
        return config2

    return first, second


def train_erm_plusplus(config, workdir: str, full_data: bool = True) -> dict:
    """Both stages, as ``DIR/stage1`` and ``DIR/stage2``; prints the chosen length and
    stage 2's test accuracy; returns ``{"steps", "schedule", "test_acc", "stage1",
    "stage2"}`` (the records of each stage). ``full_data``: see :func:`stage_configs`."""
    from sagm_jax.training.train import train_one_run

    if config.split != "domainbed":
        raise ValueError(f"config.split={config.split}: ERM++'s stages split as DomainBed "
                         "does (stage 1 'domainbed', stage 2 'full_data'); expected domainbed.")
    first, second = stage_configs(config, full_data)
    records1 = train_one_run(first, os.path.join(workdir, "stage1"))
    config2 = second(records1, _train_envs(records1[-1]))
    print(f"ERM++: stage 1 chose {config2.steps} steps; learning-rate factors after "
          f"each evaluation past the linear phase: {list(config2.lr_schedule)}.")
    records2 = train_one_run(config2, os.path.join(workdir, "stage2"))
    test_envs = list(config.test_envs)
    test_acc = float(np.mean([records2[-1][f"env{e}_in_acc"] for e in test_envs]))
    print(f"ERM++: stage 2's test accuracy (step {records2[-1]['step']}, test environments "
          f"{test_envs}): {test_acc:.4f}")
    return {"steps": config2.steps, "schedule": list(config2.lr_schedule),
            "test_acc": test_acc, "stage1": records1, "stage2": records2}


def _train_envs(record: dict) -> list[int]:
    """The training environments of a record's run: those with an 'out' loss that are
    not held out."""
    test_envs = set(record["args"]["test_envs"])
    envs = sorted({int(k[3:].split("_")[0]) for k in record if k.startswith("env")
                   and k.endswith("_out_loss")})
    return [e for e in envs if e not in test_envs]


def main(argv=None):
    """The command line: ``--config=configs/DATASET.py:erm_plusplus --workdir DIR``
    (``--config.KEY=VALUE`` overrides as ``sagm_jax.main``'s)."""
    from absl import app, flags
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file(
        "config", None, "configs/DATASET.py:erm_plusplus", lock_config=True)
    workdir = flags.DEFINE_string("workdir", None, "DIR: the stages run in DIR/stage1, "
                                  "DIR/stage2.")
    flags.mark_flags_as_required(["config", "workdir"])
    def run(_):
        train_erm_plusplus(config.value, workdir.value)

    app.run(run, argv)


if __name__ == "__main__":
    main()
