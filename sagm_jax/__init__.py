"""sagm_jax: Sharpness-Aware Gradient Matching (SAGM) and its baselines in JAX.

Sub-packages, one per part:
  methods   every method: the registries of objectives and update rules
            (``registry``), the objectives, the sharpness-aware update rules (SAGM,
            SAM, GSAM, DISAM's ascent as optax transforms; the paper's optimizer) and
            the procedures (Fish, AND-mask, MLDG), each registered beside its code.
  averaging weight averaging: SWAD (its loss valley, its averages on the device), the
            moving average of a run, soups and ensembles across runs.
  training  one run: the train state and step, the training program, evaluation,
            checkpoints, the run directory, its summary, ``load_run``/``preprocess``.
  results   model selection, the result tables, the local sharpness and its curves.
  sweep     ``python -m sagm_jax.sweep``: a grid of runs, DomainBed's random search.
  models    the backbones (ResNets, CLIP, DINOv2, RegNetY) and their weights, MixStyle.
  data      DomainBed datasets, splits, the stores and input pipelines.
  config    every config field, its checks, the published presets.
Modules: ``main`` and ``cli`` (the command line), ``collect_results`` and
``sharpness_curves`` (``python -m`` commands of ``results``), ``claims``, ``cpu``,
``formatting``.

The public API below: the optax transforms and the paper's optimizer, the feature
penalties, SWAD's segment selection, local sharpness, DomainBed's random search and a
trained run's model and inputs (the last two imported on first use).
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
from sagm_jax.methods.objectives import coral_penalty, mmd_penalty
from sagm_jax.results.sharpness import sharpness
from sagm_jax.averaging.valley import select_segments

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
    "coral_penalty",
    "mmd_penalty",
    "select_segments",
    "random_hparams",
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


def random_hparams(algorithm: str, dataset: str, hparams_seed: int, trial_seed: int,
                   objective: str = "erm", disam_lambda: float = 0.0) -> dict:
    """DomainBed's random search: see :func:`sagm_jax.sweep.hparams.random_hparams`
    (imported on first use, as ``load_run``)."""
    from sagm_jax.sweep.hparams import random_hparams as draw

    return draw(algorithm, dataset, hparams_seed, trial_seed, objective, disam_lambda)
