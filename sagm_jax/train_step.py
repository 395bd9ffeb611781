"""The train state and the jitted train step shared by training and benchmarks.

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


def per_example_cross_entropy(logits, labels) -> jax.Array:
    """Cross-entropy of each example, computed in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def cross_entropy(logits, labels) -> jax.Array:
    """Mean cross-entropy over the batch, computed in float32."""
    return jnp.mean(per_example_cross_entropy(logits, labels))


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

    def loss_fn(params, batch_stats, batch, key, mixstyle):
        variables = {"params": jax.tree.map(lambda p: p.astype(compute_dtype), params)}
        if batch_stats:
            variables["batch_stats"] = batch_stats
        dropout_key, mixstyle_key = jax.random.split(key)
        outputs = model.apply(
            variables,
            batch["image"].astype(compute_dtype),
            train=True,
            mixstyle=mixstyle,
            rngs={"dropout": dropout_key, "mixstyle": mixstyle_key},
            mutable=["batch_stats"] if train_batchnorm else False,
        )
        logits, updated = outputs if train_batchnorm else (outputs, {})
        return cross_entropy(logits, batch["label"]), updated.get("batch_stats", batch_stats)

    def train_step(state: TrainState, batch, key):
        clean_key, perturbed_key = jax.random.split(jax.random.fold_in(key, state.step))
        if shared_dropout:
            perturbed_key = clean_key
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
