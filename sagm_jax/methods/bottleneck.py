"""Information-bottleneck objectives: IB_ERM and IB_IRM.

Both are DomainBed algorithms (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``,
classes ``IB_ERM`` and ``IB_IRM``; Ahuja et al. 2021, "Invariance principle meets
information bottleneck") whose update is ONE loss of the featurizer and the classifier
followed by one Adam step, so here each is an objective (a loss function and its
``register_objective`` entry): any update rule minimises it (ERM's Adam, or SAM, GSAM,
SAGM, DISAM, which take its gradient at w and at the perturbed point), with SWAD on top.

The information-bottleneck penalty is the variance of the features within each training
domain, averaged over the feature dimensions and the domains:

    P_IB = (1/M) sum_m (1/d) sum_k Var_i(phi_{m,i,k}),
    Var_i(x_i) = sum_i (x_i - mean x)^2 / (b - 1)    (unbiased: torch's ``var(dim=0)``),

phi the pooled (post-dropout) features of domain m's b rows. With nll = mean_m CE_m:

* IB_ERM: L = nll + w_IB P_IB, w_IB = 0 for steps 0..A_IB-1 and ``ib_lambda`` from step
  A_IB = ``ib_penalty_anneal_iters`` on (ERM during the anneal, not weight 1 as IRM's).
* IB_IRM: L = nll + w_IRM P_IRM + w_IB P_IB, P_IRM IRM's split-batch penalty
  (``objectives.irm_penalty``), w_IRM = 1 before A_IRM = ``irm_penalty_anneal_iters`` and
  ``irm_lambda`` from it on (IRM's anneal), w_IB as IB_ERM's.

State: none but the step counter, which the anneals read. The reference replaces its Adam
before the update of step A_IB (IB_ERM), and of steps A_IRM and A_IB (IB_IRM, both when
they differ): the entries' ``restart_key`` names those hyperparameters, and the train step
restarts the whole optimizer state there (``objectives.reset_optimizer_step``).

Reported, with DomainBed's keys: ``loss``, ``nll``, ``IB_penalty`` (and ``IRM_penalty``
for IB_IRM). DomainBed's quirk, reproduced: the reference writes ``loss = nll`` and then
``loss += w * penalty``, an in-place add on the very tensor ``nll`` names, so its reported
``nll`` is the whole loss, not the cross-entropy. The reported ``nll`` here is the loss
too (docs/methods.md, "IB_ERM and IB_IRM").
"""

from __future__ import annotations

import jax.numpy as jnp

from sagm_jax.methods.objectives import (
    Step,
    _annealed_weight,
    by_domain,
    domain_losses,
    irm_penalty,
    make_aux,
)
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    log_uniform,
    objective,
    register_objective,
)


def feature_variance_penalty(features, num_domains: int) -> jnp.ndarray:
    """P_IB = (1/M) sum_m (1/d) sum_k sum_i (phi_mik - mean_i phi_mik)^2 / (b - 1) of the
    features [N, d] of M domains of b rows (float32; needs b >= 2)."""
    phi = by_domain(features.astype(jnp.float32), num_domains)  # [M, b, d]
    centred = phi - phi.mean(axis=1, keepdims=True)
    variance = jnp.sum(centred * centred, axis=1) / (phi.shape[1] - 1)  # [M, d]
    return variance.mean()


def ib_weight(step, anneal_iters, ib_lambda) -> jnp.ndarray:
    """w_IB: 0 for steps 0..A-1, ``ib_lambda`` from step A on (DomainBed's
    ``ib_penalty_weight``)."""
    return jnp.where(step >= anneal_iters, jnp.float32(ib_lambda), jnp.float32(0.0))


def _ib_erm(args: Step):
    """L = nll + w_IB P_IB (module docstring); reported ``nll`` is L (DomainBed's quirk)."""
    out = args.forward(args.images)
    losses = domain_losses(out.logits, args.labels, args.num_domains)
    penalty = feature_variance_penalty(out.features, args.num_domains)
    weight = ib_weight(args.step, args.hp["ib_penalty_anneal_iters"], args.hp["ib_lambda"])
    loss = losses.mean() + weight * penalty
    metrics = {"loss": loss, "nll": loss, "IB_penalty": penalty}
    return loss, make_aux(args, out, metrics, losses)


def _ib_irm(args: Step):
    """L = nll + w_IRM P_IRM + w_IB P_IB (module docstring); reported ``nll`` is L."""
    out = args.forward(args.images)
    m = args.num_domains
    losses = domain_losses(out.logits, args.labels, m)
    irm = irm_penalty(by_domain(out.logits, m), by_domain(args.labels, m))
    ib = feature_variance_penalty(out.features, m)
    irm_w = _annealed_weight(args.step, args.hp["irm_penalty_anneal_iters"],
                             args.hp["irm_lambda"])
    ib_w = ib_weight(args.step, args.hp["ib_penalty_anneal_iters"], args.hp["ib_lambda"])
    loss = losses.mean() + irm_w * irm + ib_w * ib
    metrics = {"loss": loss, "nll": loss, "IRM_penalty": irm, "IB_penalty": ib}
    return loss, make_aux(args, out, metrics, losses)


IB_LAMBDA = Hyperparameter(
    "ib_lambda", 1e2, "weight of the feature-variance penalty after its anneal", "> 0",
    log_uniform(-1, 5),
    note=" (with 0 there is no bottleneck penalty: --config.objective=erm or irm trains that)",
)
IB_ANNEAL = Hyperparameter(
    "ib_penalty_anneal_iters", 500,
    "steps with bottleneck weight 0; Adam restarts at this step", "int >= 0",
    log_uniform(0, 4, integer=True),
)
_MIN_BATCH = dict(
    min_batch_per_env=2,
    min_batch_reason="the feature variance is unbiased (it divides by b - 1), so one "
    "example per domain gives 0/0",
)

register_objective(Objective(
    Method("ib_erm", "IB_ERM", (IB_LAMBDA, IB_ANNEAL),
           "mean domain loss + lambda * within-domain feature variance (after an ERM anneal)",
           "DomainBed (Ahuja et al. 2021)"),
    _ib_erm, restart_key="ib_penalty_anneal_iters", label_alone=True, **_MIN_BATCH,
))

# IRM's own hyperparameters (same keys, defaults, bounds and draws as DomainBed's IB_IRM).
_IRM_HYPERPARAMETERS = objective("irm").method.hyperparameters

register_objective(Objective(
    Method("ib_irm", "IB_IRM", (*_IRM_HYPERPARAMETERS, IB_LAMBDA, IB_ANNEAL),
           "IRM's loss + lambda * within-domain feature variance (after an anneal)",
           "DomainBed (Ahuja et al. 2021)"),
    _ib_irm, restart_key=("irm_penalty_anneal_iters", "ib_penalty_anneal_iters"),
    label_alone=True, min_batch_per_env=2,
    min_batch_reason="IRM's penalty needs each domain's odd half and the feature variance "
    "divides by b - 1, so one example per domain is undefined",
))
