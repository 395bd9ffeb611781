"""SagNet (Nam et al. 2021), the style-agnostic network, as DomainBed computes it.

This module owns SagNet's procedure (``algorithm=sagnet``): the style randomisation of
the features, its three passes and three Adams, its own module (the style classifier)
and its registry entry. The reference is ``facebookresearch/DomainBed``,
``domainbed/algorithms.py``, class ``SagNet`` (hyperparameter ``sag_w_adv`` in
``domainbed/hparams_registry.py``); ``Wang-pengfei/SAGM``'s copy
(``domainbed/algorithms/algorithms.py``) computes the same update (``docs/methods.md``).

Three parameter groups, each with its own ``Adam(lr, wd)`` (``procedures.torch_adam``,
the run's ``learning_rate`` and ``weight_decay``; three independent states):

* ``f``, the featurizer: every parameter of the run's network but its classifier;
* ``c``, the content classifier: the network's own ``params["classifier"]``, so the
  run's network predicts as DomainBed's ``SagNet.predict`` (``network_c(network_f(x))``)
  with no prediction of its own;
* ``s``, the style classifier: the procedure's module, ``params["method"]["style_classifier"]``,
  DomainBed's ``Classifier`` with ``nonlinear_classifier=False`` (a linear layer).

One step on the batch X, Y (the M domains' minibatches concatenated), with R_style and
R_content the randomisations of :func:`randomize`, each call with its own draws::

    loss_c   = CE(c(R_style(f(X))), Y)                  at (f, c)       -> Adam_f, Adam_c step
    loss_s   = CE(s(R_content(f'(X))), Y)               at s, f' fixed  -> Adam_s step
    loss_adv = w_adv * -mean_i mean_k log_softmax(s'(R_content(f(X))))_ik
                                                        at f', s' fixed -> Adam_f steps again

where f', c', s' are the weights after their step. Adam_f steps twice per update (its
count advances by 2, its moments see both gradients in turn, its coupled decay acts at
f and then at f'); Adam_c and Adam_s once.

Which gradients the reference's ``zero_grad`` calls discard, derived from its order
(``optimizer_f/c.zero_grad``; ``loss_c.backward``; ``f, c`` step; ``optimizer_s.zero_grad``;
``loss_s.backward``; ``s`` step; ``optimizer_f.zero_grad``; ``loss_adv.backward``; ``f``
step): ``loss_s.backward()`` also adds the style loss's gradient (through each row's
own mean and variance) to ``f.grad``, which still holds ``loss_c``'s; the
``optimizer_f.zero_grad()`` before the adversarial pass discards both, so the second
``f`` step uses ``loss_adv``'s gradient alone. ``loss_adv.backward()`` also adds to
``s.grad``; the next step's ``optimizer_s.zero_grad()`` discards it before ``s`` steps
again, as ``optimizer_c.zero_grad()`` discards nothing ``c`` ever uses. So here each
pass is differentiated with respect to its stepped group only: ``loss_c`` with respect
to (f, c), ``loss_s`` to s, ``loss_adv`` to f.

Dropout and the draws: pass p (0 content, 1 style, 2 adversarial) takes
``fold_in(key, p)`` split into its dropout key and its randomisation key (the step's
``key``, ``train_step``'s objective stream); each pass draws its own dropout as the
reference's three forwards do.

Reported: ``loss_c``, ``loss_s`` and ``loss_adv`` (weighted by ``w_adv``, as the
reference's ``.item()`` of the product), each at the weights its pass ran at;
``loss`` = ``loss_c``, the cross-entropy of the network that predicts (on restyled
features), the nearest to the cross-entropy the other methods report: the reference
reports no ``loss`` of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.networks import MethodNetwork, classify, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import BatchPasses, Procedure, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    log_uniform,
    register_update_rule,
)
from sagm_jax.models.resnet import torch_linear_init

# DomainBed's ``SagNet.randomize`` default: added to the variance before its square root.
RANDOMIZE_EPS = 1e-5
STYLE_CLASSIFIER = "style_classifier"  # the key of s under params["method"]
CLASSIFIER = "classifier"  # the network's own classifier, c
GROUPS = ("featurizer", "content", "style")  # the three Adams' parameter groups
CONTENT_PASS, STYLE_PASS, ADVERSARIAL_PASS = 0, 1, 2


class PassKeys(NamedTuple):
    """One pass's keys: its forward's dropout and its randomisation's draws."""

    dropout: jax.Array
    randomize: jax.Array


def pass_keys(key: jax.Array, which: int) -> PassKeys:
    """Pass ``which``'s keys: ``split(fold_in(key, which))`` into dropout, randomisation."""
    dropout, draws = jax.random.split(jax.random.fold_in(key, which))
    return PassKeys(dropout, draws)


def randomize(features: jax.Array, key: jax.Array, what: str) -> jax.Array:
    """DomainBed's ``SagNet.randomize`` on features [N, d]: per row i, mean mu_i and
    UNBIASED variance var_i (torch's ``var``, divisor d - 1) over its d features, and
    z_i = (x_i - mu_i) / sqrt(var_i + 1e-5). With ``alpha`` [N] ~ U(0, 1) and a random
    permutation ``pi`` of the rows, drawn from ``split(key)`` in that order:

    * ``what="style"`` (restyled content)::

          mu'_i = alpha_i mu_i + (1 - alpha_i) mu_pi(i)
          var'_i = alpha_i var_i + (1 - alpha_i) var_pi(i)
          out_i = z_i sqrt(var'_i + 1e-5) + mu'_i

      Nothing is detached: the gradient reaches x through z_i and both rows' statistics.
    * ``what="content"`` (another row's content in this row's style)::

          out_i = stop_gradient(z_pi(i)) sqrt(var_i + 1e-5) + mu_i

      the reference's ``x[idx_swap].detach()``: the gradient reaches x only through each
      row's own mu_i and var_i. ``alpha`` is drawn and unused, as in the reference.

    The reference reshapes a 4-D input [N, C, H, W] to statistics over H*W per channel;
    DomainBed (and here) applies it to the pooled 2-D features, so the statistics run
    over the feature dimension of each example (a quirk: ``docs/methods.md``).
    """
    if what not in ("style", "content"):
        raise ValueError(f"randomize: what={what!r}, expected 'style' or 'content'")
    rows = features.shape[0]
    alpha_key, perm_key = jax.random.split(key)
    alpha = jax.random.uniform(alpha_key, (rows, 1), features.dtype)
    perm = jax.random.permutation(perm_key, rows)
    mean = jnp.mean(features, axis=-1, keepdims=True)
    var = jnp.var(features, axis=-1, keepdims=True, ddof=1)
    normalized = (features - mean) / jnp.sqrt(var + RANDOMIZE_EPS)
    if what == "style":
        mean = alpha * mean + (1.0 - alpha) * mean[perm]
        var = alpha * var + (1.0 - alpha) * var[perm]
    else:
        normalized = jax.lax.stop_gradient(normalized[perm])
    return normalized * jnp.sqrt(var + RANDOMIZE_EPS) + mean


def parameter_groups(params: dict) -> dict:
    """``{"featurizer": f, "content": c, "style": s}`` of a train state's ``params``."""
    network, own = split_params(params)
    featurizer = {k: v for k, v in network.items() if k != CLASSIFIER}
    return {"featurizer": featurizer, "content": network[CLASSIFIER],
            "style": own[STYLE_CLASSIFIER]}


def joined_groups(groups: dict, params: dict) -> dict:
    """The inverse of :func:`parameter_groups`, the rest of ``params["method"]`` kept."""
    network = {**groups["featurizer"], CLASSIFIER: groups["content"]}
    return join_params(network, {**split_params(params)[1], STYLE_CLASSIFIER: groups["style"]})


def features_at(passes: BatchPasses, featurizer: dict, content: dict, dropout) -> jax.Array:
    """f(X) [N, d] in float32: a training pass of the run's network at ``featurizer``
    (``content`` completes the network; the features do not depend on it)."""
    forward = passes.forward_at({**featurizer, CLASSIFIER: content}, dropout)
    return forward(passes.images).features.astype(jnp.float32)


def linear(head: dict, features: jax.Array) -> jax.Array:
    """A linear classifier ``{"kernel", "bias"}`` on features, in float32."""
    return classify({CLASSIFIER: head}, features)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The mean cross-entropy over the rows (``F.cross_entropy``)."""
    return jnp.mean(per_example_cross_entropy(logits, labels))


def adversarial_loss(logits: jax.Array, w_adv: float) -> jax.Array:
    """``w_adv * -mean over rows of mean over classes of log_softmax(logits)``: the
    cross-entropy against the uniform label, DomainBed's ``loss_adv``."""
    return -w_adv * jnp.mean(jnp.mean(jax.nn.log_softmax(logits, axis=-1), axis=-1))


def _adam_step(adam, grads, state, params):
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def sagnet_step(groups: dict, opt_state: dict, passes: BatchPasses, key, adam,
                w_adv: float) -> tuple[dict, dict, dict]:
    """One SagNet update of the three groups (the module docstring's three passes):
    ``(new groups, new Adam states, metrics)``."""
    f, c, s = (groups[g] for g in GROUPS)
    state = dict(opt_state)
    labels = passes.labels

    keys = pass_keys(key, CONTENT_PASS)

    def content_loss(featurizer, content):
        restyled = randomize(features_at(passes, featurizer, content, keys.dropout),
                             keys.randomize, "style")
        return cross_entropy(linear(content, restyled), labels)

    loss_c, (grad_f, grad_c) = jax.value_and_grad(content_loss, argnums=(0, 1))(f, c)
    f, state["featurizer"] = _adam_step(adam, grad_f, state["featurizer"], f)
    c, state["content"] = _adam_step(adam, grad_c, state["content"], c)

    style_keys = pass_keys(key, STYLE_PASS)
    restyled_content = randomize(features_at(passes, f, c, style_keys.dropout),
                                 style_keys.randomize, "content")

    def style_loss(style):
        return cross_entropy(linear(style, restyled_content), labels)

    loss_s, grad_s = jax.value_and_grad(style_loss)(s)
    s, state["style"] = _adam_step(adam, grad_s, state["style"], s)

    adversarial_keys = pass_keys(key, ADVERSARIAL_PASS)

    def featurizer_adversarial_loss(featurizer):
        swapped = randomize(features_at(passes, featurizer, c, adversarial_keys.dropout),
                            adversarial_keys.randomize, "content")
        return adversarial_loss(linear(s, swapped), w_adv)

    loss_adv, grad_f = jax.value_and_grad(featurizer_adversarial_loss)(f)
    f, state["featurizer"] = _adam_step(adam, grad_f, state["featurizer"], f)
    metrics = {"loss": loss_c, "loss_c": loss_c, "loss_s": loss_s, "loss_adv": loss_adv}
    return {"featurizer": f, "content": c, "style": s}, state, metrics


def sagnet(w_adv: float, *, learning_rate: float, weight_decay: float,
           num_domains: int) -> Procedure:
    """SagNet's whole-batch procedure: the state is the three Adams' states
    ``{"featurizer", "content", "style"}``; ``update`` is :func:`sagnet_step`."""
    del num_domains  # the passes run on the whole batch, domains concatenated
    adam = torch_adam(learning_rate, weight_decay)

    def init(params):
        groups = parameter_groups(params)
        return {g: adam.init(groups[g]) for g in GROUPS}

    def update(params, opt_state, passes: BatchPasses, key):
        groups, opt_state, metrics = sagnet_step(
            parameter_groups(params), opt_state, passes, key, adam, w_adv)
        new = joined_groups(groups, params)
        return jax.tree.map(lambda n, o: n - o, new, params), opt_state, metrics

    return Procedure(init, update, whole_batch=True)


def init_style_classifier(key, shapes, hp) -> dict[str, Any]:
    """s at PyTorch's ``nn.Linear(d, C)`` init, as the run's own classifier is initialised
    (``models.resnet.classifier_head``, ``models.mnist_cnn``): kernel [d, C] and bias
    ~ U(-1/sqrt(d), 1/sqrt(d)), from ``split(key)`` in that order."""
    del hp
    kernel_key, bias_key = jax.random.split(key)
    init = torch_linear_init(shapes.feature_dim)
    return {"params": {STYLE_CLASSIFIER: {
        "kernel": init(kernel_key, (shapes.feature_dim, shapes.num_classes)),
        "bias": init(bias_key, (shapes.num_classes,)),
    }}}


register_update_rule(UpdateRule(
    Method("sagnet", "SagNet", (
        Hyperparameter("sag_w_adv", 0.1, "weight of SagNet's adversarial style loss",
                       ">= 0", log_uniform(-2, 1)),
    ), "content classifier on style-mixed features, style classifier on content-swapped "
       "features, featurizer adversarial to the style classifier; three Adams",
        "DomainBed (Nam et al. 2021)",
        (86.3, 77.8, 68.1, 48.6, 40.3, 64.2, "DomainBed")),
    "procedure", lambda hp, **common: sagnet(hp["sag_w_adv"], **common),
    network=MethodNetwork(init=init_style_classifier),
))
