"""IGA (``--config.objective=iga``): the domains' parameter gradients aligned.

DomainBed's ``IGA`` (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``, class
``IGA``; Koyama & Yamaguchi, "Inter-environmental Gradient Alignment", arXiv 2008.01883v2)
is one loss and one Adam step, so here it is an objective: any update rule minimises it
(ERM's Adam, or SAM, GSAM, SAGM, DISAM, which take its gradient at w and at the perturbed
point), with SWAD on top. Its hyperparameter is DomainBed's ``penalty`` (config key
``iga_penalty``; ``domainbed/hparams_registry.py``: default 1000, drawn 10^U(1, 5)).

With theta ALL the network's parameters and M domains of b rows, L_m = CE of domain m:

* g_m = grad_theta L_m, kept differentiable (the reference's ``create_graph=True``), for
  every domain;
* gbar = grad_theta (1/M) sum_m L_m = (1/M) sum_m g_m, which the reference takes WITHOUT
  ``create_graph``: a constant in the backward pass;
* P = sum_m sum_k (g_mk - gbar_k)^2, k over every coordinate of every parameter (a sum,
  not a mean, over domains and coordinates);
* L = (1/M) sum_m L_m + lambda P, lambda = ``iga_penalty``; no anneal, no restart.

The gradient of L is second order: dP/dtheta = 2 sum_m H_m (g_m - gbar), H_m the Hessian
of L_m. gbar being a constant changes nothing: its own term, -2 Hbar sum_m (g_m - gbar),
is zero because the deviations sum to zero; gbar is a ``stop_gradient`` here, as there.

Here, as in the reference, each domain's gradient comes from a pass over that domain's
rows alone (``Step.forward_at``, the train step's pass as a function of the parameters,
called once per domain in an unrolled loop) and ``jax.grad`` of the loss differentiates
through them. (Taking all M gradients as vector-Jacobian products of one pass over the
whole batch costs M backward passes over the WHOLE batch: 4.5x slower on the offline
RotatedDigits run, docs/performance.md.) The reported features and logits are the
domains' passes concatenated; with trainable BatchNorm the new running statistics are
the mean of the M passes' updates (the whole batch's update for the means; the
variances' update leaves out the spread between the domains' means), where the
reference updates them M times in turn. Every gradient and the penalty are float32,
whatever the compute dtype.

Reported, with DomainBed's keys: ``loss`` = the mean domain loss (not L) and
``penalty`` = P.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.objectives import Step, make_aux, per_example_cross_entropy
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    log_uniform,
    register_objective,
)


def domain_gradients(forward_at, params, images, labels, num_domains: int):
    """``(losses [M], grads, outputs)``: the M domain losses L_m, each from a pass over
    domain m's rows at ``params``, and ``grads``, a pytree like ``params`` whose leaves
    are [M, ...], leaf m the gradient of L_m (float32), differentiable with respect to
    ``params``; ``outputs`` the passes' features and logits concatenated."""
    rows = images.shape[0] // num_domains
    losses, grads, outs = [], [], []
    for m in range(num_domains):
        part = slice(m * rows, (m + 1) * rows)

        def loss_of_domain(p, part=part):
            out = forward_at(p)(images[part])
            return per_example_cross_entropy(out.logits, labels[part]).mean(), out

        (loss, out), grad = jax.value_and_grad(loss_of_domain, has_aux=True)(params)
        losses.append(loss)
        grads.append(grad)
        outs.append(out)
    stacked = jax.tree.map(lambda *g: jnp.stack(g).astype(jnp.float32), *grads)
    out = outs[0]._replace(
        features=jnp.concatenate([o.features for o in outs]),
        logits=jnp.concatenate([o.logits for o in outs]),
        # first + the mean change: exactly the first where the passes leave them alone
        batch_stats=jax.tree.map(lambda first, *s: first + sum(x - first for x in s) / num_domains,
                                 *[o.batch_stats for o in outs]),
    )
    return jnp.stack(losses), stacked, out


def gradient_penalty(grads) -> jax.Array:
    """P = sum_m sum_k (g_mk - gbar_k)^2 over the leaves [M, ...] of ``grads``, gbar the
    mean over m held constant (DomainBed's ``mean_grad`` has no ``create_graph``)."""
    total = jnp.float32(0.0)
    for g in jax.tree.leaves(grads):
        mean = jax.lax.stop_gradient(g.mean(axis=0))
        total = total + jnp.sum((g - mean) ** 2)
    return total


def _iga(args: Step):
    """L = mean_m L_m + iga_penalty * P (module docstring); reported ``loss`` is the
    mean domain loss, ``penalty`` P."""
    if args.forward_at is None or args.params is None:
        raise ValueError(
            "objective iga differentiates the network's per-domain gradients, so its loss "
            "needs Step.forward_at and Step.params (the train step passes both)."
        )
    losses, grads, out = domain_gradients(args.forward_at, args.params, args.images,
                                          args.labels, args.num_domains)
    mean_loss = losses.mean()
    penalty = gradient_penalty(grads)
    loss = mean_loss + args.hp["iga_penalty"] * penalty
    return loss, make_aux(args, out, {"loss": mean_loss, "penalty": penalty}, losses)


register_objective(Objective(
    Method("iga", "IGA", (
        Hyperparameter(
            "iga_penalty", 1000.0, "IGA's lambda: weight of the domains' gradient deviations",
            "> 0", log_uniform(1, 5),
            note=" (with 0 there is no gradient penalty: --config.objective=erm trains ERM)",
        ),
    ), "mean domain loss + lambda * squared deviation of each domain's parameter gradient "
       "from the mean (second order)",
        "DomainBed (Koyama & Yamaguchi 2020)"),
    _iga, label_alone=True,
))
