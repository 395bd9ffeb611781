"""sagm_jax: Sharpness-Aware Gradient Matching (SAGM) and its baselines in JAX.

Sub-packages and modules, each owning one part:
  optimizers   SAGM, SAM and GSAM as optax transformations; the paper's optimizer.
  sharpness    local sharpness h_rho (the paper's Figure 3).
  models       Flax ResNets with torchvision weights, DomainBed's MNIST CNN, MixStyle.
  data         DomainBed datasets, splits and input pipelines (tf.data).
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
]
