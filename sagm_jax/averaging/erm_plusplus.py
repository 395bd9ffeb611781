"""ERM++'s training length: the learning-rate plateau of stage 1 and its replay in stage 2.

ERM++ (Teterwak et al.) is DomainBed HEAD's ``ERMPlusPlus`` (``domainbed/algorithms.py``:
a linear phase, ``sagm_jax.methods.linear_probe``; the simple moving average of the
weights from update 600, ``sagm_jax.averaging.moving_average``; the AugMix ResNet-50;
the config preset ``erm_plusplus``) trained by ``domainbed/scripts/train_autolr.py``,
whose two stages this module runs::

    python -m sagm_jax.averaging.erm_plusplus \\
        --config=configs/rotated_digits.py:erm_plusplus --workdir DIR

Stage 1 (``DIR/stage1``, ``config.lr_plateau``): the DomainBed split (training on the
'in' parts); after every evaluation past the linear phase torch's ``ReduceLROnPlateau``
steps on the moving average's validation loss, and the third change of the lr ends the
stage (``sagm_jax.averaging.lr_plateau`` states the rule).

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
import os

import numpy as np

from sagm_jax.averaging.lr_plateau import LearningRateRun
from sagm_jax.training.train import train_one_run


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
    if config.split != "domainbed":
        raise ValueError(f"config.split={config.split}: ERM++'s stages split as DomainBed "
                         "does (stage 1 'domainbed', stage 2 'full_data'); expected domainbed.")
    first, second = stage_configs(config, full_data)
    records1 = train_one_run(first, os.path.join(workdir, "stage1"))
    config2 = second(records1, _train_envs(records1[-1]))
    print(f"ERM++: stage 1 chose {config2.steps} steps; learning-rate factors after "
          f"each evaluation past the linear phase: "
          f"{', '.join(f'{f:g}' for f in config2.lr_schedule)}.")
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
        from absl import logging

        from sagm_jax import cpu

        cpu.configure()  # XLA reads its flags once, when JAX starts its backend
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        train_erm_plusplus(config.value, workdir.value)

    app.run(run, argv)


if __name__ == "__main__":
    main()
