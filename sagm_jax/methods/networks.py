"""Networks a method brings: their variables in the train state, and its prediction.

Some methods train modules of their own beside the run's network (ARM's context
network, MTL's domain-embedding classifier, SelfReg's projection) and some predict
differently (ARM and MTL adapt to the evaluated batch). An objective declares them with
a :class:`MethodNetwork` in its registry entry (``Objective.network``):

* ``init(key, shapes, hp) -> {"params": ..., "batch_stats": ...}`` (``batch_stats``
  only for modules with BatchNorm): the method's variables at step 0, drawn from the
  run's seed. They live in the train state under the key ``"method"`` of the network's
  ``params`` (and ``batch_stats``), so the update rule trains them with the network
  (the sharpness-aware heads perturb them too), SWAD averages them, and checkpoints,
  exact resume and ``load_run`` carry them with no code of their own. Flax ignores
  variables a module does not declare, so the network reads its own as before.
* ``predict(base, own, images, train, hp) -> ((features, logits), own_batch_stats)``,
  optional: the method's prediction from ``base(x) -> (features, logits)`` (the run's
  network on ``x`` at the same variables; ``base(x, network_variables)`` applies it at
  other variables, a copy the method keeps in ``own``) and ``own`` (``{"params", "batch_stats"}``
  under ``"method"``); ``own_batch_stats`` is the updated statistics of its own
  BatchNorm layers in training mode (None when it has none). :class:`MethodModel` wraps
  the network with it, so the train step's forward, the evaluator, the sharpness
  curves, SWAD's BatchNorm pass and ``load_run`` all predict the method's way.
* ``extra_input_channels``: channels the method adds to the network's input (ARM's
  context, the last channel), so the network is built for ``channels + extra``.
* ``uses_mask``: ``predict`` also takes ``mask=`` ([N] bool, False on an evaluation
  batch's padding rows, None when every row is real), for a prediction that pools over
  the batch (ARM, MTL); ``MethodModel.apply(..., mask=...)`` passes it on.
* ``uses_key``: ``predict`` also takes ``key=``, the PRNG key of an evaluation batch's
  draws (MTL's noise; the evaluator folds one per batch, ``evaluation.batch_key``; None
  when the caller gives none); ``MethodModel.apply(..., key=...)`` passes it on.
* ``uses_classifier``: ``predict`` also takes ``classify=``, ``features -> logits`` with
  the network's own classifier at the pass's variables (:func:`classify`), for a
  prediction that changes the features before the network's head (URM's output
  activation).
* ``eval_batch_size``: the evaluation batch of the reference, for a prediction that
  depends on the evaluated batch (ARM, MTL: DomainBed's ``misc.accuracy`` runs its
  loaders' batches of 64); the evaluator, ``load_run``'s example and the sharpness
  curves use it when ``config.eval_batch_size`` is 0. None for a prediction per example.

A procedure (``UpdateRule.network``; DANN's discriminator, SagNet's style network)
declares its modules the same way; its update reads and steps them in ``params["method"]``
(:func:`split_params`).

``init_from_network``: ``init`` also receives ``network=(model, variables)``, the run's
network and its variables at step 0 (a second copy of it, or a frozen one).

``predict`` reads the run's ``batch_per_env`` (:data:`BATCH_PER_ENV`) from ``hp``
(``from_config`` adds it): ARM's support size.

An objective's loss reads the method's parameters at the pass it evaluates from
``Step.params["method"]`` (``sagm_jax.methods.objectives.Step``), and ``Outputs.classify``
applies the network's own classifier to features (RSC, SelfReg).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

OWN = "method"  # the key of a method's variables in the network's params and batch_stats
BATCH_PER_ENV = "batch_per_env"  # the config value ``from_config`` adds to a method's hp


class Shapes(NamedTuple):
    """What a method's modules are sized from: the network's input ``[H, W, C]`` (before
    ``extra_input_channels``), its feature width, the classes and training domains."""

    input_shape: tuple
    feature_dim: int
    num_classes: int
    num_domains: int


class MethodNetwork(NamedTuple):
    """A method's own modules and prediction (see the module docstring)."""

    init: Callable[[jax.Array, Shapes, dict], dict] | None = None
    predict: Callable | None = None
    extra_input_channels: int = 0
    uses_mask: bool = False
    uses_key: bool = False
    eval_batch_size: int | None = None
    # ``frozen(hp) -> keys`` of ``params["method"]`` the method never trains (ARM's
    # untrained context network): its loss stops their gradient, and the optimizer's
    # weight decay leaves them out (``decay_mask``), so they stay exactly at init.
    frozen: Callable[[dict], tuple[str, ...]] | None = None
    init_from_network: bool = False
    # ``learning_rate_multiplier(hp) -> k``: the method's own parameters train at ``k * lr``
    # in the run's Adam (MIRO's encoders; ``update_rules.rule_optimizer``); None for k = 1.
    learning_rate_multiplier: Callable[[dict], float] | None = None
    # ``predict`` also takes ``classify=`` (the module docstring): URM's output activation.
    uses_classifier: bool = False


def split_params(params: dict) -> tuple[dict, dict]:
    """``(network's params, method's params)`` of a train state's ``params``."""
    return {k: v for k, v in params.items() if k != OWN}, params.get(OWN, {})


def join_params(network_params: dict, own_params: dict) -> dict:
    """The inverse of :func:`split_params`."""
    return {**network_params, OWN: own_params} if own_params else dict(network_params)


def split_variables(variables: dict) -> tuple[dict, dict]:
    """``(network's variables, method's variables)``: the method's under ``OWN`` in
    ``params`` and ``batch_stats``, removed from the network's."""
    network, own = {}, {}
    for collection, tree in variables.items():
        if isinstance(tree, dict) and OWN in tree:
            network[collection] = {k: v for k, v in tree.items() if k != OWN}
            own[collection] = tree[OWN]
        else:
            network[collection] = tree
    return network, own


def with_method_variables(variables: dict, own: dict) -> dict:
    """``variables`` with the method's ``own`` variables added under ``OWN``."""
    merged = dict(variables)
    for collection, tree in own.items():
        merged[collection] = {**merged.get(collection, {}), OWN: tree}
    return merged


def classify(params, features, compute_dtype=jnp.float32) -> jax.Array:
    """The network's classifier (``params["classifier"]``, DomainBed's linear head) on
    ``features`` [N, d]: ``features @ kernel + bias`` in ``compute_dtype``."""
    head = params["classifier"]
    return features.astype(compute_dtype) @ head["kernel"].astype(compute_dtype) + head[
        "bias"
    ].astype(compute_dtype)


class MethodModel:
    """The run's network predicting a method's way: ``apply`` takes the arguments of the
    network's Flax ``apply`` (``variables, images, train, features, mutable``, the rest
    passed through) and returns what it returns, with the method's variables under
    ``OWN``; the method's BatchNorm statistics update in training mode. ``mask`` ([N]
    bool, False on padding rows) reaches a ``predict`` that ``uses_mask``, ``key`` (an
    evaluation batch's PRNG key) one that ``uses_key``."""

    def __init__(self, model, network: MethodNetwork, hp: dict):
        self.model, self.network, self.hp = model, network, hp
        # The train step asks for updated statistics when this is True, even with the
        # network's own BatchNorm frozen.
        self.trains_statistics = True

    def apply(self, variables, images, *, train: bool = False, features: bool = False,
              mutable: Any = False, mask=None, key=None, **kwargs):
        base_variables, own = split_variables(variables)
        updates = {}

        def base(x, network_variables=None):
            if network_variables is not None:  # a copy of the network the method keeps
                return self.model.apply(network_variables, x, train=train, features=True,
                                        **kwargs)
            out = self.model.apply(base_variables, x, train=train, features=True,
                                   mutable=mutable, **kwargs)
            if mutable:
                out, updated = out
                updates.update(updated)
            return out

        extra = {"mask": mask} if self.network.uses_mask else {}
        extra.update({"key": key} if self.network.uses_key else {})
        if self.network.uses_classifier:
            extra["classify"] = lambda f: classify(base_variables["params"], f, f.dtype)
        (feats, logits), own_stats = self.network.predict(base, own, images, train, self.hp,
                                                          **extra)
        out = (feats, logits) if features else logits
        if not mutable:
            return out
        batch_stats = dict(updates.get("batch_stats", base_variables.get("batch_stats", {})))
        if own_stats is not None:
            batch_stats[OWN] = own_stats
        elif "batch_stats" in own:
            batch_stats[OWN] = own["batch_stats"]
        return out, {"batch_stats": batch_stats}

    def init(self, *args, **kwargs):
        return self.model.init(*args, **kwargs)


def decay_mask(network: MethodNetwork | None, hp: dict):
    """The weight-decay mask of a method that keeps parameters frozen: ``params ->`` a
    tree of bools, False for the keys of ``params["method"]`` that ``frozen(hp)`` names
    (PyTorch's coupled decay acts only on what its optimizer holds); None when every
    parameter trains."""
    frozen = set(network.frozen(hp)) if network is not None and network.frozen else set()
    if not frozen:
        return None

    def mask(params):
        tree = jax.tree.map(lambda _: True, params)
        tree[OWN] = {key: jax.tree.map(lambda _, k=key: k not in frozen, value)
                     for key, value in params[OWN].items()}
        return tree

    return mask


def group_learning_rates(network: MethodNetwork | None, hp: dict):
    """The optax transformation that steps the method's own parameters at their
    learning-rate multiplier (:func:`scale_own_updates`), for ``rule_optimizer``'s
    ``group_learning_rates``; None when they step at the network's rate."""
    if network is None or network.learning_rate_multiplier is None:
        return None
    multiplier = network.learning_rate_multiplier(hp)  # traced in a pack
    static_one = isinstance(multiplier, (int, float)) and multiplier == 1.0
    return None if static_one else scale_own_updates(multiplier)


def scale_own_updates(multiplier: float):
    """An optax transformation multiplying the updates of the method's own parameters
    (``params[OWN]``) by ``multiplier`` (after Adam: their learning rate times it); the
    network's pass unchanged."""

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(updates, dict) or OWN not in updates:
            return updates, state
        return {**updates, OWN: jax.tree.map(lambda u: u * multiplier, updates[OWN])}, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def input_shape_for(network: MethodNetwork | None, input_shape) -> tuple:
    """The network's input shape with the method's extra channels."""
    extra = 0 if network is None else network.extra_input_channels
    return (*input_shape[:-1], input_shape[-1] + extra)


def init_method_variables(network: MethodNetwork | None, key, shapes: Shapes, hp: dict,
                          base=None) -> dict:
    """The method's variables at step 0 (``{}`` for a method without modules); ``base``
    is ``(model, variables)`` of the run's network, passed to an ``init_from_network``."""
    if network is None or network.init is None:
        return {}
    if network.init_from_network:
        return network.init(key, shapes, hp, network=base)
    return network.init(key, shapes, hp)


def method_network(config):
    """``(network, hp)`` of the run's method: the objective's ``MethodNetwork`` or, for a
    procedure that has one, the update rule's (they never both have one: the procedures
    take the ``erm`` objective), and the hyperparameters of both with their defaults (a
    run written before a hyperparameter existed reads its default) and ``batch_per_env``."""
    from sagm_jax.methods.registry import objective, update_rule

    entry = objective(config.get("objective", "erm"))
    rule = update_rule(config.get("algorithm", "erm"))
    hp = {h.key: config.get(h.key, h.default)
          for h in entry.method.hyperparameters + rule.method.hyperparameters}
    hp[BATCH_PER_ENV] = config.get(BATCH_PER_ENV)
    return entry.network if entry.network is not None else rule.network, hp


def wrap(model, network: MethodNetwork | None, hp: dict):
    """``model``, wrapped in :class:`MethodModel` when the method predicts its own way."""
    if network is None or network.predict is None:
        return model
    return MethodModel(model, network, hp)


def from_config(config, num_classes: int, input_shape, num_domains: int, key,
                pretrained: bool = True, imagenet_inputs: bool = False):
    """The run's network with its method's modules: ``(model, variables, weights_info)``
    as ``sagm_jax.models.from_config`` returns them, the network built for the method's
    extra input channels, the method's variables (from ``fold_in(key, 1)``) added under
    ``OWN`` and the model wrapped for the method's prediction. Training and ``load_run``
    both build the run's network here; ``imagenet_inputs`` as ``models.from_config``."""
    from sagm_jax import models

    network, hp = method_network(config)
    shape = input_shape_for(network, input_shape)
    model, variables, weights = models.from_config(config, num_classes, shape, key, pretrained,
                                                   imagenet_inputs)
    if network is not None and network.init is not None:
        features, _ = jax.eval_shape(
            lambda v: model.apply(v, jnp.zeros((1, *shape)), train=False, features=True),
            variables,
        )
        shapes = Shapes(tuple(input_shape), features.shape[-1], num_classes, num_domains)
        own = init_method_variables(network, jax.random.fold_in(key, 1), shapes, hp,
                                    base=(model, variables))
        variables = with_method_variables(variables, own)
    return wrap(model, network, hp), variables, weights
