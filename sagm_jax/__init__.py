"""sagm_jax: Sharpness-Aware Gradient Matching (SAGM) and its baselines in JAX.

Sub-packages and modules, each owning one part:
  optimizers   SAGM, SAM and GSAM as optax transformations; the paper's optimizer.
  sharpness    local sharpness h_rho (the paper's Figure 3).
  models       Flax ResNets with torchvision weights, DomainBed's MNIST CNN, MixStyle.
  data         DomainBed datasets, splits and input pipelines.
  train        the training program (train_step, rundir, checkpoints, evaluation);
               ``load_run(workdir, which="best")`` gives a trained run's model.
"""

from sagm_jax.optimizers import (
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
from sagm_jax.sharpness import sharpness

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
]


def load_run(workdir: str, which="best"):
    """A trained run's ``(model, variables, record)``: see :func:`sagm_jax.train.load_run`
    (imported on first use, so the optimizers alone stay light)."""
    from sagm_jax.train import load_run as load

    return load(workdir, which)
