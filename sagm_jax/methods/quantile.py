"""EQRM: the alpha-quantile of the training domains' risks (DomainBed's ``EQRM``,
``domainbed/algorithms.py``, with ``Nonparametric``, ``KernelDensityEstimator`` and
``continuous_bisect_fun_left`` of ``domainbed/lib/misc.py``; Eastwood et al. 2022).

With the M domain risks r_1..r_M of a step (each domain's mean cross-entropy, slices of
the one forward), sorted r_(1) <= ... <= r_(M):

* burn-in, steps t < ``eqrm_burnin_iters`` = B: L = mean_m r_m (ERM);
* from step B on: L = Q_alpha, the alpha-quantile (alpha = ``eqrm_quantile``) of the
  Gaussian kernel density estimate of the risks,

      F(x) = (1/M) sum_m Phi((x - r_m) / h),   h = 1.06 s M^(-1/5)   ("Gauss-optimal"),

  s the unbiased standard deviation of the risks (divides by M - 1), found as the
  reference finds it: bisection on F from lo = r_(1) + h z, hi = r_(M) + h z,
  z = Phi^-1(alpha) = sqrt(2) erfinv(2 alpha - 1); k = (lo + hi)/2, then 32 times
  ``hi <- k if F(k) > alpha else lo <- k``, k = (lo + hi)/2, stopping early once k no
  longer moves; Q_alpha = k;
* at step t == B a fresh Adam with learning rate ``eqrm_lr`` replaces the old one
  (``Objective.restart_key`` and ``restart_lr_key``: the train step restarts the
  optimizer and scales its steps by eqrm_lr / lr from then on).

The gradient, as the reference's autograd takes it: the comparisons carry none, so k is
c lo + (1 - c) hi with c fixed by the bisection's path, and

    dL = c dr_(1) + (1 - c) dr_(M) + z dh,

through the smallest and largest risks and the bandwidth only (``eqrm_gradient``
"bisection", the default). ``eqrm_gradient="implicit"`` is the quantile's own gradient
instead, from F(Q) = alpha: dQ = sum_m w_m (dr_m + (Q - r_m)/h dh), w_m proportional to
phi((Q - r_m)/h). Both have the same value.

The reference computes lo, hi, k and F in float64 (its alpha is a float64 tensor); here
they are float32, which moves Q by float32 rounding only. Reported: ``loss`` (the mean
during burn-in, Q_alpha after), as the reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sagm_jax.methods.objectives import Step, domain_losses, make_aux
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    log_uniform,
    register_objective,
    uniform,
)

# DomainBed's ``estimate_bandwidth(..., "Gauss-optimal")``: 1.06 s n^(-1/5).
BANDWIDTH_FACTOR = 1.06
# ``continuous_bisect_fun_left``'s ``n_steps``.
BISECTION_STEPS = 32
GRADIENTS = ("bisection", "implicit")


def kde_bandwidth(risks) -> jax.Array:
    """h = 1.06 s n^(-1/5), s the unbiased standard deviation of ``risks`` [n]. Its
    gradient is finite where s = 0 (all risks equal), where sqrt's is not."""
    n = risks.shape[0]
    variance = jnp.sum((risks - risks.mean()) ** 2) / (n - 1)
    positive = variance > 0
    s = jnp.where(positive, jnp.sqrt(jnp.where(positive, variance, 1.0)), 0.0)
    return BANDWIDTH_FACTOR * s * n ** -0.2


def kde_cdf(x, risks, bandwidth) -> jax.Array:
    """F(x) = mean_m Phi((x - r_m) / h), Phi(u) = (1 + erf(u / sqrt 2)) / 2."""
    return jnp.mean(0.5 * (1.0 + jax.scipy.special.erf((x - risks) / bandwidth / math.sqrt(2))))


def _bisection(cdf, alpha, lo, hi):
    """DomainBed's ``continuous_bisect_fun_left(cdf, alpha, lo, hi, 32)``: k = (lo + hi)/2,
    then per step ``hi <- k`` if cdf(k) > alpha else ``lo <- k``, k = (lo + hi)/2, stopping
    once k no longer moves. Differentiable as the reference's: the comparisons carry no
    gradient, every k is a mean of the two ends."""

    def body(_, carry):
        lo, hi, k, done = carry
        above = jax.lax.stop_gradient(cdf(k)) > alpha
        new_lo, new_hi = jnp.where(above, lo, k), jnp.where(above, k, hi)
        new_k = 0.5 * (new_lo + new_hi)
        # Stopped: the reference breaks and returns the k it had (the same value; its
        # gradient is that k's mix of the ends).
        stop = done | (new_k == k)
        return (jnp.where(done, lo, new_lo), jnp.where(done, hi, new_hi),
                jnp.where(stop, k, new_k), stop)

    start = (lo, hi, 0.5 * (lo + hi), jnp.asarray(False))
    return jax.lax.fori_loop(0, BISECTION_STEPS, body, start)[2]


def kde_quantile(risks, alpha, gradient: str = "bisection") -> jax.Array:
    """The alpha-quantile of the Gaussian KDE of ``risks`` [n] (module docstring), with
    the reference's gradient ("bisection") or the quantile's implicit one ("implicit")."""
    if gradient not in GRADIENTS:
        raise ValueError(f"eqrm_gradient={gradient!r}: expected one of {', '.join(GRADIENTS)}.")
    data = jnp.sort(risks.astype(jnp.float32))
    bandwidth = kde_bandwidth(data)
    z = math.sqrt(2) * jax.scipy.special.erfinv(2.0 * jnp.asarray(alpha, jnp.float32) - 1.0)
    lo, hi = data[0] + bandwidth * z, data[-1] + bandwidth * z
    if gradient == "bisection":
        return _bisection(lambda x: kde_cdf(x, data, bandwidth), alpha, lo, hi)
    frozen = jax.lax.stop_gradient((data, bandwidth))
    q = jax.lax.stop_gradient(_bisection(lambda x: kde_cdf(x, *frozen), alpha, lo, hi))
    # F(Q; r, h) = alpha: dQ = -dF / F'(Q), F' the KDE's density at Q.
    density = jax.lax.stop_gradient(jax.grad(kde_cdf)(q, *frozen))
    level = kde_cdf(q, data, bandwidth)
    return q - (level - jax.lax.stop_gradient(level)) / density


def _eqrm(args: Step):
    """L = mean_m r_m for steps < eqrm_burnin_iters, else ``kde_quantile`` of the
    domain risks at eqrm_quantile; reported ``loss`` is L."""
    if args.num_domains < 2:
        raise ValueError(
            f"objective eqrm with {args.num_domains} training domain: its kernel density "
            "estimate's bandwidth is the unbiased standard deviation of the domains' risks, "
            "which needs at least 2 training domains (DomainBed's EQRM fails there too)."
        )
    out = args.forward(args.images)
    risks = domain_losses(out.logits, args.labels, args.num_domains)
    quantile = kde_quantile(risks, args.hp["eqrm_quantile"], args.hp["eqrm_gradient"])
    loss = jnp.where(args.step < args.hp["eqrm_burnin_iters"], risks.mean(), quantile)
    return loss, make_aux(args, out, {"loss": loss}, risks)


register_objective(Objective(
    Method("eqrm", "EQRM", (
        Hyperparameter("eqrm_quantile", 0.75, "alpha: the quantile of the domains' risks "
                       "EQRM minimises after the burn-in", "(0, 1)", uniform(0.5, 0.99)),
        # A number, not an integer: DomainBed draws 10^U(2.5, 3.5) without int(), and a
        # drawn value that is not a whole number never equals the step, so its run keeps
        # its Adam and lr (docs/methods.md, "EQRM").
        Hyperparameter("eqrm_burnin_iters", 2500.0, "ERM before this step; a fresh Adam at "
                       "eqrm_lr at this step (only when it is a whole number, as DomainBed)",
                       ">= 0", log_uniform(2.5, 3.5)),
        Hyperparameter("eqrm_lr", 1e-6, "learning rate of the fresh Adam from the end of the "
                       "burn-in", "> 0", log_uniform(-7, -5)),
        Hyperparameter("eqrm_gradient", "bisection", '"bisection" (DomainBed\'s: through the '
                       'extreme risks and the bandwidth) or "implicit" (the quantile\'s own)',
                       "one of bisection, implicit"),
    ), "alpha-quantile of the domains' risks through a Gaussian KDE, after an ERM burn-in",
        "DomainBed (Eastwood et al. 2022)"),
    _eqrm, restart_key="eqrm_burnin_iters", restart_lr_key="eqrm_lr", label_alone=True,
    min_train_domains=2, min_domains_reason="EQRM's kernel density estimate needs the "
    "unbiased standard deviation of the domains' risks, which one domain leaves undefined",
))
