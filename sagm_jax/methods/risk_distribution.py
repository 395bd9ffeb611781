"""RDM (``--config.objective=rdm``): the worst domain's risk distribution matched to all.

DomainBed's ``RDM`` (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``, class
``RDM`` with its ``my_cdist``, ``gaussian_kernel`` and ``mmd``; Nguyen et al. 2024,
"Domain Generalisation via Risk Distribution Matching") is one loss and one Adam step,
so here it is an objective that any update rule minimises, with SWAD on top.

With M domains of b rows, l_mi the cross-entropy of row i of domain m (one forward of the
concatenated batch, sliced per domain, as the reference) and L_m = mean_i l_mi:

* the worst domain w = argmax_m L_m (the first on a tie; no gradient through the choice);
* the matching penalty, a Gaussian-kernel MMD between the b losses of domain w and the
  M*b losses of all domains, each a one-dimensional sample:

      MMD(u, v) = mean K(u, u) + mean K(v, v) - 2 mean K(u, v),
      K(s, t) = sum_{gamma in {1e-4, 1e-3, ..., 1e3}} exp(-gamma max((s - t)^2, 1e-30)),

  (eight bandwidths, one more than CORAL's and MMD's), the squared distance written
  s^2 + t^2 - 2 s t as ``my_cdist`` writes it, every mean over all entries;
* the variance penalty V = Var(all M*b losses) + Var(domain w's b losses), each unbiased
  (divides by n - 1: torch's ``var``);
* L = mean_m L_m + w_M MMD + w_V V, with w_M = ``rdm_lambda`` and w_V =
  ``rdm_variance_weight`` (DomainBed's ``variance_weight``) from step A =
  ``rdm_penalty_anneal_iters`` on and both 0 before (ERM during the anneal);
* at step A a fresh Adam with learning rate ``rdm_lr`` (the run's weight decay) replaces
  the old one and steps from then on (``Objective.restart_key`` and ``restart_lr_key``, as
  EQRM's ``eqrm_lr``).

Reported, with DomainBed's keys where they are per-step values: ``loss`` (the reference's
``total_loss``, L), ``erm_loss``, ``matching_penalty``, ``variance_penalty`` (its
``update_count`` is the step and its ``rdm_lambda`` the hyperparameter, not logged).

Quirks of the reference: it allocates its domain losses with ``.cuda()`` and so runs on
a GPU only; here the same loss runs anywhere. It ``squeeze``s the [M, b] losses, so with
one training domain the "worst domain" is the first example alone and its variance (one
value) is NaN, which makes every step's loss NaN (0 * NaN, even during the anneal); with
one row per domain the same holds. The config refuses both before a run.

DomainBed's hyperparameters depend on the dataset (``domainbed/hparams_registry.py``,
``algorithm == "RDM"``; :func:`by_dataset`): rdm_lambda 0.5, U(0.1, 1) on DomainNet, 5.0,
U(1, 10) on PACS and TerraIncognita, 5.0, U(0.1, 10) elsewhere; the anneal 2400,
int(U(1500, 3000)) on DomainNet, 1500, int(U(800, 2700)) elsewhere; variance_weight 0
on TerraIncognita, OfficeHome and DomainNet, 0.004, U(0.001, 0.007) elsewhere; rdm_lr
1.5e-5, U(8e-6, 2e-5); and its own batch (not on the MNIST-like datasets): 40,
int(U(30, 60)) on DomainNet and TerraIncognita, 88, int(U(70, 100)) elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.objectives import (
    MMD_DISTANCE_FLOOR,
    Step,
    by_domain,
    make_aux,
    per_example_cross_entropy,
)
from sagm_jax.methods.registry import (
    Distribution,
    Hyperparameter,
    Method,
    Objective,
    choice,
    register_objective,
    uniform,
)

# RDM's ``gaussian_kernel`` bandwidths: CORAL's and MMD's and 1e-4.
RDM_GAMMAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


def int_uniform(low: float, high: float) -> Distribution:
    """``int(r.uniform(low, high))``, as DomainBed draws RDM's anneal and batch."""
    return Distribution(f"int(U({low:g},{high:g}))", lambda rng: int(rng.uniform(low, high)))


def risk_kernel(s, t) -> jax.Array:
    """K[i, j] = sum_gamma exp(-gamma max(s_i^2 + t_j^2 - 2 s_i t_j, 1e-30)) of two
    one-dimensional samples s [n], t [n'] (float32), over :data:`RDM_GAMMAS`."""
    s, t = s.astype(jnp.float32)[:, None], t.astype(jnp.float32)[None, :]
    distance = jnp.maximum(t * t - 2.0 * s * t + s * s, MMD_DISTANCE_FLOOR)
    return sum(jnp.exp(-gamma * distance) for gamma in RDM_GAMMAS)


def risk_mmd(s, t) -> jax.Array:
    """mean K(s, s) + mean K(t, t) - 2 mean K(s, t) (biased: diagonals included)."""
    return risk_kernel(s, s).mean() + risk_kernel(t, t).mean() - 2.0 * risk_kernel(s, t).mean()


def unbiased_variance(x) -> jax.Array:
    return jnp.sum((x - x.mean()) ** 2) / (x.shape[0] - 1)


def rdm_terms(per_row, num_domains: int):
    """``(domain losses [M], matching penalty, variance penalty)`` from the per-row losses
    [N] of M domains (module docstring)."""
    rows = by_domain(per_row.astype(jnp.float32), num_domains)  # [M, b]
    losses = rows.mean(axis=1)
    worst = rows[jnp.argmax(jax.lax.stop_gradient(losses))]
    flat = rows.reshape(-1)
    matching = risk_mmd(worst, flat)
    variance = unbiased_variance(flat) + unbiased_variance(worst)
    return losses, matching, variance


def _rdm(args: Step):
    """L = mean_m L_m + w (rdm_lambda MMD + rdm_variance_weight V), w = 0 before step
    rdm_penalty_anneal_iters and 1 from it (module docstring)."""
    if args.num_domains < 2:
        raise ValueError(
            f"objective rdm with {args.num_domains} training domain: DomainBed's RDM squeezes "
            "the domains' losses, so with one domain its worst domain is one example, whose "
            "variance is NaN (every step's loss is NaN there); it needs at least 2 training "
            "domains."
        )
    out = args.forward(args.images)
    per_row = per_example_cross_entropy(out.logits, args.labels)
    losses, matching, variance = rdm_terms(per_row, args.num_domains)
    erm = losses.mean()
    on = args.step >= args.hp["rdm_penalty_anneal_iters"]
    match_w = jnp.where(on, jnp.float32(args.hp["rdm_lambda"]), jnp.float32(0.0))
    variance_w = jnp.where(on, jnp.float32(args.hp["rdm_variance_weight"]), jnp.float32(0.0))
    loss = erm + match_w * matching + variance_w * variance
    metrics = {"loss": loss, "erm_loss": erm, "matching_penalty": matching,
               "variance_penalty": variance}
    return loss, make_aux(args, out, metrics, losses)


def by_dataset(dataset: str, mnist_like: bool) -> dict:
    """DomainBed's per-dataset defaults and draws of RDM (module docstring):
    ``{config key: (default, Distribution)}``."""
    if dataset == "DomainNet":
        lam = (0.5, uniform(0.1, 1.0))
    elif dataset in ("PACS", "TerraIncognita"):
        lam = (5.0, uniform(1.0, 10.0))
    else:
        lam = (5.0, uniform(0.1, 10.0))
    anneal = ((2400, int_uniform(1500, 3000)) if dataset == "DomainNet"
              else (1500, int_uniform(800, 2700)))
    variance = ((0.0, choice((0.0,))) if dataset in ("TerraIncognita", "OfficeHome", "DomainNet")
                else (0.004, uniform(0.001, 0.007)))
    changed = {"rdm_lambda": lam, "rdm_penalty_anneal_iters": anneal,
               "rdm_variance_weight": variance}
    if not mnist_like:  # DomainBed's SMALL_IMAGES take the shared batch of 64
        changed["batch_per_env"] = ((40, int_uniform(30, 60))
                                    if dataset in ("DomainNet", "TerraIncognita")
                                    else (88, int_uniform(70, 100)))
    return changed


register_objective(Objective(
    Method("rdm", "RDM", (
        Hyperparameter("rdm_lambda", 5.0, "weight of the risk-distribution MMD from the "
                       "anneal's end (DomainBed's default depends on the dataset)", ">= 0",
                       uniform(0.1, 10.0)),
        Hyperparameter("rdm_penalty_anneal_iters", 1500, "ERM before this step; a fresh Adam "
                       "at rdm_lr at this step", "int >= 0", int_uniform(800, 2700)),
        Hyperparameter("rdm_variance_weight", 0.004, "weight of the variance of the losses "
                       "(all and the worst domain's) from the anneal's end", ">= 0",
                       uniform(0.001, 0.007)),
        Hyperparameter("rdm_lr", 1.5e-5, "learning rate of the fresh Adam from the anneal's "
                       "end", "> 0", uniform(8e-6, 2e-5)),
    ), "mean domain loss + lambda * MMD between the worst domain's and all losses + a "
       "variance term, after an ERM anneal", "DomainBed (Nguyen et al. 2024)",
        by_dataset=by_dataset),
    _rdm, restart_key="rdm_penalty_anneal_iters", restart_lr_key="rdm_lr", label_alone=True,
    min_batch_per_env=2, min_batch_reason="RDM's variance of the worst domain's losses is "
    "unbiased (it divides by b - 1), so one example per domain gives NaN",
    min_train_domains=2, min_domains_reason="DomainBed's RDM squeezes the domains' losses, "
    "so with one domain its worst domain is one example, whose variance is NaN",
))
