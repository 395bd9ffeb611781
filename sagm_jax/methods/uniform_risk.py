"""URM (Krishnamachari et al., TMLR 2024, "Uniformly Distributed Feature Representations
for Fair and Robust Learning"): a discriminator pushes the features toward uniform noise.

This module owns the procedure ``algorithm=urm``, its discriminator and its prediction,
as DomainBed computes them (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``,
``class URM(ERM)``; the output activation in ``domainbed/networks.py``, ``ResNet`` and
``MNIST_CNN``'s ``self.activation``).

The featurizer's output activation. URM sets ``featurizer.activation`` to
``urm_generator_output`` (tanh, relu or sigmoid), applied to the featurizer's output:
the ResNet's AFTER its dropout (``activation(dropout(network(x)))``), the MNIST CNN's
after the pooled last GroupNorm. The network's own head here is ``pool -> dropout ->
classifier`` (``models.resnet.classifier_head``), so the prediction (:func:`predict_urm`,
``MethodNetwork.predict``) is ``classifier(act(features))`` with ``features`` the run's
network's (post-dropout) features: training, evaluation, SWAD and ``load_run`` all
predict through it. ``identity`` (which DomainBed's featurizer also accepts) has no range
for the noise: the reference raises at the first step; here the config refuses it.

The discriminator (``_init_discriminator``), under ``params["method"]["discriminator"]``::

    D(u) = output(lrelu(dense_{k+1}(... lrelu(dense_2(lrelu(dense1(u)))))))

``dense1``: Linear(d, 100), ``urm_discriminator_hidden_layers`` = k layers
``dense2..dense{k+1}``: Linear(100, 100), ``output``: Linear(100, 1), each at PyTorch's
Linear init, ``lrelu`` PyTorch's LeakyReLU (slope 0.01).

One step on the batch ``x`` (the domains' minibatches concatenated), ``z = act(f(x))``,
lambda = ``urm_adv_lambda``, ``BCE(l, t) = mean_i softplus(l_i) - l_i t_i`` (PyTorch's
``BCEWithLogitsLoss``)::

    loss = CE(classifier(z), y) + lambda * BCE(D(z), 1)          # reported "loss"
    network <- Adam(lr, weight_decay) step of grad_network loss  # featurizer + classifier
    n ~ U[a, b)^{N x d}       # (a, b) = (-1, 1) for tanh, (0, 1) for relu and sigmoid
    t_n ~ U[1 - s, 1],  t_z ~ U[0, s]     # s = urm_discriminator_label_smoothing
    d_loss = BCE(D(n), t_n) + lambda * BCE(D(sg(z)), t_z)   # z of the same pass, detached
    D <- opt_D step of grad_D d_loss

``opt_D`` is PyTorch's ``Adam(urm_discriminator_lr, weight_decay)`` or
``SGD(urm_discriminator_lr, momentum=0.9, weight_decay)`` (``urm_discriminator_optimizer``),
both with the run's weight decay, coupled. The generator loss's gradient also reaches
D in the reference; its ``discriminator_opt.zero_grad()`` drops it before D's step, so
D steps on ``d_loss`` alone. Both optimizers step every step; no network pass sits in a
conditional.

Computed here, with the same result:

* The reference draws hard labels (1, 0) at s = 0 and soft ones otherwise; the soft
  labels at s = 0 are exactly 1 and 0 (``(1 - (1 - s)) U + (1 - s)`` and ``s U``), so
  they are always drawn: no branch on s (a pack traces it).
* The draws come from the step's key (the train step's objective key): the pass's
  dropout from ``fold_in(key, 0)``, the noise ``U[0, 1)^{N x d}`` from ``fold_in(key, 1)``,
  the labels' ``U[0, 1)^N`` from ``fold_in(key, 2)`` (noise's) and ``fold_in(key, 3)``
  (features'); the reference takes them from torch's global generator in that order.
* DomainBed's hparams_registry also defines ``urm`` = 'adversarial' (its only choice),
  which the class never reads: no key here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.networks import MethodNetwork, Shapes, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import Procedure, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    choice,
    log_uniform,
    register_update_rule,
    uniform,
)
from sagm_jax.models.resnet import torch_linear_init

DISCRIMINATOR = "discriminator"
HIDDEN_WIDTH = 100  # the reference's Linear(d, 100) and Linear(100, 100)
LEAKY_SLOPE = 0.01  # torch.nn.LeakyReLU's default negative slope
SGD_MOMENTUM = 0.9  # the reference's SGD discriminator optimizer
# The output activations and the range [a, b) of the noise the discriminator calls real
# (``_generate_noise``). The reference's featurizer also takes "identity", for which
# ``_generate_noise`` raises: the config refuses it (bounds "one of tanh, relu, sigmoid").
ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid}
NOISE_RANGE = {"tanh": (-1.0, 1.0), "relu": (0.0, 1.0), "sigmoid": (0.0, 1.0)}
OPTIMIZERS = ("adam", "sgd")


# --- the discriminator and the prediction -------------------------------------------


def _linear_init(key, fan_in: int, fan_out: int) -> dict:
    kernel_key, bias_key = jax.random.split(key)
    draw = torch_linear_init(fan_in)
    return {"kernel": draw(kernel_key, (fan_in, fan_out)), "bias": draw(bias_key, (fan_out,))}


def discriminator_init(key, feature_dim: int, hidden_layers: int) -> dict:
    """The reference's ``_init_discriminator``: ``dense1`` Linear(d, 100), ``dense2`` ..
    ``dense{k+1}`` Linear(100, 100), ``output`` Linear(100, 1) at PyTorch's init; layer
    ``i`` (in that order, from 0) from ``fold_in(key, i)``."""
    names = [f"dense{i + 1}" for i in range(hidden_layers + 1)] + ["output"]
    widths = [feature_dim] + [HIDDEN_WIDTH] * (hidden_layers + 1) + [1]
    return {name: _linear_init(jax.random.fold_in(key, i), widths[i], widths[i + 1])
            for i, name in enumerate(names)}


def discriminate(layers: dict, u) -> jax.Array:
    """The discriminator's logit [N] of ``u`` [N, d]: LeakyReLU(0.01) after every layer
    but ``output``."""
    h = u.astype(jnp.float32)
    for i in range(len(layers) - 1):
        layer = layers[f"dense{i + 1}"]
        h = jax.nn.leaky_relu(h @ layer["kernel"] + layer["bias"], LEAKY_SLOPE)
    return (h @ layers["output"]["kernel"] + layers["output"]["bias"])[:, 0]


def init_urm(key, shapes: Shapes, hp: dict) -> dict:
    """``MethodNetwork.init``: the discriminator on the network's features."""
    layers = int(hp["urm_discriminator_hidden_layers"])
    return {"params": {DISCRIMINATOR: discriminator_init(key, shapes.feature_dim, layers)}}


def predict_urm(base, own, images, train, hp, *, classify):
    """``z = act(features)`` and ``classifier(z)``: the network's features through the
    output activation (after the head's dropout, as DomainBed's ResNet), then the
    network's own classifier."""
    del own, train
    features, _ = base(images)
    z = ACTIVATIONS[hp["urm_generator_output"]](features)
    return (z, classify(z)), None


# --- the update --------------------------------------------------------------------------


def bce_with_logits(logits, targets) -> jax.Array:
    """PyTorch's ``BCEWithLogitsLoss()`` (mean): ``mean(softplus(l) - l t)``."""
    return jnp.mean(jax.nn.softplus(logits) - logits * targets)


def discriminator_optimizer(name: str, learning_rate, weight_decay):
    """PyTorch's ``Adam(lr, weight_decay)`` or ``SGD(lr, momentum=0.9, weight_decay)``,
    both with coupled L2 (``g + wd * w``); SGD's momentum buffer starts at the first
    gradient (optax's trace from zero: ``0.9 * 0 + g``)."""
    if name == "adam":
        return torch_adam(learning_rate, weight_decay)
    if name == "sgd":
        return optax.chain(optax.add_decayed_weights(weight_decay),
                           optax.trace(decay=SGD_MOMENTUM, nesterov=False),
                           optax.scale_by_learning_rate(learning_rate))
    raise ValueError(f"urm_discriminator_optimizer={name!r}: expected one of "
                     f"{', '.join(OPTIMIZERS)}.")


def discriminator_targets(key, rows: int, smoothing):
    """``(t_n, t_z)``: the noise's labels ~ U[1 - s, 1] and the features' ~ U[0, s] (the
    reference's ``_generate_soft_labels``), exactly 1 and 0 at s = 0."""
    u_noise = jax.random.uniform(jax.random.fold_in(key, 2), (rows,), jnp.float32)
    u_feats = jax.random.uniform(jax.random.fold_in(key, 3), (rows,), jnp.float32)
    low = 1.0 - smoothing
    return (1.0 - low) * u_noise + low, smoothing * u_feats


def urm(hp: dict, *, learning_rate, weight_decay, num_domains: int) -> Procedure:
    """URM's step (the module docstring); the state is both optimizers'
    (``{"main", "discriminator"}``). Reports the generator's ``loss``."""
    del num_domains  # the passes carry the batch
    main_opt = torch_adam(learning_rate, weight_decay)
    disc_opt = discriminator_optimizer(hp["urm_discriminator_optimizer"],
                                       hp["urm_discriminator_lr"], weight_decay)
    weight, smoothing = hp["urm_adv_lambda"], hp["urm_discriminator_label_smoothing"]
    low, high = NOISE_RANGE[hp["urm_generator_output"]]

    def init(params):
        network, own = split_params(params)
        return {"main": main_opt.init(network), "discriminator": disc_opt.init(own)}

    def update(params, opt_state, passes, key):
        network, own = split_params(params)

        def outputs_at(network_params):
            out = passes.forward_at(join_params(network_params, own),
                                    jax.random.fold_in(key, 0))(passes.images)
            return out.features, out.logits

        def generator_loss(features, logits):
            ce = jnp.mean(per_example_cross_entropy(logits, passes.labels))
            fooled = discriminate(own[DISCRIMINATOR], features)
            return ce + weight * bce_with_logits(fooled, jnp.ones_like(fooled))

        (features, logits), pullback = jax.vjp(outputs_at, network)
        loss, output_grads = jax.value_and_grad(generator_loss, argnums=(0, 1))(
            features, logits)
        (net_grads,) = pullback(output_grads)
        net_updates, main_state = main_opt.update(net_grads, opt_state["main"], network)

        feats = jax.lax.stop_gradient(features).astype(jnp.float32)
        noise = (high - low) * jax.random.uniform(
            jax.random.fold_in(key, 1), feats.shape, jnp.float32) + low
        true_y, fake_y = discriminator_targets(key, feats.shape[0], smoothing)

        def d_loss_at(own_params):
            layers = own_params[DISCRIMINATOR]
            return (bce_with_logits(discriminate(layers, noise), true_y)
                    + weight * bce_with_logits(discriminate(layers, feats), fake_y))

        own_grads = jax.grad(d_loss_at)(own)
        own_updates, disc_state = disc_opt.update(own_grads, opt_state["discriminator"], own)
        updates = join_params(net_updates, own_updates)
        return updates, {"main": main_state, "discriminator": disc_state}, {"loss": loss}

    return Procedure(init, update, whole_batch=True)


# --- the registry's entry ------------------------------------------------------------------


def by_dataset(dataset: str, mnist_like: bool) -> dict:
    """DomainBed's ``urm_discriminator_lr`` on its SMALL_IMAGES (and RotatedDigits):
    1e-3, 10^U(-5.5, -3.5)."""
    del dataset
    return {"urm_discriminator_lr": (1e-3, log_uniform(-5.5, -3.5))} if mnist_like else {}


# DomainBed's hparams_registry.py, ``elif algorithm == 'URM'``, with its names; the
# discriminator's lr is its ResNet datasets' (MNIST-like: by_dataset).
URM_HYPERPARAMETERS = (
    Hyperparameter("urm_adv_lambda", 0.1, "URM: weight of the adversarial term in the "
                   "generator's loss and of the features' term in the discriminator's",
                   ">= 0", uniform(0, 0.2)),
    Hyperparameter("urm_discriminator_label_smoothing", 0.0, "URM: the discriminator's "
                   "labels ~ U[1 - s, 1] (noise) and U[0, s] (features); 0: hard labels",
                   "[0, 1]", uniform(0, 0)),
    Hyperparameter("urm_discriminator_optimizer", "adam", "URM: the discriminator's "
                   "optimizer (adam, or sgd with momentum 0.9; both with weight_decay)",
                   f"one of {', '.join(OPTIMIZERS)}", choice(("adam",))),
    Hyperparameter("urm_discriminator_hidden_layers", 1, "URM: the discriminator's "
                   "100-wide hidden layers after its first", "int >= 0", choice((1, 2, 3))),
    Hyperparameter("urm_generator_output", "tanh", "URM: the featurizer's output "
                   "activation, which sets the noise's range", f"one of {', '.join(ACTIVATIONS)}",
                   choice(("tanh", "relu")),
                   " (identity: the uniform noise URM matches has no range for unbounded "
                   "features; DomainBed's URM raises at its first step)"),
    Hyperparameter("urm_discriminator_lr", 5e-5, "URM: the discriminator's learning "
                   "rate (MNIST-like datasets: 1e-3)", "> 0", log_uniform(-6, -4.5)),
)

register_update_rule(UpdateRule(
    Method("urm", "URM", URM_HYPERPARAMETERS,
           "uniform risk: the featurizer's bounded output is pushed toward uniform noise "
           "by a discriminator MLP trained against it",
           "DomainBed (Krishnamachari et al. 2024)", by_dataset=by_dataset),
    "procedure",
    lambda hp, **common: urm(hp, **common),
    network=MethodNetwork(init=init_urm, predict=predict_urm, uses_classifier=True),
))
