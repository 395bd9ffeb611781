"""The update rules that are their own procedure: Fish, AND-mask and MLDG.

This module owns the three DomainBed algorithms that do not fit "one objective, one
gradient, one optax chain": each needs the gradient of every training domain's
minibatch on its own, sometimes at weights other than ``w``, and keeps its own
optimizer state (DomainBed's ``domainbed/algorithms.py``: ``Fish``, ``ANDMask``, ``MLDG``).
Each is a :class:`Procedure`:

    state = procedure.init(params)
    updates, state, metrics = procedure.update(params, state, domain_value_and_grad, key)
    params = optax.apply_updates(params, updates)       # the train step does this

``domain_value_and_grad(params, m)`` returns the cross-entropy of domain ``m``'s
minibatch at ``params`` and its gradient (``m`` a Python int or a traced int32; each
call draws its own dropout). ``metrics["loss"]`` is the loss the reference reports.
The procedures take the ``erm`` objective only (``methods.combination_problem``).

A procedure with ``whole_batch=True`` (DANN, CDANN, SagNet, mDSDI) receives
:class:`BatchPasses` in place of ``domain_value_and_grad``: training passes over the whole
batch at any parameters, the batch and the step. Its own modules (``UpdateRule.network``)
sit in ``params["method"]`` (``sagm_jax.methods.networks.split_params``), so it steps
each parameter group with an optimizer of its own.

``Adam(lr, wd)`` is PyTorch's Adam: betas (0.9, 0.999), eps 1e-8, COUPLED L2
(``grad + wd * w`` enters the moments), built by ``update_rules.paper_optimizer('erm')``.
Each procedure's registry entry (``registry.register_update_rule``, kind "procedure")
sits at the end of the module.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    choice,
    log_uniform,
    register_update_rule,
    settings,
    uniform,
    update_rule,
)
from sagm_jax.methods.update_rules import paper_optimizer

Params = Any
DomainValueAndGrad = Callable[[Params, Any], tuple[jax.Array, Params]]

# DomainBed's AND-mask divides by (this + the kept fraction), so a fully masked tensor
# gets a zero gradient instead of 0/0.
AND_MASK_EPS = 1e-10
# The epsilon of PyTorch's Adam, which MLDG's closed-form inner step repeats.
ADAM_EPS = 1e-8


class Procedure(NamedTuple):
    """``init(params) -> state``; ``update(params, state, domain_value_and_grad, key)
    -> (updates, state, metrics)``, pure and jittable; ``metrics["loss"]`` is the
    reported loss. With ``whole_batch`` the third argument is :class:`BatchPasses`."""

    init: Callable[[Params], Any]
    update: Callable[..., tuple[Params, Any, dict]]
    whole_batch: bool = False


class BatchPasses(NamedTuple):
    """What a ``whole_batch`` procedure's update reads: ``forward_at(params, key)`` is a
    training pass's ``forward(images) -> objectives.Outputs`` at ``params`` with dropout
    drawn from ``key``; ``images`` [N, ...] and ``labels`` [N] hold the ``num_domains``
    minibatches concatenated in order; ``step`` counts the updates before this one."""

    forward_at: Callable
    images: jax.Array
    labels: jax.Array
    num_domains: int
    step: jax.Array


def torch_adam(learning_rate: float, weight_decay: float,
               betas: tuple[float, float] | None = None) -> optax.GradientTransformation:
    """PyTorch's ``Adam(lr, weight_decay, betas)``: coupled L2 (``g + wd * w`` enters the
    moments), eps 1e-8; betas (0.9, 0.999) unless given (they may be traced: a pack)."""
    if betas is None:
        return paper_optimizer("erm", learning_rate=learning_rate, weight_decay=weight_decay)
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_adam(b1=betas[0], b2=betas[1], eps=1e-8),
        optax.scale_by_learning_rate(learning_rate),
    )


def fish(meta_lr: float, *, learning_rate: float, weight_decay: float,
         num_domains: int) -> Procedure:
    """Fish (Shi et al. 2022) as DomainBed computes it; the state is the inner Adam's.

    Each step, with ``S`` the inner ``Adam(lr, wd)`` state carried from the last step::

        w' = w
        for m in 0..M-1:  l_m, g_m = CE_m(w'), grad CE_m(w');  w', S = Adam step(g_m, S) at w'
        w <- w + meta_lr * (w' - w);   report l_(M-1) (measured before its inner step)

    The inner moments and count persist across steps (the count grows by M per step);
    weight decay enters only through the inner Adam. The reference also interpolates
    BatchNorm's running statistics; the train step refuses procedures with trainable
    BatchNorm, and frozen BatchNorm (DomainBed's published protocol) has none to move.
    """
    inner_adam = torch_adam(learning_rate, weight_decay)

    def update(params, state, domain_value_and_grad: DomainValueAndGrad, key):
        del key  # Fish draws nothing of its own
        inner = params
        for m in range(num_domains):
            loss, grads = domain_value_and_grad(inner, m)
            step, state = inner_adam.update(grads, state, inner)
            inner = optax.apply_updates(inner, step)
        updates = jax.tree.map(lambda w_inner, w: meta_lr * (w_inner - w), inner, params)
        return updates, state, {"loss": loss}

    return Procedure(inner_adam.init, update)


def and_mask_gradient(domain_grads: Sequence[Params], tau: float) -> Params:
    """AND-mask's gradient from the M domains' gradients ``g_m`` (Parascandolo et al. 2021).

    For every parameter tensor P on its own, elementwise::

        s = |mean_m sign(g_m)|           (sign(0) = 0)
        mask = [s >= tau]
        grad_P = mask * mean_m g_m / (1e-10 + mean of mask over P's elements)

    so a tensor whose domains disagree everywhere gets a zero gradient. For M = 3 the
    agreement ``s`` takes the values {1/3, 1}; for M = 5, {0.2, 0.6, 1}.
    """

    def masked_mean(*grads):
        stacked = jnp.stack(grads)
        agreement = jnp.abs(jnp.mean(jnp.sign(stacked), axis=0))
        mask = (agreement >= tau).astype(stacked.dtype)
        return mask * jnp.mean(stacked, axis=0) / (AND_MASK_EPS + jnp.mean(mask))

    return jax.tree.map(masked_mean, *domain_grads)


def and_mask(tau: float, *, learning_rate: float, weight_decay: float,
             num_domains: int) -> Procedure:
    """AND-mask as DomainBed computes it: :func:`and_mask_gradient` of the domains'
    gradients at ``w``, then ``Adam(lr, wd)`` (the decay is added after the mask, so a
    fully masked tensor moves by decay only). Reports the mean of the domain losses."""
    adam = torch_adam(learning_rate, weight_decay)

    def update(params, state, domain_value_and_grad: DomainValueAndGrad, key):
        del key  # AND-mask draws nothing of its own
        losses, grads = zip(*(domain_value_and_grad(params, m) for m in range(num_domains)))
        updates, state = adam.update(and_mask_gradient(grads, tau), state, params)
        return updates, state, {"loss": jnp.mean(jnp.stack(losses))}

    return Procedure(adam.init, update)


def first_adam_step(params: Params, grads: Params, learning_rate: float,
                    weight_decay: float) -> Params:
    """The weights after the first step of a fresh ``Adam(lr, wd)``, in closed form:
    ``w - lr * g_hat / (|g_hat| + 1e-8)`` with ``g_hat = g + wd * w`` (the bias
    corrections make the first moments ``g_hat`` and ``g_hat**2`` exactly)."""

    def step(w, g):
        g_hat = g + weight_decay * w
        return w - learning_rate * g_hat / (jnp.abs(g_hat) + ADAM_EPS)

    return jax.tree.map(step, params, grads)


def mldg_split_problem(n_meta_test: int, num_domains: int) -> str | None:
    """Why MLDG cannot split ``num_domains`` training domains into meta-train and
    ``n_meta_test`` meta-test ones, or None. DomainBed's ``split_meta_train_test``
    (``domainbed/lib/misc.py``) takes ``perm[:M - n]`` as meta-train: with ``n >= M`` that
    is empty (``n = M``) or the wrong domains (``n > M``, a negative slice), and
    ``MLDG.update`` then steps Adam on zero gradients, reporting loss 0: it trains
    nothing (ColoredMNIST, M = 2, n = 2)."""
    if 1 <= n_meta_test < num_domains:
        return None
    return (
        f"config.mldg_n_meta_test={n_meta_test} with num_domains={num_domains} training "
        f"domains: MLDG needs 1 <= mldg_n_meta_test < num_domains (it pairs the "
        f"num_domains - mldg_n_meta_test meta-train domains with the meta-test ones; "
        f"with none, DomainBed's MLDG trains nothing). Lower config.mldg_n_meta_test "
        f"to at most {num_domains - 1}"
        + (" (or train on at least 2 domains)." if num_domains < 2 else ".")
    )


def check_mldg_split(n_meta_test: int, num_domains: int) -> None:
    """Refuses a split with no meta-train domain (:func:`mldg_split_problem`); the
    config refuses it before a run where the dataset's domains are known, this at
    set-up for an image folder's."""
    problem = mldg_split_problem(n_meta_test, num_domains)
    if problem:
        raise ValueError(problem)


def mldg_gradient(params: Params, domain_value_and_grad: DomainValueAndGrad, key: jax.Array,
                  *, beta: float, n_meta_test: int, learning_rate: float,
                  weight_decay: float, num_domains: int) -> tuple[Params, jax.Array]:
    """MLDG's first-order meta-gradient ``G`` and its reported loss (DomainBed since 2022-04).

    With ``M = num_domains``, ``n = n_meta_test`` and ``pi = jax.random.permutation(key, M)``,
    meta-train ``tr = pi[:M-n]`` and meta-test ``te = pi[M-n:]``::

        for k in 0..M-n-1:  (i, j) = (tr[k], te[k mod n])
            l_i, g_i = CE_i(w), grad CE_i(w)
            w' = first_adam_step(w, g_i)                 # a fresh inner Adam(lr, wd)
            l_j, g_j = CE_j(w'), grad CE_j(w')           # no derivative through w'
            G += (g_i + beta * g_j) / M;   rep += l_i + beta * l_j
        return G, rep / M

    Both sums divide by M, not by the M - n pairs, as the reference does. The
    reference truncates each pair to a common length; the minibatches here are equal.
    """
    train_split = num_domains - n_meta_test
    perm = jax.random.permutation(key, num_domains)
    meta_train, meta_test = perm[:train_split], perm[train_split:]
    meta_grad = jax.tree.map(jnp.zeros_like, params)
    reported = jnp.zeros([], jnp.float32)
    for k in range(train_split):
        loss_i, grad_i = domain_value_and_grad(params, meta_train[k])
        inner = first_adam_step(params, grad_i, learning_rate, weight_decay)
        loss_j, grad_j = domain_value_and_grad(inner, meta_test[k % n_meta_test])
        meta_grad = jax.tree.map(
            lambda acc, g_i, g_j: acc + g_i / num_domains + beta * g_j / num_domains,
            meta_grad, grad_i, grad_j,
        )
        reported = reported + loss_i + beta * loss_j
    return meta_grad, reported / num_domains


def mldg(beta: float, n_meta_test: int, *, learning_rate: float, weight_decay: float,
         num_domains: int) -> Procedure:
    """MLDG (Li et al. 2018, first order): :func:`mldg_gradient`, then a persistent
    ``Adam(lr, wd)`` step on it; ``key`` draws the meta-train/meta-test split."""
    check_mldg_split(n_meta_test, num_domains)
    adam = torch_adam(learning_rate, weight_decay)

    def update(params, state, domain_value_and_grad: DomainValueAndGrad, key):
        meta_grad, loss = mldg_gradient(
            params, domain_value_and_grad, key, beta=beta, n_meta_test=n_meta_test,
            learning_rate=learning_rate, weight_decay=weight_decay, num_domains=num_domains,
        )
        updates, state = adam.update(meta_grad, state, params)
        return updates, state, {"loss": loss}

    return Procedure(adam.init, update)


def make_procedure(name: str, hp: Mapping[str, Any], *, learning_rate: float,
                   weight_decay: float, num_domains: int) -> Procedure:
    """The registered procedure ``name`` with its hyperparameters read from ``hp`` by
    its entry's config keys (a missing key takes the registry's default; other keys are
    ignored)."""
    rule = update_rule(name)
    if rule.kind != "procedure":
        raise ValueError(f"procedure {name!r}: {name} is a {rule.kind} update rule, not a "
                         "procedure (update_rules.rule_optimizer builds it).")
    return rule.build(settings(rule.method, hp), learning_rate=learning_rate,
                      weight_decay=weight_decay, num_domains=num_domains)


# --- the registry's entries --------------------------------------------------------

register_update_rule(UpdateRule(
    Method("fish", "Fish", (
        Hyperparameter("fish_meta_lr", 0.5, "Fish's meta step toward the inner weights",
                       "(0, 1]", choice((0.05, 0.1, 0.5))),
    ), "inner Adam over the domains in turn (its state persists), then "
       "w <- w + meta_lr (w' - w)", "DomainBed (Shi et al. 2022)",
        (85.5, 77.8, 68.6, 45.1, 42.7, 63.9, "SAGM paper")),
    "procedure", lambda hp, **common: fish(hp["fish_meta_lr"], **common),
))
register_update_rule(UpdateRule(
    Method("and_mask", "AND-mask", (
        Hyperparameter("and_mask_tau", 1.0, "AND-mask's agreement threshold", "[0, 1]",
                       uniform(0.5, 1)),
    ), "mean of the domain gradients where their signs agree, rescaled",
        "DomainBed (Parascandolo et al. 2021)",
        (84.4, 78.1, 65.6, 44.6, 37.2, 62.0, "SAGM paper")),
    "procedure", lambda hp, **common: and_mask(hp["and_mask_tau"], **common),
))
register_update_rule(UpdateRule(
    Method("mldg", "MLDG", (
        Hyperparameter("mldg_beta", 1.0, "weight of the meta-test gradient", ">= 0",
                       log_uniform(-1, 1)),
        Hyperparameter("mldg_n_meta_test", 2, "meta-test domains per step", "int >= 1",
                       choice((1, 2))),
    ), "first-order meta-learning: gradient at w plus the meta-test gradient after one "
       "inner Adam step", "DomainBed (Li et al. 2018)",
        (84.9, 77.2, 66.8, 47.7, 41.2, 63.6, "DomainBed")),
    "procedure",
    lambda hp, **common: mldg(hp["mldg_beta"], int(hp["mldg_n_meta_test"]), **common),
))
