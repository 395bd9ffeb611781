"""The train state, the one function that applies a model, and the train step.

``make_train_step`` is the pure step of one device's data; ``data_parallel_train_step``
is the one place that decides the data-parallel mode around it and jits it:

* ``perturbation='global'``: one jitted program over the batch sharded on the mesh's
  ``batch`` axis; XLA inserts the reductions, so the step equals the one-device step.
* ``perturbation='per_device'`` (m-sharpness): the step runs per device under
  ``shard_map``; each device perturbs with its own shard's gradient, and the optimizer
  averages the final direction over the ``batch`` axis for EVERY algorithm (ERM
  included, see ``optimizers.paper_optimizer``), so the replicated parameters and
  optimizer state stay equal on every device.

Both start with ``device_augment.model_inputs``, which augments uint8 image-folder
batches on the device.

One step, for every plain and sharpness-aware rule (the optimizer decides how many
gradients it needs), ``L_B`` being the config's objective (``sagm_jax.methods.objectives``) on
the step's per-domain minibatches:

    g   = grad L_B(w)                              clean pass (its loss is reported)
    d   = optimizer head(g, grad_fn)               SAM/GSAM/SAGM call grad_fn once
    w  <- w + Adam(d + wd * w)                     see optimizers.paper_optimizer

``grad_fn(p, i)`` differentiates the loss of the SAME batch at ``p``, with the same
draws of the objective (Mixup's pairs, CutMix's box) and the objective state the clean
pass advanced to (GroupDRO's ``q`` moves once per step). With DISAM the clean pass also
gives ``g_DI = grad (L_B - lambda Var_m L_m)`` from the same forward, and the head
perturbs along it. IRM's and VREx's Adam restarts (all optimizer state back to
``init``) at the end of their anneal; EQRM's, at the end of its burn-in, also steps at
its own learning rate from then on (the updates scaled by eqrm_lr / lr). A procedure
(Fish, AND-mask, MLDG) replaces the three lines: it updates from each domain's gradient
(``sagm_jax.methods.procedures``), or (DANN, CDANN, SagNet, mDSDI) from passes over the
whole batch at parameters it chooses, drawing its dropout from keys it folds from its own. Random
draws derive from ``fold_in(key, step)``, so a resumed run repeats them.

Choices the reference leaves implicit, stated here:
- Dropout draws an independent mask in each pass, as the reference's two
  forward calls do; ``shared_dropout=True`` reuses the clean pass's mask.
- MixStyle (when the model has it): SAGM's clean pass runs WITHOUT it and its
  perturbed pass WITH it (the paper's SAGM+MixStyle); every other algorithm uses
  it in every training pass.
- Frozen BatchNorm (the default) reads the ImageNet running statistics in both
  passes. With trainable BatchNorm only the clean pass updates the statistics,
  as the reference disables running statistics for the perturbed pass.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from sagm_jax.averaging import swad_averages as averaging
from sagm_jax.averaging import moving_average
from sagm_jax.methods import networks, objectives
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import BatchPasses
from sagm_jax.config import section
from sagm_jax.data import device_augment
from sagm_jax.models import backbones
from sagm_jax.models.resnet import INTERMEDIATES
from sagm_jax.methods.registry import settings, update_rule
from sagm_jax.methods.update_rules import domain_loss_variance


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    batch_stats: Any  # {} for models without BatchNorm
    opt_state: Any
    objective_state: Any = None  # GroupDRO's q; {} for objectives without state
    averages: Any = None  # SWAD's weight averages (sagm_jax.averaging.swad_averages); {} without SWAD
    # The weights' moving average (sagm_jax.averaging.moving_average); {} without it.
    moving_average: Any = None
    # ERM++'s learning-rate factor, set on the host after an evaluation
    # (sagm_jax.averaging.lr_plateau); {} without its plateau or schedule.
    lr_factor: Any = None


def create_train_state(variables, optimizer, objective_state=None, averages=None,
                       moving_average=None) -> TrainState:
    """Step 0: ``variables``, ``optimizer.init`` (an optax transformation or a
    procedure), the objective's initial state, SWAD's averages and the moving average
    (``{}`` for none)."""
    params = variables["params"]
    return TrainState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        batch_stats=variables.get("batch_stats", {}),
        opt_state=optimizer.init(params),
        objective_state={} if objective_state is None else objective_state,
        averages={} if averages is None else averages,
        moving_average={} if moving_average is None else moving_average,
        lr_factor={},
    )


def apply_model(model: nn.Module, params, batch_stats, images, compute_dtype, **kwargs):
    """``model.apply`` on ``images`` with the parameters and images cast to
    ``compute_dtype`` (BatchNorm statistics as stored). ``kwargs`` go to ``model.apply``
    (``train`` defaults to False; ``mixstyle``, ``rngs``, ``mutable``)."""
    variables = {"params": jax.tree.map(lambda p: p.astype(compute_dtype), params)}
    if batch_stats:
        variables["batch_stats"] = batch_stats
    kwargs.setdefault("train", False)
    return model.apply(variables, images.astype(compute_dtype), **kwargs)


def cross_entropy(logits, labels) -> jax.Array:
    """Mean cross-entropy over the batch, computed in float32."""
    return jnp.mean(per_example_cross_entropy(logits, labels))


def _forward(model: nn.Module, params, batch_stats, key, mixstyle, train_batchnorm, compute_dtype):
    """``forward(images, intermediates=False) -> objectives.Outputs``: one training pass at
    ``params``, dropout and MixStyle drawn from ``key``; the BatchNorm statistics it
    returns are updated only with ``train_batchnorm`` or when the method's own modules
    keep statistics (``networks.MethodModel``). ``intermediates=True`` also collects the
    network's sown intermediate features (``Outputs.intermediates``, MIRO); otherwise the
    pass is the plain one. ``Outputs.intermediates_at`` applies the network at other
    variables in evaluation mode (:func:`_intermediates_at`)."""
    updates_statistics = train_batchnorm or getattr(model, "trains_statistics", False)

    def forward(images, intermediates=False):
        dropout_key, mixstyle_key = jax.random.split(key)
        mutable = ["batch_stats"] if updates_statistics else []
        mutable += [INTERMEDIATES] if intermediates else []
        outputs = apply_model(
            model,
            params,
            batch_stats,
            images,
            compute_dtype,
            train=True,
            mixstyle=mixstyle,
            features=True,
            rngs={"dropout": dropout_key, "mixstyle": mixstyle_key},
            mutable=mutable or False,
        )
        (features, logits), updated = outputs if mutable else (outputs, {})
        return objectives.Outputs(
            features, logits, updated.get("batch_stats", batch_stats),
            lambda other: networks.classify(params, other, compute_dtype),
            _sown(updated[INTERMEDIATES]) if intermediates else None,
            _intermediates_at(model, compute_dtype),
        )

    return forward


def _sown(collection) -> dict:
    """``{name: array}`` of a sown collection (Flax's ``sow`` keeps a tuple per name)."""
    return {name: values[-1] for name, values in collection.items()}


def _intermediates_at(model, compute_dtype):
    """``(variables, images) -> {name: array}``: the run's network (without a method's
    wrapper) at ``variables`` in evaluation mode (BatchNorm's running statistics, no
    dropout, no MixStyle), its sown intermediate features."""
    network = model.model if isinstance(model, networks.MethodModel) else model

    def intermediates_at(variables, images):
        _, sown = apply_model(
            network, variables["params"], variables.get("batch_stats", {}), images,
            compute_dtype, train=False, features=True, mutable=[INTERMEDIATES],
        )
        return _sown(sown[INTERMEDIATES])

    return intermediates_at


class StepMethod(NamedTuple):
    """What a train step computes besides the model and the update rule: the objective
    and its hyperparameters, the number of training domains, and DISAM's weight; the
    run's learning rate ``lr`` (read by an objective whose restart changes it: EQRM)."""

    objective: str = "erm"
    hyperparameters: dict = {}
    num_domains: int = 1
    disam_lambda: float = 0.0
    learning_rate: Any = None


def _frozen_stopped(params, trainable):
    """``params`` with the gradient stopped for every parameter ``trainable(params)`` (a
    tree of bools, or ``trainable`` None: all train) marks False, in every pass, as
    PyTorch's ``requires_grad=False``: their gradients are 0, so they add nothing to a
    perturbation's norm, and Adam (whose weight decay leaves them out,
    ``train.optimizer_from_config``) never moves them."""
    if trainable is None:
        return params
    return jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params,
                        trainable(params))


def step_keys(key, step):
    """``(clean, perturbed, objective)``: three independent keys of step ``step`` of a run
    whose step key is ``key``, one split of ``fold_in(key, step)``: the clean pass's
    dropout and MixStyle, the perturbed pass's, and the objective's draws (MTL's noise,
    Mixup's pairs, CutMix's box), the same in the clean and the perturbed pass (both
    differentiate one loss function). Dropout draws its own mask in each pass (see the
    module docstring). A key folded from the step key with 1 would be the perturbed
    pass's: with JAX's partitionable threefry, ``split(k)[i] == fold_in(k, i)``."""
    clean_key, perturbed_key, objective_key = jax.random.split(jax.random.fold_in(key, step), 3)
    return clean_key, perturbed_key, objective_key


def make_train_step(
    model: nn.Module,
    optimizer,
    *,
    algorithm: str,
    method: StepMethod = StepMethod(),
    use_mixstyle: bool = False,
    train_batchnorm: bool = False,
    shared_dropout: bool = False,
    compute_dtype=jnp.float32,
    axis_name: str | None = None,
    trainable=None,
):
    """Returns ``train_step(state, batch, key) -> (state, metrics)``, pure and jittable.

    ``batch`` holds ``image`` [B, H, W, C] and ``label`` [B], the ``method.num_domains``
    training domains' minibatches concatenated in order. With ``compute_dtype`` bfloat16
    the parameters and images are cast for the forward and backward passes; the
    parameters, the optimizer and the loss stay in float32. Inside ``shard_map`` (the
    per-device perturbation), ``axis_name`` averages the reported metrics and trained
    BatchNorm statistics over devices. ``optimizer`` is the optax chain of a plain or
    sharpness-aware rule, or the ``procedures.Procedure`` of ``algorithm`` (Fish, AND-mask,
    MLDG), which updates from per-domain gradients; ``metrics``: the reported ``loss``
    and the objective's other values. ``trainable``: :func:`_frozen_stopped`.
    """
    rule = update_rule(algorithm)
    is_procedure = rule.kind == "procedure"
    clean_mixstyle = use_mixstyle and rule.clean_pass_mixstyle
    reset_step = objectives.reset_optimizer_step(method.objective, method.hyperparameters)
    rescaled = _restart_learning_rate(method, reset_step)

    def train_step(state: TrainState, batch, key):
        clean_key, perturbed_key, objective_key = step_keys(key, state.step)
        perturbed_key = clean_key if shared_dropout else perturbed_key

        def forward_at(params, dropout_key, mixstyle=use_mixstyle):
            return _forward(
                model, _frozen_stopped(params, trainable), state.batch_stats, dropout_key,
                mixstyle, train_batchnorm, compute_dtype,
            )

        def loss_fn(params, dropout_key, mixstyle, objective_state, advance):
            return objectives.objective_loss(
                method.objective, method.hyperparameters,
                forward_at(params, dropout_key, mixstyle), batch["image"], batch["label"],
                num_domains=method.num_domains, state=objective_state, step=state.step,
                key=objective_key, advance=advance, params=params,
                forward_at=lambda other: forward_at(other, dropout_key, mixstyle),
            )

        opt_state = _restarted(optimizer, state, reset_step)
        batch_stats, objective_state = state.batch_stats, state.objective_state
        if is_procedure:
            passes = _procedure_passes(optimizer, forward_at, batch, clean_key, state.step,
                                       method.num_domains)
            updates, opt_state, metrics = optimizer.update(
                state.params, opt_state, passes, objective_key
            )
        else:
            grads, extra, aux = _clean_gradients(
                loss_fn, state, clean_key, clean_mixstyle, method.disam_lambda
            )
            objective_state, metrics, batch_stats = aux.state, aux.metrics, aux.batch_stats
            grad_fn = _perturbed_gradient(loss_fn, perturbed_key, use_mixstyle, objective_state)
            updates, opt_state = optimizer.update(
                grads, opt_state, state.params, grad_fn=grad_fn, step=state.step, **extra
            )
        if axis_name is not None:
            metrics, batch_stats = jax.lax.pmean((metrics, batch_stats), axis_name)
        state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, _times_lr_factor(
                rescaled(updates, state.step), state.lr_factor)),
            batch_stats=batch_stats,
            opt_state=opt_state,
            objective_state=objective_state,
        )
        return state, metrics

    return train_step


def _times_lr_factor(updates, lr_factor):
    """``updates`` times ERM++'s learning-rate factor (``{}``: none). Exact for torch's
    Adam with coupled decay: its step is linear in lr, and the moments do not read it."""
    if isinstance(lr_factor, dict):
        return updates
    return jax.tree.map(lambda u: u * lr_factor.astype(u.dtype), updates)


def _perturbed_gradient(loss_fn, key, mixstyle, objective_state):
    """The head's ``grad_fn(params, i)``: the gradient of the perturbed pass, with the
    objective's state as the clean pass left it (it does not advance again)."""

    def grad_fn(params, i):
        del i
        return jax.grad(loss_fn, has_aux=True)(params, key, mixstyle, objective_state, False)[0]

    return grad_fn


def _restarted(optimizer, state: TrainState, reset_step: int | tuple | None):
    """The optimizer state for this step: ``optimizer.init`` at ``reset_step`` (IRM's and
    VREx's fresh Adam at the end of their anneal, head included; at any step of a tuple,
    IB_IRM's two anneals), else the state's."""
    if reset_step is None:
        return state.opt_state
    steps = reset_step if isinstance(reset_step, tuple) else (reset_step,)
    restart = jnp.any(jnp.stack([state.step == s for s in steps]))
    return jax.tree.map(
        lambda fresh, old: jnp.where(restart, fresh, old),
        optimizer.init(state.params),
        state.opt_state,
    )


def _restart_learning_rate(method: StepMethod, reset_step):
    """``rescaled(updates, step)``: the updates times ``new_lr / lr`` from the restart on
    (the objective's ``restart_lr_key``: EQRM's fresh Adam at eqrm_lr), else as given.
    Exact: the rule's chain ends in ``-lr * Adam(...)`` and the moments do not read lr.
    A restart step that is not a whole number never comes (DomainBed compares the step
    with ``==``), so neither does the new rate."""
    key = objectives.objective(method.objective).restart_lr_key
    if key is None:
        return lambda updates, step: updates
    if method.learning_rate is None or isinstance(reset_step, tuple):
        raise ValueError(f"objective {method.objective}: its restart changes the learning "
                         "rate; StepMethod.learning_rate (the run's lr) is needed, with one "
                         "restart step.")
    new_rate = settings(objectives.objective(method.objective).method,
                        method.hyperparameters)[key]
    factor = jnp.asarray(new_rate, jnp.float32) / jnp.asarray(method.learning_rate, jnp.float32)

    def rescaled(updates, step):
        after = (step >= reset_step) & (jnp.floor(reset_step) == reset_step)
        scale = jnp.where(after, factor, jnp.float32(1.0))
        return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)

    return rescaled


def _clean_gradients(loss_fn, state: TrainState, key, mixstyle, disam_lambda: float):
    """The clean pass: ``g = grad L_B(w)``, the objective's auxiliary output, and the extra
    arguments of the head. With DISAM (``disam_lambda`` > 0) one forward serves both
    gradients: ``g`` and ``g_DI = grad (L_B - lambda V)``, ``V`` the population variance
    of the objective's per-domain terms (DISAM, docs/methods.md), as two
    vector-Jacobian products; the head builds its perturbation from ``g_DI``."""
    if not disam_lambda:
        grads, aux = jax.grad(loss_fn, has_aux=True)(
            state.params, key, mixstyle, state.objective_state, True
        )
        return grads, {}, aux

    def both(params):
        loss, aux = loss_fn(params, key, mixstyle, state.objective_state, True)
        return jnp.stack([loss, loss - disam_lambda * domain_loss_variance(aux.domain_losses)]), aux

    _, vjp, aux = jax.vjp(both, state.params, has_aux=True)
    (grads,) = vjp(jnp.array([1.0, 0.0]))
    (ascent,) = vjp(jnp.array([0.0, 1.0]))
    return grads, {"ascent_grads": ascent}, aux


def _procedure_passes(procedure, forward_at, batch, key, step, num_domains: int):
    """What ``procedure.update`` reads: :class:`BatchPasses` over the whole batch for a
    ``whole_batch`` procedure, else the per-domain :func:`_domain_value_and_grad`."""
    if procedure.whole_batch:
        return BatchPasses(forward_at, batch["image"], batch["label"], num_domains, step)
    return _domain_value_and_grad(forward_at, batch, key, num_domains)


def _domain_value_and_grad(forward_at, batch, key, num_domains: int):
    """``(params, m) -> (CE of domain m's minibatch, its gradient)`` for the procedures,
    where ``forward_at(params, key)`` is a training pass's ``forward``; ``m`` may be
    traced. Each call draws its own dropout mask, as the reference's separate forwards do."""
    images = batch["image"].reshape(num_domains, -1, *batch["image"].shape[1:])
    labels = batch["label"].reshape(num_domains, -1)
    calls = itertools.count()  # at trace time: call k draws from fold_in(key, k)

    def value_and_grad(params, m):
        call_key = jax.random.fold_in(key, next(calls))

        def loss(p):
            return cross_entropy(forward_at(p, call_key)(images[m]).logits, labels[m])

        return jax.value_and_grad(loss)(params)

    return value_and_grad


def data_parallel_train_step(config, model: nn.Module, optimizer, mesh, num_domains: int):
    """The run's jitted ``train_step(state, batch, key) -> (state, metrics)`` for the
    data-parallel mode ``config.perturbation`` on ``mesh`` (see the module docstring),
    with the config's objective, its hyperparameters (the "method" section) and DISAM
    over ``num_domains`` training domains. ``optimizer`` must have been built with
    ``axis_name='batch'`` for 'per_device'. With ``config.swad`` the step also takes the
    new weights into SWAD's segment mean (``sagm_jax.averaging.swad_averages``)."""
    per_device = config.perturbation == "per_device"
    train_step = run_train_step(config, model, optimizer, num_domains, mesh if per_device else None)
    return jax.jit(train_step, donate_argnums=0)


def run_train_step(config, model: nn.Module, optimizer, num_domains: int, mesh=None):
    """The unjitted step of one run: device augmentation, the config's step (under
    ``shard_map`` on ``mesh`` for ``perturbation='per_device'``; ``mesh`` None for the
    global mode) and SWAD's accumulation. ``data_parallel_train_step`` jits it; a pack
    (``sagm_jax.training.packed``) vmaps it over its runs, with ``config`` holding each
    run's traced values. With ``config.moving_average`` it also updates the weights'
    moving average (``sagm_jax.averaging.moving_average``)."""
    per_device = mesh is not None
    step_fn = make_train_step(
        model,
        optimizer,
        algorithm=config.algorithm,
        method=StepMethod(
            objective=config.objective,
            hyperparameters=section(config, "method"),
            num_domains=num_domains,
            disam_lambda=config.disam_lambda,
            learning_rate=config.lr,
        ),
        use_mixstyle=config.mixstyle,
        train_batchnorm=not config.freeze_batchnorm,
        shared_dropout=config.shared_dropout,
        compute_dtype=jnp.dtype(config.compute_dtype),
        axis_name="batch" if per_device else None,
        trainable=backbones.trains_with_attention_only if config.attention_only else None,
    )
    if per_device:
        # check_vma=False keeps gradients of replicated parameters local, as under pmap;
        # the optimizer's pmean makes the outputs replicated, as out_specs declares.
        step_fn = jax.shard_map(
            step_fn,
            mesh=mesh,
            in_specs=(P(), P("batch"), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )

    def train_step(state, batch, key):
        batch = device_augment.model_inputs(batch, config.seed, state.step, config.image_size)
        state, metrics = step_fn(state, batch, key)
        if config.swad:  # SWAD's segment mean takes every step's weights
            state = state.replace(averages=averaging.accumulate(state.averages, state.params))
        if config.moving_average:  # so does the moving average, from its start on
            state = moving_average.accumulate(config, model, state, batch["image"], key,
                                              apply_model)
        return state, metrics

    return train_step
