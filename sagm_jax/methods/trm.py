"""TRM (Xu & Jaakkola 2021): representations that support robust transfer of predictors.

This module owns the procedure ``algorithm=trm``, DomainBed's ``TRM``
(``facebookresearch/DomainBed``, ``domainbed/algorithms.py``, class ``TRM``), and its
heads. The run's network is the featurizer ``phi`` and the classifier ``c`` (a linear
layer, as the reference's ``nn.Linear``); the prediction is the network's, ``c(phi(x))``.

Modules. ``D + 1`` linear heads ``h_0..h_D`` (the reference's ``clist``, ``D`` the
training domains), at PyTorch's ``nn.Linear`` init, stacked under
``params["method"]["heads"]`` (``kernel`` [D+1, F, C], ``bias`` [D+1, C]). Each has its own
``SGD(lr=0.1)`` (``olist``: no momentum, no decay, so no state). Head ``h_D`` is never
in a loss: it stays at init, as in the reference.

One step ``t`` (``t`` updates before it, the reference's ``update_count``), on the
minibatches ``B_1..B_D`` of ``n`` rows each, ``z = phi(x)`` from one pass::

    nll = CE(c(z), y)                                         # the pooled batch
    if t < iters:  L = nll                                    # ERM
    else:                                                     # TRM
        h_q.W <- c.W for every q  (only with class_balanced; the bias stays)
        alpha <- alpha / alpha.sum(1)                         # row-normalised
        30 times:  h_j <- h_j - 0.1 grad CE(h_j(sg z_j), y_j)  for j < D   (sg: detached)
        for q < D:
            g_q(z_q)  = d CE(h_q(z_q), y_q) / d h_q.W        # a function of z_q
            P_q(z)    = sum_{i != q} alpha_qi CE(h_q(z_i), y_i)
            v_q       = neumann(sg d P_q / d h_q.W)           # ~ H_q^{-1} (that), detached
            S_q       = P_q - cos_lambda <v_q, g_q>
            alpha_qi <- alpha_qi exp(eta alpha_qi CE(h_q(z_i), y_i))   for i != q
        L = nll + mean_q S_q
    (phi, c) <- Adam(lr, wd) step of grad L;  report nll and trm_loss = L - nll

``H_q`` is the Hessian of ``CE(h_q(sg z_q), y_q)`` in ``h_q.W`` (bias fixed); each
product ``H v`` is ``jax.jvp`` of ``jax.grad`` (:func:`hessian_vector_product`).
:func:`neumann` is the reference's ``neum``: ``v_0`` the vector, ``v_{k+1} = v_k - H v_k``,
up to 10 terms, stopping after the first partial sum whose largest entry exceeds 10.
``alpha`` starts at ``1 - I`` and lives in the procedure's state; ``L``'s derivative
reaches ``phi`` through ``P_q`` and ``g_q`` (second order) and ``c`` through ``nll``.

Quirks of the reference, reproduced by default (docs/methods.md, "TRM"):

* ``neum`` sums ``2 v_1 + v_2 + ... + v_m`` instead of ``v_0 + v_1 + ... + v_m``: its
  running sum starts as the same tensor as ``v``, and ``v -= hv`` changes both in place.
  ``trm_fix_neumann=True`` sums the series from ``v_0``.
* The GroupDRO-like update multiplies by ``exp(eta * alpha_qi * CE)``: the loss already
  weighted by ``alpha_qi``, not the domain's loss.
* The heads train only from step ``iters`` on; before it they stay at init.
* ``alpha`` is a plain attribute, not a buffer: DomainBed's checkpoints lose it (here it
  is in the state, so a resume is exact).

Computed with the same result: the reference's ``optimizer_f`` and ``optimizer_c`` are
two ``Adam(lr, wd)`` that step together every update; Adam is per parameter, so one
``Adam(lr, wd)`` over the network is the same. The reference hard-codes ``.cuda()`` for
the heads and ``alpha``; here they live wherever the run computes. The network's pass
and its backward stay outside ``lax.cond`` (only the heads' arithmetic is inside;
docs/performance.md), and the 30 head steps and the Neumann terms are loops over linear
heads only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.mdsdi import init_linear
from sagm_jax.methods.networks import MethodNetwork, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import BatchPasses, Procedure, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    log_uniform,
    register_update_rule,
)

HEADS = "heads"  # the stacked heads, in params["method"]
HEAD_LR = 0.1  # each head's SGD (the reference's olist)
HEAD_STEPS = 30  # SGD steps of the heads per TRM update
NEUMANN_TERMS = 10  # the reference's neum: iter = 10
NEUMANN_LIMIT = 10.0  # ... stopping once max |partial sum| > 10


def init_heads(key, shapes, hp) -> dict:
    """``D + 1`` ``nn.Linear(F, C)`` heads at PyTorch's init, stacked."""
    del hp
    heads = [init_linear(k, shapes.feature_dim, shapes.num_classes)
             for k in jax.random.split(key, shapes.num_domains + 1)]
    return {"params": {HEADS: jax.tree.map(lambda *a: jnp.stack(a), *heads)}}


def head_loss(kernel, bias, features, labels) -> jax.Array:
    """``CE(features @ kernel + bias, labels)``, the mean over rows."""
    return jnp.mean(per_example_cross_entropy(features @ kernel + bias, labels))


def hessian_vector_product(kernel, bias, features, labels):
    """``v -> H v``, ``H`` the Hessian of :func:`head_loss` in ``kernel``: the
    directional derivative of its gradient, ``jax.jvp`` of ``jax.grad`` linearised once
    (``jax.linearize``) so that the Neumann terms reuse it."""
    grad = jax.grad(head_loss)
    return jax.linearize(lambda k: grad(k, bias, features, labels), kernel)[1]


def neumann(vector, kernel, bias, features, labels, fix=False) -> jax.Array:
    """The reference's ``neum``: with ``v_0 = vector`` and ``v_{k+1} = v_k - H v_k``
    (:func:`hessian_vector_product`), the partial sums ``s_1 = 2 v_1`` (reference) or
    ``v_0 + v_1`` (``fix``), ``s_{k+1} = s_k + v_{k+1}``, up to ``s_10``; it returns the
    first ``s_k`` with ``max |s_k| > 10``, else ``s_10``. Detached, as the reference's."""
    vector = jax.lax.stop_gradient(vector)
    features = jax.lax.stop_gradient(features)

    product = hessian_vector_product(kernel, bias, features, labels)
    v = vector - product(vector)
    total = v + jnp.where(fix, vector, v)
    done = jnp.max(jnp.abs(total)) > NEUMANN_LIMIT
    for _ in range(1, NEUMANN_TERMS):  # unrolled: ten small linear maps
        v = v - product(v)
        total = jnp.where(done, total, total + v)
        done = done | (jnp.max(jnp.abs(total)) > NEUMANN_LIMIT)
    return jax.lax.stop_gradient(total)


def fit_heads(heads: dict, features, labels) -> dict:
    """30 SGD(0.1) steps of each domain's head ``h_j`` on its own minibatch's detached
    features ``features[j]`` [n, F] (``labels[j]``); the last head stays."""
    count = features.shape[0]
    features = jax.lax.stop_gradient(features)
    grad = jax.vmap(jax.grad(head_loss, argnums=(0, 1)))

    def step(_, own):
        kernel, bias = own["kernel"][:count], own["bias"][:count]
        g_kernel, g_bias = grad(kernel, bias, features, labels)
        return {"kernel": own["kernel"].at[:count].add(-HEAD_LR * g_kernel),
                "bias": own["bias"].at[:count].add(-HEAD_LR * g_bias)}

    return jax.lax.fori_loop(0, HEAD_STEPS, step, heads)


def inverse_hessian_vectors(features, labels, heads: dict, alpha, fix_neumann) -> jax.Array:
    """``v_q = neumann(d P_q / d h_q.W)`` for every q [D, F, C], at the detached
    features [D, n, F]: constants of the step's derivative, as the reference's."""
    count = features.shape[0]
    features = jax.lax.stop_gradient(features)
    all_losses = jax.vmap(head_loss, in_axes=(None, None, 0, 0))

    def vector(kernel, bias, alpha_row, q):
        others = alpha_row * (jnp.arange(count) != q)
        grad_p = jax.grad(lambda k: jnp.sum(others * all_losses(k, bias, features, labels)))(
            kernel)
        return neumann(grad_p, kernel, bias, features[q], labels[q], fix_neumann)

    return jax.vmap(vector)(heads["kernel"][:count], heads["bias"][:count], alpha,
                            jnp.arange(count))


def transfer_risk(features, labels, heads: dict, alpha, vectors, cos_lambda):
    """``(mean_q S_q, [alpha_qi CE(h_q(z_i), y_i)]_qi)`` of the module docstring, from the
    domains' features [D, n, F] (differentiable), labels [D, n], the fitted heads, the
    row-normalised ``alpha`` [D, D] and :func:`inverse_hessian_vectors`; one
    ``jax.vmap`` over q."""
    count = features.shape[0]
    all_losses = jax.vmap(head_loss, in_axes=(None, None, 0, 0))

    def risk(kernel, bias, alpha_row, vector, q):
        weighted = alpha_row * (jnp.arange(count) != q) * all_losses(kernel, bias, features,
                                                                      labels)
        grad_q = jax.grad(head_loss)(kernel, bias, features[q], labels[q])
        return jnp.sum(weighted) - cos_lambda * jnp.sum(vector * grad_q), weighted

    risks, weighted = jax.vmap(risk)(heads["kernel"][:count], heads["bias"][:count],
                                     jax.lax.stop_gradient(alpha), vectors, jnp.arange(count))
    return jnp.sum(risks) / count, weighted


def trm_gradients(features, logits, labels, heads, alpha, classifier_kernel, hp, trm_on):
    """The head-side part of a step, from the pass's ``features`` [N, F] and ``logits``:
    ``(dL/dfeatures, dL/dlogits, heads', alpha', nll, trm_loss)``, the ERM or the TRM
    branch by ``trm_on`` (a ``lax.cond`` over the heads' arithmetic only)."""
    count = alpha.shape[0]
    domain_labels = labels.reshape(count, -1)

    def nll_of(logits):
        return jnp.mean(per_example_cross_entropy(logits, labels))

    def erm(operands):
        features, logits, heads, alpha = operands
        nll, d_logits = jax.value_and_grad(nll_of)(logits)
        return jnp.zeros_like(features), d_logits, heads, alpha, nll, jnp.zeros_like(nll)

    def trm(operands):
        features, logits, heads, alpha = operands
        copied = jnp.broadcast_to(classifier_kernel, heads["kernel"].shape)
        heads = {**heads, "kernel": jnp.where(hp["trm_class_balanced"], copied,
                                              heads["kernel"])}
        alpha = alpha / jnp.sum(alpha, axis=1, keepdims=True)
        domain_features = features.reshape(count, -1, features.shape[-1])
        heads = fit_heads(heads, domain_features, domain_labels)

        vectors = inverse_hessian_vectors(domain_features, domain_labels, heads, alpha,
                                          hp["trm_fix_neumann"])

        def objective(features, logits):
            nll = nll_of(logits)
            swap, weighted = transfer_risk(
                features.reshape(count, -1, features.shape[-1]), domain_labels, heads, alpha,
                vectors, hp["trm_cos_lambda"])
            return nll + swap, (nll, weighted)

        (total, (nll, weighted)), (d_features, d_logits) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True)(features, logits)
        alpha = alpha * jnp.exp(hp["groupdro_eta"] * jax.lax.stop_gradient(weighted))
        return d_features, d_logits, heads, alpha, nll, total - nll

    return jax.lax.cond(trm_on, trm, erm, (features, logits, heads, alpha))


def trm(hp: dict, *, learning_rate: float, weight_decay: float, num_domains: int) -> Procedure:
    """TRM's step (the module docstring). The state: the network's ``Adam(lr, wd)`` and
    ``alpha`` [D, D]; the heads are in ``params["method"]``, the step count is the train
    state's. Reports ``nll``, ``trm_loss`` (0 before ``iters``, as the reference's
    ``loss_swap.item() - nll``) and ``loss`` = their sum, the loss differentiated."""
    adam = torch_adam(learning_rate, weight_decay)

    def init(params):
        network, _ = split_params(params)
        alpha = jnp.ones((num_domains, num_domains), jnp.float32) - jnp.eye(num_domains)
        return {"adam": adam.init(network), "alpha": alpha}

    def update(params, state, passes: BatchPasses, key):
        network, own = split_params(params)

        def outputs_at(network_params):
            outputs = passes.forward_at(network_params, key)(passes.images)
            return outputs.features.astype(jnp.float32), outputs.logits.astype(jnp.float32)

        (features, logits), pullback = jax.vjp(outputs_at, network)
        d_features, d_logits, heads, alpha, nll, trm_loss = trm_gradients(
            features, logits, passes.labels, own[HEADS], state["alpha"],
            network["classifier"]["kernel"], hp, passes.step >= hp["trm_iters"])
        (grads,) = pullback((d_features, d_logits))
        net_updates, adam_state = adam.update(grads, state["adam"], network)
        head_updates = jax.tree.map(jnp.subtract, heads, own[HEADS])
        updates = join_params(net_updates, {**own, HEADS: head_updates})
        return updates, {"adam": adam_state, "alpha": alpha}, {
            "loss": nll + trm_loss, "nll": nll, "trm_loss": trm_loss}

    return Procedure(init, update, whole_batch=True)


# DomainBed's hparams_registry.py, TRM: cos_lambda 1e-4 (10^U(-5,0)), iters 200
# (int(10^U(0,4))), groupdro_eta 1e-2 (10^U(-3,-1), GroupDRO's key and draw); its global
# class_balanced is False in every draw.
register_update_rule(UpdateRule(
    Method("trm", "TRM", (
        Hyperparameter("trm_cos_lambda", 1e-4, "TRM: weight of the gradient-alignment "
                       "term <H^-1 grad P, grad CE_q> (DomainBed's cos_lambda)", ">= 0",
                       log_uniform(-5, 0)),
        Hyperparameter("trm_iters", 200, "TRM: ERM steps before the transfer-risk term "
                       "and the heads' training start (DomainBed's iters)", "int >= 0",
                       log_uniform(0, 4, integer=True)),
        Hyperparameter("groupdro_eta", 1e-2, "step size of the domain weights q", "> 0",
                       log_uniform(-3, -1)),
        Hyperparameter("trm_class_balanced", False, "TRM: copy the classifier's weight "
                       "into every head before each TRM step (DomainBed's class_balanced, "
                       "False in its search)", "bool"),
        Hyperparameter("trm_fix_neumann", False, "TRM: sum the Neumann series from v_0 "
                       "(the reference's in-place aliasing sums 2 v_1 + v_2 + ...)", "bool"),
    ), "ERM, then per-domain heads fitted by SGD and a transfer risk: other domains' "
       "losses under each domain's head, aligned by a Neumann-series Hessian inverse",
        "DomainBed (Xu & Jaakkola 2021)"),
    "procedure",
    lambda hp, **common: trm(hp, **common),
    network=MethodNetwork(init=init_heads),
))
