"""Fishr (``--config.objective=fishr``): the domains' gradient variances matched.

This module owns the objective and its registry entry, as DomainBed's
``domainbed/algorithms.py`` (``Fishr``) and ``domainbed/lib/misc.py`` (``MovingAverage``,
``l2_between_dicts``) compute it; its hyperparameters and draws are DomainBed's
``domainbed/hparams_registry.py`` (``lambda``, ``penalty_anneal_iters``, ``ema``).

One step, with phi_i the features of row i, theta = (W, c) the network's linear
classifier, z_i = phi_i W + c, and M domains of b rows:

* per-example gradients of the classifier, g_i = grad_theta CE(z_i, y_i) (BackPACK's
  ``BatchGrad`` on the summed per-row loss in the reference; ``jax.vmap(jax.grad)``
  over the rows here, which is the same gradient of each row's own loss, and
  differentiable, as the reference's ``create_graph=True``);
* each domain's per-coordinate variance v_m = (1/b) sum_i (g_mi - mean_j g_mj)^2 (the
  population variance);
* an exponential moving average per domain (``MovingAverage``):
  E_m <- ema E_m + (1 - ema) v_m (E_m = 0 before step 0; the stored E_m is a constant),
  and the penalty reads V_m = E_m / (1 - ema) (``oneminusema_correction=True``: a
  constant 1 / (1 - ema), not Adam's 1 / (1 - ema^t); so V_m = v_m at step 0 and
  ema/(1 - ema) E_m(before) + v_m after, ``fishr_ema_correction="none"`` reads E_m);
* P = (1/M) sum_m mean_k (V_mk - Vbar_k)^2, Vbar = mean_m V_m, k over every coordinate of
  W and c together (``l2_between_dicts``);
* L = CE(z, y) over the concatenated batch + w P, w = 0 before step A =
  ``fishr_penalty_anneal_iters`` and ``fishr_lambda`` from it; Adam restarts before the
  update of step A (the reference skips the restart at A = 0, where Adam is fresh
  anyway). Reported: ``loss`` = L, ``nll`` = the CE, ``penalty`` = P.

The EMA E [M, ...] per classifier parameter lives in ``batch_stats["method"]["fishr_ema"]``
(``networks.MethodNetwork``: sized from the feature width, classes and domains, carried
by checkpoints and resume). It advances in the clean pass only (``Step.advance``); a
sharpness-aware head's second pass reads the train state's E, as the clean pass did, so
both passes differentiate one loss function. Everything is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.networks import OWN, MethodNetwork, classify
from sagm_jax.methods.objectives import (
    Step,
    by_domain,
    domain_losses,
    make_aux,
    per_example_cross_entropy,
)
from sagm_jax.methods.registry import (
    Distribution,
    Hyperparameter,
    Method,
    Objective,
    log_uniform,
    register_objective,
    uniform,
)

EMA_KEY = "fishr_ema"  # the EMA's key in batch_stats["method"]
CORRECTIONS = ("one_minus_ema", "none")


def per_example_gradients(head: dict, features, labels) -> dict:
    """``{name: [N, ...]}``: g_i = grad_theta CE(phi_i W + c, y_i) for every row i, the
    gradient of each row's own loss with respect to the classifier ``head``
    (``{"kernel": W [d, C], "bias": c [C]}``), by ``jax.vmap(jax.grad)`` over rows."""

    def row_loss(theta, phi, label):
        logits = classify({"classifier": theta}, phi[None])
        return per_example_cross_entropy(logits, label[None])[0]

    return jax.vmap(jax.grad(row_loss), in_axes=(None, 0, 0))(head, features, labels)


def domain_gradient_variances(grads: dict, num_domains: int) -> dict:
    """v_m = (1/b) sum_i (g_mi - mean_j g_mj)^2 per coordinate: each leaf [N, ...] of
    ``grads`` -> [M, ...] (rows m*b:(m+1)*b are domain m)."""

    def variance(g):
        g = by_domain(g, num_domains)
        return jnp.mean((g - g.mean(axis=1, keepdims=True)) ** 2, axis=1)

    return jax.tree.map(variance, grads)


def moving_average(stored: dict, current: dict, ema, correction: str) -> tuple[dict, dict]:
    """DomainBed's ``MovingAverage.update``: ``(what the penalty reads, new E)``.

    E_new = ema E + (1 - ema) v (``stored`` = E, zeros before step 0, ``current`` = v);
    the penalty reads E_new / (1 - ema) (``correction="one_minus_ema"``, the reference's
    default) or E_new (``"none"``); E_new is stored as a constant."""
    if correction not in CORRECTIONS:
        raise ValueError(f"fishr_ema_correction={correction!r}: expected one of "
                         f"{', '.join(CORRECTIONS)}")
    new = jax.tree.map(lambda e, v: ema * e + (1.0 - ema) * v, stored, current)
    read = new if correction == "none" else jax.tree.map(lambda e: e / (1.0 - ema), new)
    return read, jax.lax.stop_gradient(new)


def fishr_penalty(variances: dict) -> jax.Array:
    """P = (1/M) sum_m mean_k (V_mk - Vbar_k)^2, Vbar = mean_m V_m, k over every
    coordinate of every leaf of ``variances`` (leaves [M, ...]) concatenated."""
    flat = jnp.concatenate(
        [v.reshape(v.shape[0], -1) for v in jax.tree.leaves(variances)], axis=1
    )
    return jnp.mean((flat - flat.mean(axis=0, keepdims=True)) ** 2)


def _classifier(args: Step) -> dict:
    """The network's linear classifier at the parameters of this pass, in float32."""
    params = args.params if args.params is not None else {}
    if "classifier" not in params:
        raise ValueError("Fishr differentiates the network's classifier: the train step "
                         "must pass Step.params holding params['classifier'] "
                         f"(got keys {sorted(params)})")
    return jax.tree.map(lambda p: p.astype(jnp.float32), params["classifier"])


def _fishr(args: Step):
    """L = CE + w P (module docstring); E advances in the clean pass only."""
    out = args.forward(args.images)
    m, hp = args.num_domains, args.hp
    grads = per_example_gradients(_classifier(args), out.features.astype(jnp.float32),
                                  args.labels)
    stored = out.batch_stats[OWN][EMA_KEY]
    read, new = moving_average(stored, domain_gradient_variances(grads, m),
                               hp["fishr_ema"], hp["fishr_ema_correction"])
    penalty = fishr_penalty(read)
    losses = domain_losses(out.logits, args.labels, m)
    nll = losses.mean()  # equal domain sizes: the CE of the concatenated batch
    weight = jnp.where(args.step >= hp["fishr_penalty_anneal_iters"],
                       jnp.float32(hp["fishr_lambda"]), jnp.float32(0.0))
    loss = nll + weight * penalty
    own = {**out.batch_stats[OWN], EMA_KEY: new if args.advance else stored}
    out = out._replace(batch_stats={**out.batch_stats, OWN: own})
    return loss, make_aux(args, out, {"loss": loss, "nll": nll, "penalty": penalty}, losses)


def _fishr_init(key, shapes, hp) -> dict:
    """E = 0 per domain for the classifier's kernel [M, d, C] and bias [M, C]."""
    del key, hp
    m, d, c = shapes.num_domains, shapes.feature_dim, shapes.num_classes
    return {"batch_stats": {EMA_KEY: {"kernel": jnp.zeros((m, d, c), jnp.float32),
                                      "bias": jnp.zeros((m, c), jnp.float32)}}}


# DomainBed's int(r.uniform(0., 5000.)).
_ANNEAL_DRAW = Distribution("int(U(0,5000))", lambda rng: int(rng.uniform(0.0, 5000.0)))
register_objective(Objective(
    Method("fishr", "Fishr", (
        Hyperparameter("fishr_lambda", 1000.0, "weight of Fishr's penalty from the anneal's end",
                       ">= 0", log_uniform(1, 4)),
        Hyperparameter("fishr_penalty_anneal_iters", 1500,
                       "steps with penalty weight 0; Adam restarts at this step", "int >= 0",
                       _ANNEAL_DRAW),
        Hyperparameter("fishr_ema", 0.95, "EMA weight of the past domain gradient variances",
                       "[0, 1)", uniform(0.9, 0.99)),
        Hyperparameter(
            "fishr_ema_correction", "one_minus_ema",
            'the EMA the penalty reads: "one_minus_ema" (DomainBed: divided by 1 - ema) or '
            '"none" (the plain EMA)', "one of one_minus_ema, none"),
    ), "mean CE + lambda * spread over domains of the classifier's EMA gradient variances",
        "DomainBed (Rame et al. 2022)", (85.5, 77.8, 67.8, 47.4, 41.7, 64.0, "Fishr README")),
    _fishr, restart_key="fishr_penalty_anneal_iters", label_alone=True,
    network=MethodNetwork(init=_fishr_init),
))
