"""sagm_jax: Sharpness-Aware Gradient Matching (SAGM) and its baselines in JAX.

Sub-packages and modules, each owning one part:
  optimizers   SAGM, SAM and GSAM (and DISAM's ascent) as optax transformations; the
               paper's optimizer.
  methods      the one table of objectives and update rules (labels, hyperparameters).
  objectives   ERM, Mixup, CutMix, CORAL, MMD, GroupDRO, IRM, VREx: the step's loss.
  procedures   Fish, AND-mask, MLDG: updates from per-domain gradients.
  swad, averaging, swad_run
               SWAD: the loss valley, the weight averages, SWAD in a run.
  hparams      DomainBed's random hyperparameter search.
  sharpness    local sharpness h_rho (the paper's Figure 3).
  models       Flax ResNets with torchvision weights, DomainBed's MNIST CNN, MixStyle.
  data         DomainBed datasets, splits and input pipelines.
  rundir       the run directory: its file names, records and readers, ``find_runs``.
  sweep        ``python -m sagm_jax.sweep``: a grid of runs, each run exactly once.
  collect_results, sharpness_curves
               ``python -m``: a sweep's result tables; its local sharpness curves.
  train        the training program (train_step, rundir, checkpoints, evaluation);
               ``load_run(workdir, which="best")`` gives a trained run's model,
               ``preprocess(workdir, images)`` its input.
"""

from sagm_jax.methods.update_rules import (
    ALGORITHMS,
    SharpnessAwareState,
    global_norm,
    gsam,
    gsam_rho_schedule,
    paper_optimizer,
    perturbation_vector,
    sagm,
    sam,
)
from sagm_jax.results.sharpness import sharpness

__all__ = [
    "ALGORITHMS",
    "SharpnessAwareState",
    "global_norm",
    "gsam",
    "gsam_rho_schedule",
    "paper_optimizer",
    "perturbation_vector",
    "sagm",
    "sam",
    "sharpness",
    "load_run",
    "preprocess",
]


def load_run(workdir: str, which="best"):
    """A trained run's ``(model, variables, record)``: see
    :func:`sagm_jax.training.loading.load_run` (imported on first use, so the optimizers
    alone stay light)."""
    from sagm_jax.training.loading import load_run as load

    return load(workdir, which)


def preprocess(workdir: str, images):
    """``images`` as the run in ``workdir`` evaluates them: see
    :func:`sagm_jax.training.loading.preprocess` (imported on first use, as ``load_run``)."""
    from sagm_jax.training.loading import preprocess as prepare

    return prepare(workdir, images)
