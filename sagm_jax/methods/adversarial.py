"""DANN and CDANN: the domain-adversarial procedures, their discriminator and registry entries.

This module owns DomainBed's ``AbstractDANN``, ``DANN`` and ``CDANN``
(``facebookresearch/DomainBed``, ``domainbed/algorithms.py``) and the discriminator MLP
they train (``domainbed/networks.py``, ``MLP``), as whole-batch procedures
(``sagm_jax.methods.procedures.Procedure`` with ``whole_batch=True``): ``algorithm=dann``
and ``algorithm=cdann``. The discriminator (and CDANN's class embeddings) are the
procedure's own modules, under ``params["method"]``::

    {"discriminator": {"input": {kernel, bias}, "hidden_0": ..., "output": ...},
     "class_embeddings": [num_classes, d]}          # CDANN only

Each step ``t`` (``t`` updates before it; DomainBed increments ``update_count`` BEFORE its
test, so the test reads ``t + 1``) is a discriminator step when
``(t + 1) % (1 + d_steps_per_g_step) < d_steps_per_g_step`` and a generator step otherwise;
with the default 1 they alternate, generator first (t = 0: 1 % 2 = 1, not < 1).
:func:`discriminator_loss` has the loss both steps use; :func:`dann` the two steps and
their optimizers. DomainBed's DANN never reads ``lr`` or ``weight_decay``: its generator
trains with ``lr_g``/``weight_decay_g``, its discriminator with ``lr_d``/``weight_decay_d``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.networks import MethodNetwork, Shapes, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import BatchPasses, Procedure, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    choice,
    log_uniform,
    register_update_rule,
)

DISCRIMINATOR = "discriminator"
CLASS_EMBEDDINGS = "class_embeddings"
# The second Adam moment's decay of both DANN optimizers (DomainBed's ``betas=(beta1, 0.9)``).
ADAM_BETA2 = 0.9
# CDANN's class weights: DomainBed's (``F.one_hot(all_y)`` sized by the batch's largest
# label), or weights that sum to 1 over the classes present (the fix).
BALANCE_MAX_LABEL, BALANCE_PRESENT = "max_label", "present"
# The reported loss of the kind of step not taken (a jitted step returns the same keys
# every step; DomainBed's dict holds only the one computed).
NOT_COMPUTED = float("nan")


# --- the discriminator MLP ----------------------------------------------------------


def _linear_init(key, fan_in: int, fan_out: int) -> dict:
    """PyTorch's ``nn.Linear`` initialisation: kernel and bias ~ U(-1/sqrt(fan_in), +)."""
    bound = 1.0 / jnp.sqrt(fan_in)
    kernel_key, bias_key = jax.random.split(key)
    return {
        "kernel": jax.random.uniform(kernel_key, (fan_in, fan_out), jnp.float32, -bound, bound),
        "bias": jax.random.uniform(bias_key, (fan_out,), jnp.float32, -bound, bound),
    }


def mlp_init(key, n_inputs: int, n_outputs: int, width: int, depth: int) -> dict:
    """DomainBed's ``networks.MLP(n_inputs, n_outputs)``: an ``input`` layer to ``width``,
    ``depth - 2`` ``hidden_k`` layers of ``width`` and an ``output`` layer."""
    keys = jax.random.split(key, max(depth, 2))
    params = {"input": _linear_init(keys[0], n_inputs, width)}
    for k in range(depth - 2):
        params[f"hidden_{k}"] = _linear_init(keys[k + 2], width, width)
    params["output"] = _linear_init(keys[1], width, n_outputs)
    return params


def _dropout(x, rate: float, key):
    """PyTorch's training-mode ``nn.Dropout(rate)``: keep with probability 1 - rate and
    scale the kept by 1 / (1 - rate); the identity at rate 0."""
    if isinstance(rate, (int, float)) and rate == 0.0:  # a traced rate (a pack) draws
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def mlp_apply(params: dict, x, dropout_rate: float, key):
    """DomainBed's ``MLP.forward`` in training mode::

        h = relu(dropout(input(x)));  h = relu(dropout(hidden_k(h))) for each k;  output(h)

    Layer ``k`` (input = 0) draws its dropout mask from ``fold_in(key, k)``."""

    def linear(layer, h):
        return h @ layer["kernel"] + layer["bias"]

    hidden = [params[f"hidden_{k}"] for k in range(len(params) - 2)]
    h = x
    for k, layer in enumerate([params["input"], *hidden]):
        h = jax.nn.relu(_dropout(linear(layer, h), dropout_rate, jax.random.fold_in(key, k)))
    return linear(params["output"], h)


def adversary_init(conditional: bool):
    """``MethodNetwork.init``: the discriminator ``MLP(d, num_domains)`` and, for CDANN,
    the class embeddings ``nn.Embedding(num_classes, d)`` (N(0, 1), PyTorch's). DANN's
    reference also builds the embeddings but never uses them: PyTorch's Adam skips a
    parameter without a gradient, so they never move and are left out here."""

    def init(key, shapes: Shapes, hp: dict) -> dict:
        mlp_key, embedding_key = jax.random.split(key)
        own = {DISCRIMINATOR: mlp_init(mlp_key, shapes.feature_dim, shapes.num_domains,
                                       int(hp["mlp_width"]), int(hp["mlp_depth"]))}
        if conditional:
            own[CLASS_EMBEDDINGS] = jax.random.normal(
                embedding_key, (shapes.num_classes, shapes.feature_dim), jnp.float32)
        return {"params": own}

    return init


# --- the discriminator's loss --------------------------------------------------------


def class_balance_weights(labels, balance: str = BALANCE_MAX_LABEL) -> jax.Array:
    """CDANN's per-row weights of the discriminator's cross-entropy, ``n_y`` being the
    rows of row i's class ``y`` in the batch.

    ``max_label`` (DomainBed's): ``w_i = 1 / (n_y * K)`` with ``K = max(labels) + 1``,
    the width ``F.one_hot(all_y)`` infers from the batch, not the dataset's class count:
    the weights sum to (classes present) / K, below 1 whenever a label under the batch's
    largest is missing, so the loss's scale moves from batch to batch.
    ``present``: ``w_i = 1 / (n_y * P)``, P the classes present: they sum to 1."""
    same = (labels[:, None] == labels[None, :]).astype(jnp.float32)
    counts = same.sum(axis=1)  # n_y of each row
    if balance == BALANCE_MAX_LABEL:
        width = (jnp.max(labels) + 1).astype(jnp.float32)
    else:
        width = jnp.sum(1.0 / counts)
    return 1.0 / (counts * width)


def discriminator_loss(own: dict, features, labels, num_domains: int, key, *,
                       conditional: bool, dropout_rate: float, grad_penalty: float,
                       balance: str = BALANCE_MAX_LABEL) -> jax.Array:
    """DomainBed's ``disc_loss``, a function of the features (so the generator step
    differentiates it through them) and of ``own``. With ``z`` the features [N, d],
    ``e`` the rows' domains (the minibatches in order) and ``D`` the MLP (one dropout
    mask, from ``key``, for the whole step)::

        u   = z + E[y]  (CDANN)  or  z  (DANN)
        l_i = CE(D(u_i), e_i)
        L   = sum_i w_i l_i  (CDANN, class_balance_weights)  or  mean_i l_i  (DANN)
        G   = d(sum_i l_i) / du                       (create_graph: L's derivatives see it)
        disc_loss = L + grad_penalty * mean_i sum_k G_ik^2
    """
    domains = jnp.repeat(jnp.arange(num_domains), features.shape[0] // num_domains)
    disc_input = features + own[CLASS_EMBEDDINGS][labels] if conditional else features

    def row_losses(u):
        logits = mlp_apply(own[DISCRIMINATOR], u, dropout_rate, key)
        return per_example_cross_entropy(logits, domains)

    losses, pullback = jax.vjp(row_losses, disc_input)
    (input_grad,) = pullback(jnp.ones_like(losses))
    if conditional:
        loss = jnp.sum(class_balance_weights(labels, balance) * losses)
    else:
        loss = jnp.mean(losses)
    return loss + grad_penalty * jnp.mean(jnp.sum(input_grad**2, axis=1))


# --- the procedure ---------------------------------------------------------------------


def is_discriminator_step(step, d_steps_per_g_step: int):
    """DomainBed's test after ``update_count += 1``: ``step`` counts the updates before
    this one, so ``update_count`` is ``step + 1``."""
    return (step + 1) % (1 + d_steps_per_g_step) < d_steps_per_g_step


def adversarial_gradients(network: dict, own: dict, passes: BatchPasses, key, weight,
                          disc_settings: dict):
    """Both kinds of step's losses and gradients, from one pass of the network at
    ``network`` (features ``z`` and logits; dropout from ``fold_in(key, 0)``, the
    discriminator's from ``fold_in(key, 1)``): ``(disc_loss, grad_own disc_loss,
    gen_loss, grad_network gen_loss)``, ``weight`` being lambda and ``disc_settings``
    :func:`discriminator_loss`'s keywords. The generator's gradient is the pass's
    pullback of ``d gen_loss / d(z, logits)``.

    Cost: every step runs the network's forward and backward pass, as DomainBed's does
    (its ``disc_loss.backward()`` also reaches the featurizer); the heads (a small MLP)
    are computed for both kinds of step. The network's passes stay outside ``lax.cond``:
    XLA's CPU backend leaves the convolutions inside a conditional's branch in a slow
    generic form (a generator step of the RotatedDigits CNN took about 1.5 s instead of
    0.05 s; docs/performance.md).
    """
    feature_key, disc_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)

    def disc_loss_at(own_params, features):
        return discriminator_loss(own_params, features, passes.labels, passes.num_domains,
                                  disc_key, **disc_settings)

    def gen_loss_at(features, logits):
        classifier_loss = jnp.mean(per_example_cross_entropy(logits, passes.labels))
        return classifier_loss + weight * -disc_loss_at(own, features)

    def outputs_at(network_params):
        outputs = passes.forward_at(network_params, feature_key)(passes.images)
        return outputs.features, outputs.logits

    (features, logits), pullback = jax.vjp(outputs_at, network)
    disc_loss, own_grads = jax.value_and_grad(disc_loss_at)(own, features)
    gen_loss, output_grads = jax.value_and_grad(gen_loss_at, argnums=(0, 1))(features, logits)
    (net_grads,) = pullback(output_grads)
    return disc_loss, own_grads, gen_loss, net_grads


def dann(hp: dict, *, conditional: bool) -> Procedure:
    """DANN (``conditional=False``) or CDANN (``True``, with class balance) as DomainBed's
    ``AbstractDANN.update``; ``hp`` holds the entry's hyperparameters.

    One featurizer pass per step (dropout from ``fold_in(key, 0)``, the discriminator's
    from ``fold_in(key, 1)``), the same for both kinds of step; on the step's kind
    (:func:`is_discriminator_step`):

    * discriminator: ``own <- Adam_d(grad_own disc_loss)``; the network stays.
    * generator: ``gen_loss = CE(classifier(z), y) + lambda * (-disc_loss)``;
      ``network <- Adam_g(grad_network gen_loss)`` (featurizer and classifier, through
      the features and the penalty's input gradient); ``own`` stays.

    ``Adam_d = Adam(lr_d, weight_decay_d, betas=(beta1, 0.9))`` over the discriminator
    and class embeddings, ``Adam_g`` the same with ``lr_g``, ``weight_decay_g`` over the
    network; each state (its step count included) moves only on its own steps
    (``lax.cond`` over the two optimizer updates). Reports ``disc_loss`` on discriminator
    steps and ``gen_loss`` on generator steps, the other NaN (a jitted step returns the
    same keys every step; a record averages each over the steps that computed it), and
    ``loss`` = the reported one. The passes: :func:`adversarial_gradients`.
    """
    # The hyperparameters stay as given (no float()): a pack traces them (sagm_jax.training.packed).
    disc_opt = torch_adam(hp["lr_d"], hp["weight_decay_d"], (hp["beta1"], ADAM_BETA2))
    gen_opt = torch_adam(hp["lr_g"], hp["weight_decay_g"], (hp["beta1"], ADAM_BETA2))
    d_steps = hp["d_steps_per_g_step"]
    disc_settings = {
        "conditional": conditional, "dropout_rate": hp["mlp_dropout"],
        "grad_penalty": hp["grad_penalty"],
        "balance": hp.get("cdann_balance", BALANCE_MAX_LABEL),
    }
    weight = hp["dann_lambda"]

    def init(params):
        network, own = split_params(params)
        return {"discriminator": disc_opt.init(own), "generator": gen_opt.init(network)}

    def update(params, opt_state, passes: BatchPasses, key):
        network, own = split_params(params)
        disc_loss, own_grads, gen_loss, net_grads = adversarial_gradients(
            network, own, passes, key, weight, disc_settings)

        def discriminator_step(_):
            own_updates, disc_state = disc_opt.update(
                own_grads, opt_state["discriminator"], own)
            updates = join_params(jax.tree.map(jnp.zeros_like, network), own_updates)
            return updates, {**opt_state, "discriminator": disc_state}

        def generator_step(_):
            net_updates, gen_state = gen_opt.update(net_grads, opt_state["generator"], network)
            updates = join_params(net_updates, jax.tree.map(jnp.zeros_like, own))
            return updates, {**opt_state, "generator": gen_state}

        disc_turn = is_discriminator_step(passes.step, d_steps)
        updates, opt_state = jax.lax.cond(disc_turn, discriminator_step, generator_step, None)
        not_computed = jnp.asarray(NOT_COMPUTED, jnp.float32)
        disc_loss = jnp.where(disc_turn, disc_loss, not_computed)
        gen_loss = jnp.where(disc_turn, not_computed, gen_loss)
        return updates, opt_state, {"loss": jnp.where(disc_turn, disc_loss, gen_loss),
                                    "disc_loss": disc_loss, "gen_loss": gen_loss}

    return Procedure(init, update, whole_batch=True)


# --- the registry's entries --------------------------------------------------------------

# DomainBed's ``hparams_registry.py`` (``DANN``, ``CDANN``); ``lambda`` is ``dann_lambda``
# here. lr_g, lr_d and weight_decay_g take DomainBed's ResNet-dataset default and draw;
# its MNIST ones (lr_g, lr_d 1e-3, 10^U(-4.5,-2.5); weight_decay_g fixed 0) are the MNIST
# configs' (config.mnist_config) and the search's (sweep/hparams.py).
ADVERSARIAL_HYPERPARAMETERS = (
    Hyperparameter("dann_lambda", 1.0, "DANN: weight of the adversarial term in the "
                   "generator's loss (DomainBed's lambda)", ">= 0", log_uniform(-2, 2)),
    Hyperparameter("lr_d", 5e-5, "DANN: the discriminator's Adam learning rate", "> 0",
                   log_uniform(-5, -3.5)),
    Hyperparameter("lr_g", 5e-5, "DANN: the generator's (network's) Adam learning rate",
                   "> 0", log_uniform(-5, -3.5)),
    Hyperparameter("weight_decay_d", 0.0, "DANN: the discriminator's coupled L2", ">= 0",
                   log_uniform(-6, -2)),
    Hyperparameter("weight_decay_g", 0.0, "DANN: the generator's coupled L2", ">= 0",
                   log_uniform(-6, -2)),
    Hyperparameter("beta1", 0.5, "DANN: both Adams' beta1 (beta2 is 0.9)", "[0, 1)",
                   choice((0.0, 0.5))),
    Hyperparameter("d_steps_per_g_step", 1, "DANN: discriminator steps per generator step",
                   "int >= 1", log_uniform(0, 3, integer=True, base=2)),
    Hyperparameter("grad_penalty", 0.0, "DANN: weight of the discriminator's input-gradient "
                   "penalty", ">= 0", log_uniform(-2, 1)),
    Hyperparameter("mlp_width", 256, "DANN: the discriminator MLP's width", "int >= 1",
                   log_uniform(6, 10, integer=True, base=2)),
    Hyperparameter("mlp_depth", 3, "DANN: the discriminator MLP's layers", "int >= 2",
                   choice((3, 4, 5))),
    Hyperparameter("mlp_dropout", 0.0, "DANN: the discriminator MLP's dropout", "[0, 1)",
                   choice((0.0, 0.1, 0.5))),
)
CDANN_BALANCE = Hyperparameter(
    "cdann_balance", BALANCE_MAX_LABEL,
    "CDANN's class weights: max_label (DomainBed's, 1/(n_y (max label + 1))) or present "
    "(1/(n_y classes present), summing to 1)",
    f"one of {BALANCE_MAX_LABEL}, {BALANCE_PRESENT}",
)

register_update_rule(UpdateRule(
    Method("dann", "DANN", ADVERSARIAL_HYPERPARAMETERS,
           "domain-adversarial: a discriminator MLP on the features alternates with the "
           "network, which minimises CE - lambda * the discriminator's loss",
           "DomainBed (Ganin et al. 2016)",
           (83.6, 78.6, 65.9, 46.7, 38.3, 62.6, "DomainBed")),
    "procedure",
    lambda hp, **common: dann(hp, conditional=False),
    network=MethodNetwork(init=adversary_init(conditional=False)),
))
register_update_rule(UpdateRule(
    Method("cdann", "CDANN", ADVERSARIAL_HYPERPARAMETERS + (CDANN_BALANCE,),
           "conditional DANN: the discriminator sees features + a class embedding, its "
           "loss class-balanced", "DomainBed (Li et al. 2018)",
           (82.6, 77.5, 65.8, 45.8, 38.3, 62.0, "DomainBed")),
    "procedure",
    lambda hp, **common: dann(hp, conditional=True),
    network=MethodNetwork(init=adversary_init(conditional=True)),
))
