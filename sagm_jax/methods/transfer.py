"""Transfer: the loss gap of an adversarial head kept near the classifier (Zhang et al. 2021).

This module owns DomainBed's ``Transfer`` (``facebookresearch/DomainBed``,
``domainbed/algorithms.py``, ``Transfer.update`` and ``loss_gap``; ``proj`` and
``distance`` from ``domainbed/lib/misc.py``) as a whole-batch procedure
(``sagm_jax.methods.procedures.Procedure`` with ``whole_batch=True``):
``algorithm=transfer``. Its own module is the adversarial head ``h'``, a linear
classifier like the network's, under ``params["method"]``::

    {"adversarial_classifier": {"kernel": [d, C], "bias": [C]}}

equal to the network's classifier at step 0 (the reference's ``load_state_dict``).

With ``f`` the featurizer (every network parameter but ``classifier``), ``h`` the
classifier, ``L_m(f, g)`` the cross-entropy of domain m's minibatch through head ``g``
on ``f``'s features, and the loss gap ``gap(f, g) = max_m L_m(f, g) - min_m L_m(f, g)``
(the first domain wins a tie, as the reference's strict ``>``/``<`` loop), one step is
(``gda = False``, DomainBed's default)::

    loss = CE(h(f(x)), y) over the whole batch                 (reported "loss")
    (f, h) <- Adam step on grad loss
    f      <- Adam step on grad_f  t_lambda * gap(f, h')       (h gets no gradient)
    h'     <- h
    repeat d_steps_per_g times:
        G  = t_lambda * gap(f, h')                             (reported "gap": the last)
        h' <- h' + lr_d * grad_h' G                            (SGD ascent)
        h' <- h + min(1, delta / ||h' - h||) (h' - h)          (misc.proj: the ball B(h, delta))

``Adam`` is PyTorch's ``Adam(lr, weight_decay)`` (betas (0.9, 0.999), coupled L2). Its
second step has no gradient for the classifier: PyTorch (>= 2.0, ``zero_grad`` sets
``None``) skips it, so the featurizer's Adam moments and step count advance twice a
step and the classifier's once: two Adam states here, ``"featurizer"`` and
``"classifier"``. The head's SGD has no weight decay and no state. Every pass draws its
own dropout: the whole-batch pass, one pass per domain for the gap step and one per
domain for each inner step (the featurizer does not move in the inner loop, so without
dropout those passes are equal and XLA merges them: the compiled step of the tests' tiny
featurizer holds as many featurizer passes for 6 inner steps as for 1).

Quirks of the reference, reproduced by default:

* ``gda = True`` builds the main optimizer as ``SGD(adv_classifier.parameters(), lr)``:
  the featurizer and classifier are in no optimizer and never train; that SGD's step on
  the head is overwritten by ``h' <- h``. A run predicts with the network at its
  initialisation. DomainBed's default is False, but its random search draws True for
  every setting (``lambda r: True``).
* ``beta1`` and ``weight_decay_d`` are registered and drawn but never read.

``transfer_fix_optimizers = True`` makes all three do what they name: ``gda``'s SGD
steps the featurizer and classifier (``lr``, the same two steps as Adam's), the Adam
takes ``betas = (beta1, 0.999)`` and the head's SGD ``weight_decay_d`` (coupled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.networks import MethodNetwork, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import BatchPasses, Procedure, torch_adam
from sagm_jax.methods.registry import (
    Distribution,
    Hyperparameter,
    Method,
    UpdateRule,
    choice,
    log_uniform,
    register_update_rule,
    uniform,
)

ADVERSARIAL = "adversarial_classifier"
CLASSIFIER = "classifier"
# The second moment's decay of the fixed optimizers' Adam (PyTorch's default).
ADAM_BETA2 = 0.999


def init_adversarial_head(key, shapes, hp, *, network) -> dict:
    """``h'`` at step 0: a copy of the run's classifier at its step-0 variables."""
    del key, shapes, hp
    _, variables = network
    return {"params": {ADVERSARIAL: jax.tree.map(jnp.array, variables["params"][CLASSIFIER])}}


def head_logits(head: dict, features) -> jax.Array:
    return features.astype(jnp.float32) @ head["kernel"] + head["bias"]


def domain_losses(head: dict, features: list, labels: list) -> jax.Array:
    """[M] ``L_m``: the mean cross-entropy of domain m's rows through ``head``."""
    return jnp.stack([jnp.mean(per_example_cross_entropy(head_logits(head, z), y))
                      for z, y in zip(features, labels)])


def gap_weights(losses) -> jax.Array:
    """``d gap / d L``: +1 at the first largest loss, -1 at the first smallest (both
    0 when they are the same domain), so ``gap = weights . L``."""
    count = losses.shape[0]
    return (jax.nn.one_hot(jnp.argmax(losses), count)
            - jax.nn.one_hot(jnp.argmin(losses), count))


def project(delta, adversarial: dict, classifier: dict) -> dict:
    """``misc.proj``: ``h'`` unchanged when ``||h' - h|| <= delta`` (the Frobenius norm
    over all the head's tensors), else ``h + (delta / ||h' - h||) (h' - h)``."""
    sq = sum(jnp.sum((a - c) ** 2) for a, c in zip(jax.tree.leaves(adversarial),
                                                    jax.tree.leaves(classifier)))
    dist = jnp.sqrt(sq)
    ratio = jnp.where(dist <= delta, 1.0, delta / jnp.where(dist > 0, dist, 1.0))
    return jax.tree.map(lambda a, c: jnp.where(dist <= delta, a, c + ratio * (a - c)),
                        adversarial, classifier)


def split_domains(array, num_domains: int) -> list:
    return list(array.reshape(num_domains, -1, *array.shape[1:]))


def ascend_head(adversarial: dict, classifier: dict, features: list, labels: list,
                hp: dict, fix: bool):
    """The ``d_steps_per_g`` inner steps on ``h'`` (``features[k]`` the k-th step's
    per-domain features, constants here): returns ``h'`` and the last step's
    ``t_lambda * gap`` (measured before its SGD step, the reference's report)."""
    t_lambda, lr_d = hp["transfer_t_lambda"], hp["transfer_lr_d"]
    # SGD on -G: w - lr_d (-grad G + wd w), the decay coupled (with the fix only)
    decay = hp["transfer_weight_decay_d"] if fix else 0.0

    def gap_of(head, step_features):
        losses = domain_losses(head, step_features, labels)
        return t_lambda * jnp.dot(jax.lax.stop_gradient(gap_weights(losses)), losses)

    gap = jnp.zeros([], jnp.float32)
    for step_features in features:
        gap, grads = jax.value_and_grad(gap_of)(adversarial, step_features)
        adversarial = jax.tree.map(lambda w, g: w - lr_d * (-g + decay * w), adversarial,
                                   grads)
        adversarial = project(hp["transfer_delta"], adversarial, classifier)
    return adversarial, gap


def parameter_groups(network: dict) -> tuple[dict, dict]:
    """``(featurizer, classifier)``: every network module but ``classifier``, and it."""
    return ({k: v for k, v in network.items() if k != CLASSIFIER}, network[CLASSIFIER])


def optimizer_step(adam, learning_rate, weights, grads, state):
    """One step of the main optimizer on one group: ``adam`` (its ``state``), or
    ``torch.optim.SGD(lr)`` (no momentum, no decay, no state) when ``adam`` is None."""
    if adam is None:
        return jax.tree.map(lambda w, g: w - learning_rate * g, weights, grads), state
    step, state = adam.update(grads, state, weights)
    return optax.apply_updates(weights, step), state


def network_steps(network, state, grads, featurizer_gap_grad, *, adam, learning_rate):
    """The main optimizer's two steps: on ``grad loss`` (featurizer and classifier), then
    on ``featurizer_gap_grad(featurizer, classifier)``, the featurizer's gradient of
    ``t_lambda * gap(f, h')`` (the classifier, without a gradient, does not step)."""
    featurizer, classifier = parameter_groups(network)
    grad_f, grad_c = parameter_groups(grads)
    f_state, c_state = (None, None) if adam is None else (state["featurizer"],
                                                           state["classifier"])
    featurizer, f_state = optimizer_step(adam, learning_rate, featurizer, grad_f, f_state)
    classifier, c_state = optimizer_step(adam, learning_rate, classifier, grad_c, c_state)
    featurizer, f_state = optimizer_step(adam, learning_rate, featurizer,
                                         featurizer_gap_grad(featurizer, classifier), f_state)
    if adam is not None:
        state = {"featurizer": f_state, "classifier": c_state}
    return {**featurizer, CLASSIFIER: classifier}, state


def transfer(hp: dict, *, learning_rate, weight_decay, num_domains: int) -> Procedure:
    """DomainBed's ``Transfer.update`` (the module docstring); ``hp`` holds the entry's
    hyperparameters. Reports ``loss`` (the whole-batch cross-entropy before the step)
    and ``gap`` (``t_lambda`` times the last inner step's loss gap). The state is the
    featurizer's and the classifier's Adam (``gda = False``) or none (SGD)."""
    gda, fix = bool(hp["transfer_gda"]), bool(hp["transfer_fix_optimizers"])
    d_steps, t_lambda = int(hp["transfer_d_steps_per_g"]), hp["transfer_t_lambda"]
    betas = (hp["transfer_beta1"], ADAM_BETA2) if fix else None
    adam = None if gda else torch_adam(learning_rate, weight_decay, betas)

    def init(params):
        if adam is None:
            return {}
        featurizer, classifier = parameter_groups(split_params(params)[0])
        return {"featurizer": adam.init(featurizer), "classifier": adam.init(classifier)}

    def update(params, state, passes: BatchPasses, key):
        network, own = split_params(params)
        images = split_domains(passes.images, num_domains)
        labels = split_domains(passes.labels, num_domains)
        pass_keys = iter(range(1 + num_domains * (1 + d_steps)))

        def features_at(net):
            return [passes.forward_at(net, jax.random.fold_in(key, next(pass_keys)))(x).features
                    for x in images]

        def whole_loss(net):
            logits = passes.forward_at(net, jax.random.fold_in(key, next(pass_keys)))(
                passes.images).logits
            return jnp.mean(per_example_cross_entropy(logits, passes.labels))

        def featurizer_gap_grad(featurizer, classifier):
            def gap_of(feat):
                losses = domain_losses(own[ADVERSARIAL], features_at(
                    {**feat, CLASSIFIER: classifier}), labels)
                return t_lambda * jnp.dot(jax.lax.stop_gradient(gap_weights(losses)), losses)

            return jax.grad(gap_of)(featurizer)

        loss, grads = jax.value_and_grad(whole_loss)(network)
        if gda and not fix:  # DomainBed's: the network is in no optimizer
            next_network = network
            for _ in range(num_domains):
                next(pass_keys)  # the gap step's passes: their step is overwritten
        else:
            next_network, state = network_steps(network, state, grads, featurizer_gap_grad,
                                                adam=adam, learning_rate=learning_rate)
        classifier = next_network[CLASSIFIER]
        inner = [jax.tree.map(jax.lax.stop_gradient, features_at(next_network))
                 for _ in range(d_steps)]
        adversarial, gap = ascend_head(classifier, classifier, inner, labels, hp, fix)
        new_params = join_params(next_network, {**own, ADVERSARIAL: adversarial})
        updates = jax.tree.map(jnp.subtract, new_params, params)
        return updates, state, {"loss": loss, "gap": gap}

    return Procedure(init, update, whole_batch=True)


# --- the registry's entry ------------------------------------------------------------


def _always(value: bool) -> Distribution:
    """DomainBed's ``lambda r: value``."""
    return Distribution(str(value), lambda rng: value)


# DomainBed's ``hparams_registry.py`` (``Transfer``), the same default and draw on every
# dataset; our keys are prefixed (DANN owns lr_d, weight_decay_d and beta1 with other
# meanings or defaults) and map to DomainBed's names in sagm_jax.sweep.hparams.
TRANSFER_HYPERPARAMETERS = (
    Hyperparameter("transfer_t_lambda", 1.0, "Transfer: weight of the loss gap (DomainBed's "
                   "t_lambda)", ">= 0", log_uniform(-2, 1)),
    Hyperparameter("transfer_delta", 2.0, "Transfer: radius of the ball around the "
                   "classifier the adversarial head is projected to (delta)", ">= 0",
                   uniform(0.1, 3.0)),
    Hyperparameter("transfer_d_steps_per_g", 10, "Transfer: the adversarial head's SGD "
                   "steps per step (d_steps_per_g)", "int >= 1", choice((1, 2, 5))),
    Hyperparameter("transfer_weight_decay_d", 0.0, "Transfer: drawn, unread by DomainBed "
                   "(weight_decay_d); the head's SGD decay with transfer_fix_optimizers",
                   ">= 0", log_uniform(-6, -2)),
    Hyperparameter("transfer_gda", False, "Transfer: SGD in place of Adam (gda; DomainBed's "
                   "SGD steps the adversarial head only, so the network never trains)",
                   "bool", _always(True)),
    Hyperparameter("transfer_beta1", 0.5, "Transfer: drawn, unread by DomainBed (beta1); "
                   "the Adam's beta1 with transfer_fix_optimizers", "[0, 1)",
                   choice((0.0, 0.5))),
    Hyperparameter("transfer_lr_d", 1e-3, "Transfer: the adversarial head's SGD learning "
                   "rate (lr_d)", "> 0", log_uniform(-4.5, -2.5)),
    Hyperparameter("transfer_fix_optimizers", False, "Transfer: gda's SGD steps the network, "
                   "Adam takes beta1, the head's SGD weight_decay_d (DomainBed's: False)",
                   "bool"),
)

register_update_rule(UpdateRule(
    Method("transfer", "Transfer", TRANSFER_HYPERPARAMETERS,
           "ERM plus the gap between the domains' largest and smallest loss under an "
           "adversarial head kept within delta of the classifier",
           "DomainBed (Zhang et al. 2021)"),
    "procedure",
    lambda hp, **common: transfer(hp, **common),
    network=MethodNetwork(init=init_adversarial_head, init_from_network=True),
))
