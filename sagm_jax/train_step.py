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

One step, for every algorithm (the optimizer decides how many gradients it needs):

    g   = grad L_B(w)                              clean pass (its loss is reported)
    d   = optimizer head(g, grad_fn)               SAM/GSAM/SAGM call grad_fn once
    w  <- w + Adam(d + wd * w)                     see optimizers.paper_optimizer

``grad_fn(p, i)`` differentiates the loss of the SAME batch at ``p``. Random
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

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from sagm_jax.data import device_augment


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    batch_stats: Any  # {} for models without BatchNorm
    opt_state: Any


def create_train_state(variables, optimizer: optax.GradientTransformation) -> TrainState:
    params = variables["params"]
    return TrainState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        batch_stats=variables.get("batch_stats", {}),
        opt_state=optimizer.init(params),
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


def per_example_cross_entropy(logits, labels) -> jax.Array:
    """Cross-entropy of each example, computed in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def cross_entropy(logits, labels) -> jax.Array:
    """Mean cross-entropy over the batch, computed in float32."""
    return jnp.mean(per_example_cross_entropy(logits, labels))


def _training_loss(model: nn.Module, train_batchnorm: bool, compute_dtype):
    """``loss_fn(params, batch_stats, batch, key, mixstyle) -> (loss, batch_stats)``: the
    mean cross-entropy of one training pass, dropout and MixStyle drawn from ``key``;
    the BatchNorm statistics it returns are updated only with ``train_batchnorm``."""

    def loss_fn(params, batch_stats, batch, key, mixstyle):
        dropout_key, mixstyle_key = jax.random.split(key)
        outputs = apply_model(
            model,
            params,
            batch_stats,
            batch["image"],
            compute_dtype,
            train=True,
            mixstyle=mixstyle,
            rngs={"dropout": dropout_key, "mixstyle": mixstyle_key},
            mutable=["batch_stats"] if train_batchnorm else False,
        )
        logits, updated = outputs if train_batchnorm else (outputs, {})
        return cross_entropy(logits, batch["label"]), updated.get("batch_stats", batch_stats)

    return loss_fn


def make_train_step(
    model: nn.Module,
    optimizer: optax.GradientTransformationExtraArgs,
    *,
    algorithm: str,
    use_mixstyle: bool = False,
    train_batchnorm: bool = False,
    shared_dropout: bool = False,
    compute_dtype=jnp.float32,
    axis_name: str | None = None,
):
    """Returns ``train_step(state, batch, key) -> (state, metrics)``, pure and jittable.

    ``batch`` holds ``image`` [B, H, W, C] and ``label`` [B]. With ``compute_dtype``
    bfloat16 the parameters and images are cast for the forward and backward
    passes; the parameters, the optimizer and the loss stay in float32. Inside
    ``shard_map`` (the per-device perturbation), ``axis_name`` averages the reported
    loss and trained BatchNorm statistics over devices.
    """
    clean_mixstyle = use_mixstyle and algorithm != "sagm"
    loss_fn = _training_loss(model, train_batchnorm, compute_dtype)

    def train_step(state: TrainState, batch, key):
        clean_key, perturbed_key = jax.random.split(jax.random.fold_in(key, state.step))
        perturbed_key = clean_key if shared_dropout else perturbed_key
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.batch_stats, batch, clean_key, clean_mixstyle
        )

        def grad_fn(params, i):
            del i
            return jax.grad(loss_fn, has_aux=True)(
                params, state.batch_stats, batch, perturbed_key, use_mixstyle
            )[0]

        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, grad_fn=grad_fn)
        if axis_name is not None:
            loss, batch_stats = jax.lax.pmean((loss, batch_stats), axis_name)
        state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            batch_stats=batch_stats,
            opt_state=opt_state,
        )
        return state, {"loss": loss}

    return train_step


def data_parallel_train_step(config, model: nn.Module, optimizer, mesh):
    """The run's jitted ``train_step(state, batch, key) -> (state, metrics)`` for the
    data-parallel mode ``config.perturbation`` on ``mesh`` (see the module docstring).
    ``optimizer`` must have been built with ``axis_name='batch'`` for 'per_device'."""
    per_device = config.perturbation == "per_device"
    step_fn = make_train_step(
        model,
        optimizer,
        algorithm=config.algorithm,
        use_mixstyle=config.mixstyle,
        train_batchnorm=not config.freeze_batchnorm,
        shared_dropout=config.shared_dropout,
        compute_dtype=jnp.dtype(config.compute_dtype),
        axis_name="batch" if per_device else None,
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
        return step_fn(state, batch, key)

    return jax.jit(train_step, donate_argnums=0)
