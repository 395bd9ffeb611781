"""mDSDI (Bui et al., NeurIPS 2021): domain-invariant and domain-specific encoders, with a
meta-learning step on the domain-specific part.

This module owns the procedure ``algorithm=mdsdi``, its modules and its prediction,
following the authors' code (``hamanhbui/mDSDI``, ``algorithms/mDSDI/src/Trainer_mDSDI.py``:
``Trainer_mDSDI.train``, ``Domain_Discriminator``, ``Classifier``, ``ZS_Domain_Classifier``).

Modules. ``zi`` is the run's network (its featurizer; its own classifier is never used:
it stays at init). ``zs`` is a second copy of the network, initialised from the run's
step-0 variables, kept under ``params["method"]["zs_encoder"]`` (BatchNorm statistics
under ``batch_stats["method"]["zs_encoder"]``). The heads, each a ``torch.nn.Linear`` at
PyTorch's default init, under ``params["method"]``: ``classifier`` Linear(2F, C) on
``[zi, zs]``; ``discriminator`` Linear(F, F)-ReLU-Linear(F, F)-ReLU-Linear(F, D) on
``zi`` behind a gradient reversal; ``zs_domain_classifier`` Linear(F, D) on ``zs``.
Prediction (the reference's ``evaluate``/``test``): ``classifier([zi(x), zs(x)])``.

One step, on the ``D`` training domains' minibatches ``B_1..B_D`` (``B`` their union,
``d`` the rows' domain indices, every ``Adam`` PyTorch's with the run's lr and weight
decay; the authors' configs: lr 5e-5, no weight decay)::

    # 1. one loss, one Adam over zi, zs, classifier, discriminator, zs_domain_classifier
    L_cls = CE(classifier([zi, zs]), y)
    L_dc  = CE(discriminator(GRL(zi)), d)           # GRL: identity, gradient * -1
    L_zsc = CE(zs_domain_classifier(zs), d)
    L_dis = mean_{n,i,j} ((zi - mean_n zi)_{ni} (zs - mean_n zs)_{nj})^2
    w <- Adam_main step of grad(L_cls + L_dc + L_zsc + L_dis)
    # 2. at the new w, a first-order meta step on theta = (zs, classifier)
    for j in 1..D:  tr = B \\ B_j, te = B_j
        l_tr, g_tr = CE_tr(theta), grad CE_tr(theta)      # zi fixed at the new w
        theta' = first_adam_step(theta, g_tr)     # a fresh inner Adam(lr, wd): one step
        l_te, g_te = CE_te(theta'), grad CE_te(theta')      # no derivative through theta'
        G += (g_tr + beta * g_te) / D                       # beta = mdsdi_meta_test_weight
    theta <- Adam_meta step of G

``Adam_main`` and ``Adam_meta`` keep their own moments and counts (both step every
iteration); ``zs`` and ``classifier`` are in both. The reported ``loss`` is
``L_cls + L_dc + L_zsc + L_dis``, besides each term and the meta losses' means over j.

Computed here, with the same result:

* ``L_dis`` as ``sum_n |zi_c[n]|^2 |zs_c[n]|^2 / (N F^2)``, without the [N, F, F]
  tensor (:func:`disentangle_loss`).
* The reference pairs the domains in a random order (``random_pairs_of_minibatches``)
  and forwards the meta-train and meta-test rows on their own. The meta gradient is a
  sum over all D pairs of row-wise means, so the order changes nothing but rounding:
  the pairs go in domain order, with no draw. All meta-train gradients are taken at
  the same ``theta``, and a mean over rows is a sum over domains: with ``S_k``, ``g_k``
  the sum of domain k's cross-entropies at ``theta`` and its gradient, pair j's
  ``l_tr, g_tr = sum_{k != j} (S_k, g_k) / ((D - 1) n)`` (``n`` rows a domain). So the
  meta step makes one pass per domain at ``theta`` and one meta-test pass per domain at
  its ``theta'``: twice the batch, against the reference's D times (the network treats
  rows independently: the procedures run with BatchNorm frozen). With dropout, the D - 1
  pairs that share a meta-train domain share its mask; the reference draws one per pair.
  The passes are unrolled in Python, not a ``lax.scan``: XLA's CPU backend runs the
  convolutions inside a loop body in a slow generic form (a RotatedDigits step took 7 s
  instead of 0.25 s; docs/performance.md).
* Every pass runs both encoders (the method's prediction), so ``zi`` and ``zs`` of one
  pass share the dropout key (the same mask when ``resnet_dropout > 0``; DomainBed's
  default 0 and the digits CNN have none); the reference draws them apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.networks import MethodNetwork, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import Procedure, first_adam_step, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    register_update_rule,
)
from sagm_jax.models.resnet import torch_linear_init

ZS = "zs_encoder"  # the domain-specific copy of the network, in params["method"]
HEADS = ("classifier", "discriminator", "zs_domain_classifier")
# The parameter groups of the two optimizers: "zi" the run's featurizer, "zs" the copy's.
MAIN_GROUP = ("zi", "zs") + HEADS
META_GROUP = ("zs", "classifier")


# ----------------------------------------------------------------------------
# Modules


def init_linear(key, n_in: int, n_out: int) -> dict:
    """``torch.nn.Linear(n_in, n_out)`` at PyTorch's init: kernel [n_in, n_out] and bias
    ~ U(-1/sqrt(n_in), 1/sqrt(n_in))."""
    kernel_key, bias_key = jax.random.split(key)
    draw = torch_linear_init(n_in)
    return {"kernel": draw(kernel_key, (n_in, n_out)), "bias": draw(bias_key, (n_out,))}


def linear(params: dict, x) -> jax.Array:
    """``x @ kernel + bias`` in float32."""
    return x.astype(jnp.float32) @ params["kernel"].astype(jnp.float32) + params[
        "bias"
    ].astype(jnp.float32)


@jax.custom_vjp
def reverse_gradient(x):
    """The reference's ``GradReverse``: the identity forward, the gradient times -1."""
    return x


reverse_gradient.defvjp(lambda x: (x, None), lambda _, g: (-g,))


def discriminate(params: dict, zi) -> jax.Array:
    """``Domain_Discriminator``: Linear-ReLU-Linear-ReLU-Linear on ``GRL(zi)``."""
    hidden = jax.nn.relu(linear(params["hidden_0"], reverse_gradient(zi)))
    hidden = jax.nn.relu(linear(params["hidden_1"], hidden))
    return linear(params["output"], hidden)


def init_mdsdi(key, shapes, hp, *, network) -> dict:
    """The method's variables at step 0: the ``zs`` copy of the run's network at its
    step-0 variables and the three heads at PyTorch's init."""
    del hp
    _, variables = network
    width, classes, domains = shapes.feature_dim, shapes.num_classes, shapes.num_domains
    keys = jax.random.split(key, 5)
    params = {
        ZS: jax.tree.map(jnp.array, variables["params"]),
        "classifier": init_linear(keys[0], 2 * width, classes),
        "discriminator": {"hidden_0": init_linear(keys[1], width, width),
                          "hidden_1": init_linear(keys[2], width, width),
                          "output": init_linear(keys[3], width, domains)},
        "zs_domain_classifier": init_linear(keys[4], width, domains),
    }
    own = {"params": params}
    if variables.get("batch_stats"):
        own["batch_stats"] = {ZS: jax.tree.map(jnp.array, variables["batch_stats"])}
    return own


def predict_mdsdi(base, own, images, train, hp):
    """``classifier([zi(x), zs(x)])``: features ``[zi, zs]`` [N, 2F] and the logits;
    ``zs`` is the run's network applied at the copy's variables."""
    del train, hp
    copy = {"params": own["params"][ZS]}
    if "batch_stats" in own:
        copy["batch_stats"] = own["batch_stats"][ZS]
    zi, _ = base(images)
    zs, _ = base(images, copy)
    features = jnp.concatenate([zi.astype(jnp.float32), zs.astype(jnp.float32)], axis=-1)
    return (features, linear(own["params"]["classifier"], features)), None


# ----------------------------------------------------------------------------
# Parameter groups


def _featurizer(network_params: dict) -> dict:
    return {k: v for k, v in network_params.items() if k != "classifier"}


def parameter_group(params: dict, names: tuple[str, ...]) -> dict:
    """The parameters an optimizer holds: ``zi`` (the run's featurizer), ``zs`` (the
    copy's featurizer) and the heads, by name."""
    network, own = split_params(params)
    parts = {"zi": _featurizer(network), "zs": _featurizer(own[ZS]),
             **{name: own[name] for name in HEADS}}
    return {name: parts[name] for name in names}


def with_group(params: dict, group: dict) -> dict:
    """``params`` with the parameters of ``group`` (:func:`parameter_group`) replaced."""
    network, own = split_params(params)
    network = {**network, **group.get("zi", {})}
    own = {**own, **{name: group[name] for name in HEADS if name in group}}
    if "zs" in group:
        own[ZS] = {**own[ZS], **group["zs"]}
    return join_params(network, own)


# ----------------------------------------------------------------------------
# The update


def disentangle_loss(zi, zs) -> jax.Array:
    """The reference's ``MSELoss(C, 0)`` with ``C[n, i, j] = zi_c[n, i] zs_c[n, j]``
    (centred over the batch), as ``sum_n |zi_c[n]|^2 |zs_c[n]|^2 / (N F_i F_s)``: the
    same sum without the [N, F, F] tensor."""
    zi_c = zi - jnp.mean(zi, axis=0)
    zs_c = zs - jnp.mean(zs, axis=0)
    per_row = jnp.sum(zi_c**2, axis=1) * jnp.sum(zs_c**2, axis=1)
    return jnp.sum(per_row) / (zi.shape[0] * zi.shape[1] * zs.shape[1])


def main_loss(group: dict, params: dict, passes, key) -> tuple[jax.Array, dict]:
    """``L_cls + L_dc + L_zsc + L_dis`` at ``params`` with ``group`` (MAIN_GROUP) in
    place, and the terms."""
    out = passes.forward_at(with_group(params, group), key)(passes.images)
    width = out.features.shape[-1] // 2
    zi, zs = out.features[:, :width], out.features[:, width:]
    domains = jnp.arange(passes.labels.shape[0]) // (passes.labels.shape[0] // passes.num_domains)
    terms = {
        "classification_loss": jnp.mean(per_example_cross_entropy(out.logits, passes.labels)),
        "domain_discriminator_loss": jnp.mean(
            per_example_cross_entropy(discriminate(group["discriminator"], zi), domains)),
        "zs_domain_loss": jnp.mean(
            per_example_cross_entropy(linear(group["zs_domain_classifier"], zs), domains)),
        "disentangle_loss": disentangle_loss(zi, zs),
    }
    return sum(terms.values()), terms


def meta_gradient(params: dict, passes, key, *, meta_test_weight: float,
                  learning_rate: float, weight_decay: float):
    """``G`` over ``theta = (zs, classifier)`` (META_GROUP) at ``params`` (the module
    docstring's step 2) and the means over j of ``l_tr`` and ``l_te``.

    With ``S_k``, ``g_k`` the sum of domain k's cross-entropies at ``theta`` and its
    gradient (one pass per domain, dropout from ``fold_in(key, k)``) and ``n`` rows per
    domain, pair j's meta-train loss and gradient are ``sum_{k != j} (S_k, g_k) /
    ((D - 1) n)``; its meta-test pass runs on domain j's rows at ``theta'``
    (``fold_in(key, D + j)``)."""
    num_domains = passes.num_domains
    images = passes.images.reshape(num_domains, -1, *passes.images.shape[1:])
    labels = passes.labels.reshape(num_domains, -1)
    theta = parameter_group(params, META_GROUP)

    def cross_entropy_sum(theta, k, pass_key):  # domain k's rows, summed
        out = passes.forward_at(with_group(params, theta), pass_key)(images[k])
        return jnp.sum(per_example_cross_entropy(out.logits, labels[k]))

    # Python loops, not lax.scan: XLA's CPU backend runs convolutions inside a loop body
    # in a slow generic form (docs/performance.md).
    sums, grads = zip(*(jax.value_and_grad(cross_entropy_sum)(theta, k, jax.random.fold_in(key, k))
                        for k in range(num_domains)))
    rows_tr = (num_domains - 1) * labels.shape[1]
    grad = jax.tree.map(jnp.zeros_like, theta)
    train_losses, test_losses = [], []
    for j in range(num_domains):
        others = [k for k in range(num_domains) if k != j]
        loss_tr = sum(sums[k] for k in others) / rows_tr
        grad_tr = jax.tree.map(lambda *g: sum(g) / rows_tr, *(grads[k] for k in others))
        inner = first_adam_step(theta, grad_tr, learning_rate, weight_decay)
        loss_te, grad_te = jax.value_and_grad(cross_entropy_sum)(
            inner, j, jax.random.fold_in(key, num_domains + j))
        grad = jax.tree.map(
            lambda acc, g_tr, g_te: acc + g_tr / num_domains
            + meta_test_weight * g_te / (labels.shape[1] * num_domains), grad, grad_tr, grad_te)
        train_losses.append(loss_tr)
        test_losses.append(loss_te / labels.shape[1])
    return grad, {"meta_train_loss": jnp.mean(jnp.stack(train_losses)),
                  "meta_test_loss": jnp.mean(jnp.stack(test_losses))}


def mdsdi(meta_test_weight: float, *, learning_rate: float, weight_decay: float,
          num_domains: int) -> Procedure:
    """mDSDI's step (the module docstring): ``Adam_main`` on the four losses, then
    ``Adam_meta`` on the meta gradient at the weights it left. The state is both
    optimizers' (``{"main", "meta"}``)."""
    del num_domains  # the passes carry it
    adam = torch_adam(learning_rate, weight_decay)

    def init(params):
        return {"main": adam.init(parameter_group(params, MAIN_GROUP)),
                "meta": adam.init(parameter_group(params, META_GROUP))}

    def update(params, state, passes, key):
        main_key, meta_key = jax.random.split(key)
        group = parameter_group(params, MAIN_GROUP)
        (loss, metrics), grads = jax.value_and_grad(main_loss, has_aux=True)(
            group, params, passes, main_key)
        steps, main_state = adam.update(grads, state["main"], group)
        stepped = with_group(params, optax.apply_updates(group, steps))
        meta_grad, meta_metrics = meta_gradient(
            stepped, passes, meta_key, meta_test_weight=meta_test_weight,
            learning_rate=learning_rate, weight_decay=weight_decay)
        theta = parameter_group(stepped, META_GROUP)
        steps, meta_state = adam.update(meta_grad, state["meta"], theta)
        new_params = with_group(stepped, optax.apply_updates(theta, steps))
        updates = jax.tree.map(jnp.subtract, new_params, params)
        return updates, {"main": main_state, "meta": meta_state}, {
            "loss": loss, **metrics, **meta_metrics}

    return Procedure(init, update, whole_batch=True)


register_update_rule(UpdateRule(
    Method("mdsdi", "mDSDI", (
        Hyperparameter("mdsdi_meta_test_weight", 1.0,
                       "weight of the meta-test gradient in mDSDI's meta step (the "
                       "reference's literal 1.0; the authors draw no random value, so a "
                       "sweep keeps it)", ">= 0"),
    ), "domain-invariant encoder (adversarial) + domain-specific copy (domain "
       "classifier, decorrelated), classifier on both; first-order meta step on the "
       "domain-specific part", "Bui et al. 2021 (hamanhbui/mDSDI)"),
    "procedure",
    lambda hp, **common: mdsdi(hp["mdsdi_meta_test_weight"], **common),
    network=MethodNetwork(init=init_mdsdi, predict=predict_mdsdi, init_from_network=True),
))
