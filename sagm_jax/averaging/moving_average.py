"""A run's simple moving average of its weights: EoA's and DiWA's ``MA``, ERM++'s.

This module owns the average a run keeps in its train state (``TrainState.moving_average``,
``{}`` without ``config.moving_average``) and what the run does with it: with
``config.moving_average`` the run predicts with the average, so its records are the
average's accuracies, its best checkpoint is the average's best step, and ``load_run``
gives the average's variables (``sagm_jax.training.checkpoints.restore_variables``). The
best step is EoA's ``best_model.pkl`` (salesforce/ensemble-of-averages
domainbed/scripts/train.py: saved when ``best_acc < agg_val_acc``, a strict improvement of
the training environments' mean ``out`` accuracy), which is our selection's rule: the
highest, the earliest on a tie (``results.selection.training_domain_validation``).

The rule, as the references compute it (salesforce/ensemble-of-averages
domainbed/algorithms.py ``MovingAvg.update_sma``; DomainBed domainbed/lib/misc.py
``ErmPlusPlusMovingAvg.update_sma``), after update ``k = 1, 2, ...`` (our step
``t = k - 1``; the state's ``step`` after it is ``k``), ``S`` the start
(``config.moving_average_start``, the references' ``sma_start_iter``: EoA's 100, ERM++'s
600), ``w_k`` the weights after update ``k`` and ``w_0`` the initial ones (the average
starts as a copy of the network)::

    k <  S:   a = w_k                                  (a copy; n stays 0)
    k >= S:   n <- n + 1;   a <- (a * n + w_k) / (n + 1)

so after update ``k >= S`` the average is the uniform mean of ``w_{S-1}, ..., w_k``
(``n + 1 = k - S + 2`` weights): in our 0-based steps, the weights after steps
``S - 2, ..., t`` (``S = 1``: the initial weights and every step). It is computed in
float32 in the references' own form ``(a * n + w) / (n + 1)``, inside the jitted step.
The references average the network's whole ``state_dict`` but ``num_batches_tracked``:
the BatchNorm running statistics too (frozen BatchNorm, our default, keeps them constant,
so their average is that constant up to float32 rounding, as in the references).

DiWA's ``MA`` (alexrame/diwa domainbed/algorithms.py ``MA.update_ma``, the same start
100) differs in two details, not reproduced here: it averages ``parameters()`` only (the
BatchNorm buffers stay the initial network's; with frozen BatchNorm the same), and before
the start its ``param_k.data = param_q.data`` makes the averaged network share the
trained network's tensors, which the optimizer then updates in place, so its first
average is ``(w_S + w_S) / 2``: ``w_S`` counted twice where EoA's rule counts
``w_{S-1}`` and ``w_S``.

ERM++'s BatchNorm quirk (DomainBed domainbed/algorithms.py ``ERMPlusPlus.update``: ``if
not freeze_bn: network_sma.train(); network_sma(all_x)``), ``config.moving_average_
batchnorm_forward``: with trainable BatchNorm, after the averaging, one training-mode
forward of the averaged weights on the step's (augmented) batch moves the average's
running statistics toward that batch's, ``s <- 0.9 s + 0.1 batch`` (torch's momentum 0.1,
our BatchNorm's; its running variance is the biased batch variance, Flax's, where
torch's is the unbiased one). The next averaging starts from those statistics, as the
reference's ``update_sma`` reads ``network_sma``'s.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp

# The key the BatchNorm forward folds into its step's key: 0-2 are the step's own draws
# (``train_step.step_keys``: split(k)[i] == fold_in(k, i)).
FORWARD_KEY = 3


@flax.struct.dataclass
class MovingAverage:
    params: Any  # the average of the parameters
    batch_stats: Any  # the average of the BatchNorm statistics ({} without BatchNorm)
    count: jax.Array  # the references' ``sma_count``: the averaging updates so far


def init_moving_average(variables) -> MovingAverage:
    """The average before the first update: a copy of ``variables`` (``{'params',
    'batch_stats'}``), count 0. Every leaf is its own buffer (a real copy, also under
    ``jit``): the jitted step donates the train state, and a buffer held twice would be
    donated twice."""
    return MovingAverage(
        params=jax.tree.map(jnp.copy, variables["params"]),
        batch_stats=jax.tree.map(jnp.copy, variables.get("batch_stats", {})),
        count=jnp.zeros([], jnp.int32),
    )


def update(average: MovingAverage, params, batch_stats, updates, start: int) -> MovingAverage:
    """The average after update ``updates`` (``k``, traced: the state's step after it)
    with the weights ``params`` and statistics ``batch_stats`` it left (the module's rule)."""
    averaging = updates >= start
    count = jnp.where(averaging, average.count + 1, average.count)

    def rule(mean, value):
        n = count.astype(mean.dtype)
        return jnp.where(averaging, (mean * n + value) / (n + 1), value).astype(mean.dtype)

    return MovingAverage(
        params=jax.tree.map(rule, average.params, params),
        batch_stats=jax.tree.map(rule, average.batch_stats, batch_stats),
        count=count,
    )


def batchnorm_forward(average: MovingAverage, model, images, compute_dtype, key,
                      mixstyle: bool = False, *, apply_model) -> MovingAverage:
    """ERM++'s training-mode forward of the averaged weights on ``images`` (the step's
    augmented batch): the average with the running statistics that forward leaves
    (``model``'s BatchNorm momentum), in the statistics' own dtypes (a bfloat16 forward
    leaves them float32); dropout and MixStyle drawn from ``key``.
    ``apply_model`` is ``training.train_step.apply_model`` (passed by the step, which
    imports this module)."""
    dropout_key, mixstyle_key = jax.random.split(key)
    _, updated = apply_model(
        model, average.params, average.batch_stats, images, compute_dtype, train=True,
        mixstyle=mixstyle, rngs={"dropout": dropout_key, "mixstyle": mixstyle_key},
        mutable=["batch_stats"],
    )
    statistics = jax.tree.map(lambda new, old: jax.lax.stop_gradient(new).astype(old.dtype),
                              updated["batch_stats"], average.batch_stats)
    return average.replace(batch_stats=statistics)


def accumulate(config, model, state, images, key, apply_model):
    """The train state after its step's update of the moving average (``config.moving_
    average``): the module's rule at the state's new step, then, with
    ``config.moving_average_batchnorm_forward``, ERM++'s forward on ``images``; ``key``
    is the run's step key (the forward's is folded from it and the step, apart from the
    step's own draws); ``apply_model`` as :func:`batchnorm_forward`'s."""
    average = update(state.moving_average, state.params, state.batch_stats, state.step,
                     config.moving_average_start)
    if config.moving_average_batchnorm_forward:
        forward_key = jax.random.fold_in(jax.random.fold_in(key, state.step - 1), FORWARD_KEY)
        average = batchnorm_forward(average, model, images, jnp.dtype(config.compute_dtype),
                                    forward_key, config.mixstyle, apply_model=apply_model)
    return state.replace(moving_average=average)


def predicting(state):
    """The state whose ``params`` and ``batch_stats`` the run predicts with: its moving
    average's where it keeps one, else the state itself."""
    average = state.moving_average
    if not isinstance(average, MovingAverage):
        return state
    return state.replace(params=average.params, batch_stats=average.batch_stats)


def describe(config, state) -> dict:
    """What a record of a moving-average run says of its average: the start ``S``, the
    averaging updates so far (``count``) and the 0-based steps whose weights it averages
    (``first_step`` -1: the initial weights)."""
    count, step = int(state.moving_average.count), int(state.step) - 1
    start = int(config.moving_average_start)
    return {
        "start": start,
        "count": count,
        "first_step": start - 2 if count else step,
        "last_step": step,
    }
