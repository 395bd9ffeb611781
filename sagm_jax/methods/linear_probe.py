"""The linear probe: the classifier trained alone, by an Adam of its own, for the first
``linear_steps`` updates of a run; the run's own update rule from then on.

This module owns the optax transformation that wraps a run's update rule (its head, its
coupled decay, its Adam: ``update_rules.rule_optimizer``'s chain) with the probe, as

* DiWA's linear probing (``alexrame/diwa`` ``domainbed/algorithms.py``, ``ERM`` with its
  ``init_step``): ``parameters_to_be_optimized = self.classifier.parameters()``, an Adam
  on the classifier alone, for a whole run (``linear_steps >= steps``);
* ERM++'s linear phase (``facebookresearch/DomainBed`` ``domainbed/algorithms.py``,
  ``ERMPlusPlus.update``): ``self.linear_optimizer`` (an Adam over ``self.network[1]``,
  the classifier, at ``linear_lr``) while ``self.global_iter > linear_steps`` is False,
  then ``self.optimizer`` (the whole network) from a state it has never stepped.

The math, at update ``t`` (counted from 0) with the clean gradient ``g = grad L_B(w)`` of
the run's objective over the whole network (the forward is the training one: dropout,
and BatchNorm statistics where they train, as the reference's ``self.network(all_x)``)::

    t <  linear_steps:  c = params['classifier']
                        d = g_c + weight_decay * c            (torch's coupled decay)
                        m, v = Adam moments of d (b1 0.9, b2 0.999)
                        c <- c - lr_probe * m_hat / (sqrt(v_hat) + 1e-8)
                        every other parameter: unchanged (a zero update, bit-identical)
                        the rule's state: untouched (its ``init``)
    t >= linear_steps:  the rule's update from its state, which at t = linear_steps is
                        still its ``init``: PyTorch's optimizers keep no state before
                        their first ``step()``, so the rule starts fresh (its Adam's
                        moments zero, its bias correction at 1, a head's count at 0).

``lr_probe`` is ``linear_lr``, or the run's ``lr`` where ``linear_lr`` is 0. The head of
a sharpness-aware rule is not called during the probe (the phase is a ``lax.cond``), so
a probe step costs one gradient. ``linear_steps`` and the rates may be traced scalars (a
pack's per-run values): the phase is chosen on the device.

The reference's count: ``ERMPlusPlus`` compares ``global_iter``, the number of updates
BEFORE this one, with ``>``, so it runs ``linear_steps + 1`` linear updates; this
module's ``linear_steps`` is the number of linear updates (ERM++'s preset sets the
reference's value plus one).

The phase is read from the train step's ``step`` (an extra argument of ``update``; the
transformation's own count where none is given), so an objective that restarts the whole
optimizer state (IRM's, VREx's anneal) does not restart the probe's phase.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

CLASSIFIER = "classifier"


class LinearProbeState(NamedTuple):
    """``count``: updates so far; ``probe``: the probe's Adam on ``params['classifier']``;
    ``rule``: the run's update rule's state (its ``init`` until the probe ends)."""

    count: jax.Array
    probe: Any
    rule: Any


def probe_learning_rate(linear_lr, lr):
    """``linear_lr``, or ``lr`` where ``linear_lr`` is 0 (traced values too)."""
    if isinstance(linear_lr, (int, float)) and isinstance(lr, (int, float)):
        return float(linear_lr) if linear_lr > 0 else float(lr)
    return jnp.where(jnp.asarray(linear_lr) > 0, linear_lr, lr)


def _classifier(tree, what: str):
    if not isinstance(tree, dict) or CLASSIFIER not in tree:
        keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        raise ValueError(
            f"linear_probe: the {what} have no {CLASSIFIER!r} entry (top-level keys: "
            f"{keys}); the probe trains params['{CLASSIFIER}'], the network's linear head."
        )
    return tree[CLASSIFIER]


def linear_probe(
    rule: optax.GradientTransformation,
    *,
    linear_steps,
    learning_rate,
    weight_decay,
    decay_mask=None,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``rule`` preceded by ``linear_steps`` updates of ``params['classifier']`` alone by
    torch's ``Adam(learning_rate, weight_decay)`` (the module docstring). ``decay_mask``
    (the run's, a function of the params) restricted to the classifier decides which of
    its parameters decay. ``axis_name``: inside ``shard_map`` (the per-device mode), the
    classifier's gradient is averaged over it first, so every device steps the same.
    ``update`` takes the rule's extra arguments (``grad_fn``, ...) and ``step``, the train
    step's count (default: this transformation's own)."""

    def probe_mask(params):
        return None if decay_mask is None else _classifier(decay_mask(params), "decay mask")

    def probe_adam(params):
        return optax.chain(
            optax.add_decayed_weights(weight_decay, mask=probe_mask(params)),
            optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
            optax.scale_by_learning_rate(learning_rate),
        )

    def init_fn(params):
        return LinearProbeState(
            count=jnp.zeros([], jnp.int32),
            probe=probe_adam(params).init(_classifier(params, "parameters")),
            rule=rule.init(params),
        )

    def update_fn(updates, state, params=None, *, step=None, **extra):
        if params is None:
            raise ValueError("linear_probe needs params (the coupled decay reads them).")
        t = state.count if step is None else step

        def probe_phase(_):
            grads = _classifier(updates, "gradients")
            if axis_name is not None:
                grads = jax.lax.pmean(grads, axis_name)
            head, probe = probe_adam(params).update(grads, state.probe, params[CLASSIFIER])
            zero = jax.tree.map(jnp.zeros_like, updates)
            head = jax.tree.map(lambda u, z: u.astype(z.dtype), head, zero[CLASSIFIER])
            return {**zero, CLASSIFIER: head}, probe, state.rule

        def rule_phase(_):
            direction, rule_state = rule.update(updates, state.rule, params, **extra)
            direction = jax.tree.map(lambda d, u: d.astype(u.dtype), direction, updates)
            return direction, state.probe, rule_state

        direction, probe, rule_state = jax.lax.cond(
            t < linear_steps, probe_phase, rule_phase, None
        )
        return direction, LinearProbeState(optax.safe_increment(state.count), probe, rule_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
