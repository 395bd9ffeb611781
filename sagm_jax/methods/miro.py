"""MIRO: mutual-information regularisation with a frozen copy of the pre-trained network.

This module owns the objective ``miro`` (Cha et al., ECCV 2022), as ``khanrc/miro``
states it (``domainbed/algorithms/miro.py``: ``MIRO``, ``MeanEncoder``,
``VarianceEncoder``, ``get_shapes``; ``domainbed/networks/ur_networks.py``: which
intermediate features; ``config.yaml``: its defaults): its loss, its modules (the
variance encoders and the frozen oracle) and its registry entry.

For the intermediate features f_l of the network being trained and pre_l of the oracle
(the network as it is at step 0: the ImageNet weights, or the run's initialisation when
it trains from scratch) on the same images, l over the layers of ``miro_feat_layers``:

    var_l   = softplus(b_l) + 1e-5                   per channel, b_l trainable
    R       = sum_l mean((mu_l(f_l) - pre_l)^2 / var_l + log var_l) / 2
    L       = CE(f(X), Y) + ld * R

``mu_l`` is the identity (the reference's ``MeanEncoder`` has no parameters); the mean is
over every element of the [N, H, W, C] tensor. The oracle's pass is in evaluation mode
(BatchNorm's running statistics; its dropout acts on the pooled output only, which MIRO
does not read) and carries no gradient (the reference freezes it). The reported values
are the reference's: ``loss`` = L and ``reg_loss`` = R.

Where things live:

* the variance encoders' ``b_l`` [C_l] under ``params["method"]["variance"][layer]``,
  trained by the run's Adam at ``lr * miro_lr_mult`` (``MethodNetwork.
  learning_rate_multiplier``; exact, see ``update_rules.rule_optimizer``), with the same
  weight decay as the network (the reference's param groups share it);
* the oracle, ``{"params", "batch_stats"}`` of the network at step 0, under
  ``batch_stats["method"]["oracle"]``: a collection the optimizer never sees, so it
  costs no Adam moments, no SWAD average and no perturbation, and stays bit-identical
  (the train step passes the forward's ``batch_stats`` through, Flax keeps entries no
  layer reads, checkpoints and ``load_run`` carry the whole collection).

The layers (``sagm_jax.models.resnet.INTERMEDIATES``): ``stem_block`` (the reference's
default) is the stem (after the max-pool) and the four stages' outputs; ``block`` the
four stages'. DomainBed's MNIST CNN sows its four conv blocks as ``block1`` ..
``block4`` and has no stem, so both settings give its four blocks there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.networks import OWN, MethodNetwork
from sagm_jax.methods.objectives import Step, domain_losses, make_aux
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    fixed,
    register_objective,
)
from sagm_jax.models.resnet import INTERMEDIATES

# ``VarianceEncoder``'s defaults: var = softplus(b) + eps starts at VARIANCE_INIT.
VARIANCE_INIT = 0.1
VARIANCE_EPS = 1e-5
# ``URResNet.build_feature_hooks``: the layers of each ``feat_layers`` setting, in order.
FEATURE_LAYERS = {
    "stem_block": ("stem", "block1", "block2", "block3", "block4"),
    "block": ("block1", "block2", "block3", "block4"),
}
ORACLE = "oracle"  # batch_stats["method"][ORACLE]
VARIANCE = "variance"  # params["method"][VARIANCE][layer]


def feature_layers(setting: str, sown) -> tuple[str, ...]:
    """The layers of ``setting`` (:data:`FEATURE_LAYERS`) that the network sows, in order."""
    if setting not in FEATURE_LAYERS:
        raise ValueError(f"miro_feat_layers={setting!r}: expected one of "
                         f"{', '.join(FEATURE_LAYERS)}")
    layers = tuple(name for name in FEATURE_LAYERS[setting] if name in sown)
    if not layers:
        raise ValueError(f"the network sows none of MIRO's layers {FEATURE_LAYERS[setting]}")
    return layers


def initial_variance_bias() -> jax.Array:
    """b0 = log(exp(init - eps) - 1) in float32, so softplus(b0) + eps = init (0.1)."""
    return jnp.log(jnp.exp(jnp.float32(VARIANCE_INIT - VARIANCE_EPS)) - 1.0)


def variance(bias) -> jax.Array:
    """The variance encoder's output: softplus(b) + eps, per channel."""
    return jax.nn.softplus(bias.astype(jnp.float32)) + VARIANCE_EPS


def mean_encoder(features):
    """The reference's ``MeanEncoder``: the identity."""
    return features


def regulariser(features: dict, oracle_features: dict, biases: dict) -> jax.Array:
    """R = sum_l mean((mu(f_l) - pre_l)^2 / var_l + log var_l) / 2 over the layers of
    ``biases`` (``{layer: b_l [C]}``); f_l, pre_l [N, ..., C], var_l broadcast over the
    last (channel) axis; float32; the oracle's features carry no gradient."""
    total = jnp.float32(0.0)
    for layer, bias in biases.items():
        f = mean_encoder(features[layer].astype(jnp.float32))
        pre = jax.lax.stop_gradient(oracle_features[layer].astype(jnp.float32))
        var = variance(bias)
        total = total + jnp.mean((f - pre) ** 2 / var + jnp.log(var)) / 2.0
    return total


def _init(key, shapes, hp, network):
    """The variance encoders (one ``b`` [C] per layer, variance 0.1) and the oracle, a copy
    of the network's step-0 variables (``get_shapes`` sizes the encoders from a dummy pass)."""
    del key
    model, variables = network
    oracle = {"params": variables["params"]}
    if variables.get("batch_stats"):
        oracle["batch_stats"] = variables["batch_stats"]
    sown = jax.eval_shape(
        lambda v: model.apply(v, jnp.zeros((1, *shapes.input_shape)), train=False,
                              features=True, mutable=[INTERMEDIATES])[1][INTERMEDIATES],
        oracle,
    )
    bias = initial_variance_bias()
    encoders = {layer: jnp.full((sown[layer][-1].shape[-1],), bias, jnp.float32)
                for layer in feature_layers(hp["miro_feat_layers"], sown)}
    # Copies: the train state is donated, so the oracle must not share buffers with params.
    oracle = jax.tree.map(lambda x: jnp.array(x, copy=True), oracle)
    return {"params": {VARIANCE: encoders}, "batch_stats": {ORACLE: oracle}}


def _miro(args: Step):
    """L = CE + ld R (see the module docstring): one training pass with its intermediate
    features, the oracle's evaluation pass on the same images."""
    out = args.forward(args.images, intermediates=True)
    losses = domain_losses(out.logits, args.labels, args.num_domains)
    oracle_features = out.intermediates_at(out.batch_stats[OWN][ORACLE], args.images)
    reg_loss = regulariser(out.intermediates, oracle_features, args.params[OWN][VARIANCE])
    loss = losses.mean() + args.hp["miro_ld"] * reg_loss
    return loss, make_aux(args, out, {"loss": loss, "reg_loss": reg_loss}, losses)


# The encoders (trained at lr * miro_lr_mult) and the oracle, sized from the run's network.
MIRO_NETWORK = MethodNetwork(
    init=_init, init_from_network=True,
    learning_rate_multiplier=lambda hp: hp["miro_lr_mult"],
)

register_objective(Objective(
    Method("miro", "MIRO", (
        # config.yaml's 0.1; configs/<dataset>.py set the README's per-dataset values.
        # khanrc/miro has no random search: a search keeps the config's value.
        Hyperparameter("miro_ld", 0.1, "MIRO's lambda: weight of the regulariser", ">= 0"),
        Hyperparameter("miro_lr_mult", 10.0,
                       "MIRO's encoders train at lr * miro_lr_mult", "> 0", fixed(10.0)),
        Hyperparameter("miro_feat_layers", "stem_block",
                       "MIRO's regularised features: stem_block (stem + 4 stages) or block",
                       "one of stem_block, block"),
    ), "CE + lambda * Gaussian log-likelihood of the step-0 network's intermediate features",
        "Cha et al. 2022 (khanrc/miro)", (None, None, None, None, None, 65.9, "MIRO README")),
    _miro,
    label_alone=True,
    network=MIRO_NETWORK,
))
