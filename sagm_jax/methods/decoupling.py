"""Spectral decoupling (SD): cross-entropy plus a penalty on the squared logits.

DomainBed's ``SD`` (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``, class
``SD``; Pezeshki et al. 2021, "Gradient Starvation", equation 25) forwards the
concatenated minibatches once and minimises

    L = CE(z, Y) + sd_reg * mean_{i, c} z_ic^2,        z = f(X) [N, C],

with ERM's Adam: one loss of one step's batch, so here it is an objective (a loss and its
``register_objective`` entry) that every update rule minimises (ERM's Adam, or SAM, GSAM,
SAGM, DISAM, which take its gradient at w and at the perturbed point) and SWAD averages.
It has no state and no random draws.

The reference reports ``loss`` = CE alone (not the objective it minimises) and
``penalty`` = mean z^2, as DomainBed's CORAL reports its data term; so do we. Its penalty
is the mean over all N * C logits weighted by ``sd_reg``, not the paper's
(lambda / 2) * ||z_i||^2 summed over classes: the two differ by the factor 2 / C, which
``sd_reg``'s search absorbs, so it is kept as DomainBed computes it (docs/methods.md,
"SD").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.objectives import Step, domain_losses, make_aux
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    log_uniform,
    register_objective,
)


def logit_penalty(logits) -> jax.Array:
    """SD's penalty: P = mean_{i, c} z_ic^2 over the [N, C] logits, in float32."""
    return jnp.mean(jnp.square(logits.astype(jnp.float32)))


def sd_loss(args: Step):
    """L = J + sd_reg P, J = CE(f(X), Y) over the concatenated batch (the mean of the
    domain losses), P = :func:`logit_penalty`; reported: ``loss`` = J, ``penalty`` = P."""
    out = args.forward(args.images)
    losses = domain_losses(out.logits, args.labels, args.num_domains)
    data = losses.mean()
    penalty = logit_penalty(out.logits)
    loss = data + args.hp["sd_reg"] * penalty
    return loss, make_aux(args, out, {"loss": data, "penalty": penalty}, losses)


register_objective(Objective(
    Method("sd", "SD", (
        Hyperparameter(
            "sd_reg", 0.1, "SD's weight of the mean squared logit", "> 0", log_uniform(-5, -1),
            note=" (with 0 there is no penalty: the run would be ERM labelled SD; "
            "--config.objective=erm trains ERM)",
        ),
    ), "cross-entropy + sd_reg * mean squared logit (spectral decoupling)",
        "DomainBed (Pezeshki et al. 2021)"),
    sd_loss, label_alone=True,
))
