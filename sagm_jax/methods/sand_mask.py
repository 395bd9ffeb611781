"""SAND-mask: AND-mask's agreement test smoothed by tanh, as DomainBed computes it.

This module owns DomainBed's ``SANDMask`` (``facebookresearch/DomainBed``,
``domainbed/algorithms.py``, ``SANDMask.update`` and ``SANDMask.mask_grads``; Shahtalebi
et al. 2021) as a per-domain procedure (``sagm_jax.methods.procedures.Procedure``):
``algorithm=sand_mask``. Each step takes every training domain's cross-entropy gradient
at ``w`` (one pass per domain, as the reference's loop over the minibatches), masks each
parameter tensor with :func:`sand_mask_gradient` and steps a persistent PyTorch
``Adam(lr, weight_decay, betas=(0.9, 0.999))`` on the masked gradient. The state is that
Adam's; the reference's ``update_count`` buffer is counted but never read.

Quirk: at the default ``tau = 1`` the agreement ``s`` never exceeds ``tau``, so
``tanh(k lam (s - tau)) <= 0`` and the clamp zeroes the mask wherever the domains'
gradients differ: a default run moves by weight decay only (and by the ``1e-17`` of the
NaN positions, below). DomainBed's search draws ``tau ~ U(0, 1)``; set
``sand_mask_tau`` below 1 for a run that trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sagm_jax.methods.procedures import DomainValueAndGrad, Params, Procedure, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    log_uniform,
    register_update_rule,
    uniform,
)

# DomainBed's mask_grads: the value a NaN variance (one domain) or a NaN mask entry
# (``inf * 0``: zero variance with ``s == tau``) is replaced by.
NAN_FILL = 1e-17
# The denominator's guard of the rescaling, AND-mask's.
MASK_EPS = 1e-10


def sand_mask_tensor(stacked: jax.Array, tau, k) -> jax.Array:
    """SAND-mask's gradient of one parameter tensor from its ``M`` domain gradients
    ``stacked`` [M, ...], elementwise as ``SANDMask.mask_grads``::

        g_bar = mean_m g_m
        var   = sum_m (g_m - g_bar)^2 / (M - 1)        (NaN for M = 1 -> 1e-17)
        lam   = 1 / var                                (inf where var = 0)
        s     = |mean_m sign(g_m)|                     (sign(0) = 0)
        mask  = max(tanh((k * lam) * (s - tau)), 0)    (NaN, from inf * 0 -> 1e-17)
        grad  = mask * g_bar / (1e-10 + mean of mask over the tensor's elements)

    The products are taken in the reference's order, so an infinite ``lam`` gives
    ``tanh(+-inf) = +-1`` and a NaN exactly where the reference's does."""
    avg = jnp.mean(stacked, axis=0)
    var = jnp.var(stacked, axis=0, ddof=1) if stacked.shape[0] > 1 else jnp.full_like(
        avg, jnp.nan)
    var = jnp.where(jnp.isnan(var), NAN_FILL, var)
    lam = 1.0 / var
    agreement = jnp.abs(jnp.mean(jnp.sign(stacked), axis=0))
    mask = jnp.tanh(k * lam * (agreement - tau))
    mask = jnp.maximum(mask, 0.0)  # NaN stays NaN, as torch.max does
    mask = jnp.where(jnp.isnan(mask), NAN_FILL, mask)
    return mask * avg / (MASK_EPS + jnp.mean(mask))


def sand_mask_gradient(domain_grads: Sequence[Params], tau, k) -> Params:
    """:func:`sand_mask_tensor` on every parameter tensor of the M domains' gradient
    pytrees ``domain_grads``, each tensor on its own (its own rescaling)."""
    return jax.tree.map(lambda *grads: sand_mask_tensor(jnp.stack(grads), tau, k),
                        *domain_grads)


def sand_mask(tau, k, *, learning_rate: float, weight_decay: float,
              num_domains: int) -> Procedure:
    """SAND-mask as DomainBed's ``SANDMask.update``: the M domains' losses and gradients at
    ``w``, :func:`sand_mask_gradient`, then a step of the persistent ``Adam(lr, wd)``
    (coupled L2 added after the mask, as ``torch.optim.Adam`` adds it). Reports ``loss``,
    the mean of the domain losses (the reference's ``mean_loss``)."""
    adam = torch_adam(learning_rate, weight_decay)

    def update(params, state, domain_value_and_grad: DomainValueAndGrad, key):
        del key  # SAND-mask draws nothing of its own
        losses, grads = zip(*(domain_value_and_grad(params, m) for m in range(num_domains)))
        updates, state = adam.update(sand_mask_gradient(grads, tau, k), state, params)
        return updates, state, {"loss": jnp.mean(jnp.stack(losses))}

    return Procedure(adam.init, update)


# --- the registry's entry ----------------------------------------------------------

# DomainBed's ``hparams_registry.py`` (``SANDMask``): ``tau`` (1.0, U(0, 1)) and ``k``
# (10, 10^U(-3, 5)); our keys are prefixed (AND-mask owns ``and_mask_tau``, drawn from
# U(0.5, 1)) and map to DomainBed's names in ``sagm_jax.sweep.hparams.DOMAINBED_NAMES``.
register_update_rule(UpdateRule(
    Method("sand_mask", "SAND-mask", (
        Hyperparameter("sand_mask_tau", 1.0, "SAND-mask's agreement threshold (DomainBed's "
                       "tau; at 1 the mask is zero wherever the domains' gradients differ)",
                       "[0, 1]", uniform(0.0, 1.0)),
        Hyperparameter("sand_mask_k", 10.0, "SAND-mask's tanh steepness (DomainBed's k)",
                       "> 0", log_uniform(-3, 5)),
    ), "the mean of the domain gradients scaled by tanh(k (agreement - tau) / variance), "
       "clamped at 0, rescaled per tensor", "DomainBed (Shahtalebi et al. 2021)"),
    "procedure",
    lambda hp, **common: sand_mask(hp["sand_mask_tau"], hp["sand_mask_k"], **common),
))
