"""SAGM, SAM and GSAM as optax gradient transformations, and the paper's optimizer.

This module owns the update rules, as the authors' released code computes them
(docs/protocol.md tabulates them with the training protocol). Each rule is an
``optax.GradientTransformationExtraArgs`` whose ``update`` receives the clean
gradient ``g = grad L_B(w)`` as ``updates`` and a ``grad_fn(params, i) -> grads``
extra argument (the opaque-mode convention of ``optax.contrib.sam``; ``i`` is the
index of the extra gradient evaluation, always 0 here). It returns a combined
direction ``d`` that the next member of an ``optax.chain`` consumes at the
unperturbed ``w``::

    opt = optax.chain(sagm(rho=0.05, alpha=1e-3),
                      optax.add_decayed_weights(1e-4),
                      optax.adam(3e-5))
    grad_fn = lambda p, i: jax.grad(loss)(p, batch)      # same batch as g
    updates, state = opt.update(jax.grad(loss)(params, batch), state, params,
                                grad_fn=grad_fn)

Notation: ``||x||`` is the global L2 norm of a pytree, computed like the
reference (the norm of the per-leaf norms); ``eps = 1e-12``.

Data parallelism. ``perturbation="global"`` (default) perturbs with the gradient
of the whole global batch, which is what the single-device reference does. Under
``jax.jit`` with the batch sharded on a mesh nothing else is needed: the gradient
of the global-batch loss is already averaged across devices. Inside ``shard_map``
or ``pmap`` pass ``axis_name``; the clean and the perturbed gradients are then
averaged (``pmean``) before use, so the result again equals one device's. There
``grad_fn`` and ``updates`` must be each device's OWN shard gradient, as ``pmap``
gives; use ``shard_map(..., check_vma=False)``, because with ``check_vma=True``
JAX already sums the gradients of replicated parameters over the axis.
``perturbation="per_device"`` is a DIFFERENT algorithm (m-sharpness, as in the
SAM authors' JAX code): each device perturbs with its own shard's gradient,
computes its own direction, and the directions are averaged over ``axis_name``.

DISAM (Zhang et al., ICLR 2024; docs/methods.md, "DISAM"). Every head
also accepts an ``ascent_grads`` extra argument, a pytree like ``g`` (or None):
when given, the ascent step ``e`` is built from it instead of ``g``, while the
descent direction keeps the clean ``g`` (SAGM's ``disam_descent="variance"``
aside). DISAM passes ``g_DI = grad(L_bar - lambda V)`` there, the gradient of
:func:`disam_ascent_objective`; plain chains (ERM's) ignore the argument, as
``optax.chain`` drops extra arguments for members that take none. In global mode
inside ``shard_map``/``pmap`` the heads ``pmean`` ``ascent_grads`` like ``g``;
that equals one device's ``g_DI`` only when the per-domain losses in the
cotangents are the GLOBAL ones (``pmean`` them first), since ``g_DI`` is not
linear in them.

Order in a chain. A head must be the FIRST member of its ``optax.chain``: its
``updates`` are taken to be the clean gradient ``g`` of ``grad_fn``'s loss. Placed
after ``optax.adam`` it would perturb along Adam's normalised step instead and return
a mix of a step and a gradient for nothing to consume, silently. The transforms cannot
check their place at run time: a transform sees neither the chain nor the members
before it, and comparing ``updates`` with ``grad_fn(params, 0)`` would cost one more
gradient per step and still be unsound, because a member before the head may change
the gradient on purpose (clipping, coupled weight decay added to it) and numerics
(bfloat16, another device mesh) differ in the last bits. ``rule_optimizer`` builds
the chains of this package in the right order.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.registry import (
    RHO_MAX,
    Hyperparameter,
    Method,
    UpdateRule,
    bounds,
    choice,
    fixed,
    register_update_rule,
    settings,
    update_rule,
)

GradFn = Callable[[optax.Params, int], optax.Updates]
ScalarOrSchedule = Union[float, optax.Schedule]

# The perturbation radius of every sharpness-aware rule: the paper's, for every dataset
# (and SAM's and GSAM's usual one); the config's, the search's and the transforms' default.
RHO = 0.05

# SAGM's alpha: the paper's PACS/VLCS/TerraIncognita value (its OfficeHome and DomainNet
# runs use 5e-4; configs/<dataset>.py).
SAGM_ALPHA = 1e-3
# GSAM's alpha: Zhuang et al. (ICLR 2022) use 0.01 for the ResNets they train (their
# appendix's hyperparameter table; the larger values in the authors' released code are
# for other models: 0.2 in the PyTorch CIFAR-10 example, github.com/juntang-zhuang/GSAM
# example/train.py, and 0.6 for ViT-B/32, big_vision's configs/proj/gsam). It is not
# SAGM's alpha: SAGM's shortens the ascent step, GSAM's weighs the ascent along the part
# of the clean gradient orthogonal to the perturbed one; with SAGM's 1e-3, GSAM is SAM.
GSAM_ALPHA = 0.01


class SharpnessAwareState(NamedTuple):
    """State of every rule here: the number of updates so far (a rho schedule's step)."""

    count: jax.Array


def global_norm(tree) -> jax.Array:
    """``||x|| = sqrt(sum_leaves ||leaf||^2)``, as the norm of the per-leaf norms.

    The reference takes ``torch.norm`` of the stacked per-tensor norms; a flat
    ``sqrt(sum(x**2))`` differs from it by about 1e-7 relative in float32.
    """
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    leaf_norms = [
        jnp.linalg.norm(jnp.ravel(x).astype(jnp.promote_types(x.dtype, jnp.float32)))
        for x in leaves
    ]
    return jnp.linalg.norm(jnp.stack(leaf_norms))


def _vdot(a, b) -> jax.Array:
    """``<a, b>`` summed over every leaf of two pytrees of the same structure."""
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _axpy(scale, x, y):
    """``scale * x + y`` leaf by leaf, keeping each leaf's dtype."""
    return jax.tree.map(lambda a, b: (scale * a + b).astype(b.dtype), x, y)


def perturbation_vector(grads, params, rho, alpha=0.0, eps=1e-12, adaptive=False):
    """The ascent step ``e`` of SAM (``alpha = 0``) and SAGM, as a constant.

    Plain:     ``e = (rho / (||g|| + eps) - alpha) * g``.
    Adaptive:  ``e = (rho / (|| |w| * g || + eps) - alpha) * w**2 * g``.

    ``alpha`` multiplies the RAW gradient, so the scale is negative when
    ``||g|| > rho / alpha``; that is what the reference computes. No gradient
    flows through ``e``.
    """
    if adaptive:
        norm = global_norm(jax.tree.map(lambda w, g: jnp.abs(w) * g, params, grads))
        scale = rho / (norm + eps) - alpha
        e = jax.tree.map(lambda w, g: scale * jnp.square(w) * g, params, grads)
    else:
        scale = rho / (global_norm(grads) + eps) - alpha
        e = jax.tree.map(lambda g: scale * g, grads)
    return jax.lax.stop_gradient(e)


def domain_loss_variance(domain_losses) -> jax.Array:
    """``V = (1/M) sum_k (L_k - L_bar)^2``, the population variance of the M per-domain
    losses ``L_k`` (``L_bar`` their mean), DISAM's Eq. 8 and VREx's penalty."""
    domain_losses = jnp.asarray(domain_losses)
    return jnp.mean(jnp.square(domain_losses - jnp.mean(domain_losses)))


def disam_ascent_objective(domain_losses, lam) -> jax.Array:
    """DISAM's ascent objective ``L_bar - lam * V`` (Zhang et al., ICLR 2024, Eq. 8).

    ``domain_losses`` is the vector ``(L_1, ..., L_M)`` of the mean losses of the M
    domain minibatches (equal sizes, as DomainBed draws them), ``L_bar`` its mean and
    ``V`` :func:`domain_loss_variance`. Its gradient is the ascent gradient::

        g_DI = sum_k (1/M - (2 lam / M) (L_k - L_bar)) grad L_k

    since ``dV/dL_k = (2/M)(L_k - L_bar) - (2/M^2) sum_j (L_j - L_bar)`` and the sum
    vanishes. For ``lam > 0`` a domain whose loss is above the mean weighs less in
    the ascent (negatively once ``2 lam (L_k - L_bar) > 1``), so ``e`` is not led by
    the worst-fitted domains: DISAM's domain-balanced sharpness estimate.

    One forward serves ``g`` and ``g_DI``: both are vector-Jacobian products of the
    per-domain loss vector, with cotangents ``1/M`` and ``grad`` of this function::

        losses, vjp = jax.vjp(per_domain_losses, params)
        (g,) = vjp(jnp.full_like(losses, 1 / losses.size))
        (g_di,) = vjp(jax.grad(disam_ascent_objective)(losses, lam))
        opt.update(g, state, params, grad_fn=grad_fn, ascent_grads=g_di)

    Inside ``shard_map``/``pmap`` the cotangents must use the GLOBAL losses
    (``pmean`` them over the device axis first); the heads then ``pmean`` ``g_di``.
    DISAM's public code weighs each domain by its count in a mixed batch; with equal
    counts that is this ``V``. ``lam = 0`` gives ``L_bar``: plain SAM/SAGM.
    """
    domain_losses = jnp.asarray(domain_losses)
    return jnp.mean(domain_losses) - lam * domain_loss_variance(domain_losses)


def _value(rho: ScalarOrSchedule, count):
    return rho(count) if callable(rho) else rho


def _check_rho(rho: ScalarOrSchedule) -> None:
    """A number rho must be finite, >= 0 and at most the config's ``RHO_MAX`` (a schedule
    is the caller's to bound; 0 is the config's to refuse for a rule that perturbs)."""
    if isinstance(rho, numbers.Real) and not isinstance(rho, bool):
        if not (math.isfinite(rho) and rho >= 0):
            raise ValueError(
                f"rho={rho!r}: expected a finite number >= 0 (the radius of the "
                "perturbation), or an optax schedule of the update count."
            )
        if rho > RHO_MAX:
            raise ValueError(
                f"rho={rho!r}: expected a finite number in [0, {RHO_MAX:g}] (the radius of "
                "the perturbation; published radii are 0.01-0.1, ASAM's up to 2)."
            )


def _check_hyperparameter(function: str, argument: str, value, hp: Hyperparameter) -> None:
    """ValueError unless a Python number ``value`` is within ``hp.bounds``, the registry's
    bounds that the config checks too (``registry.bounds``). A traced value
    (a pack's hyperparameter inside ``jit``) has none to check."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if expected := bounds(hp.bounds, hp.note)(value, None, None):
            raise ValueError(
                f"{function}({argument}={value!r}): expected {expected} (the config's "
                f"{hp.key})."
            )


def _check_choice(argument: str, value, choices: dict[str, str]) -> None:
    """ValueError unless ``value`` is a key of ``choices`` (a value -> what it means)."""
    if value not in choices:
        expected = " or ".join(f"{k!r} ({meaning})" for k, meaning in choices.items())
        raise ValueError(f"{argument}={value!r}: expected {expected}.")


def _check_mode(perturbation_mode: str, axis_name: Optional[str]):
    if perturbation_mode not in ("global", "per_device"):
        raise ValueError(f"perturbation={perturbation_mode!r}: expected 'global' or 'per_device'.")
    if perturbation_mode == "per_device" and axis_name is None:
        raise ValueError(
            "perturbation='per_device' needs axis_name: the name of the device axis of "
            "the shard_map or pmap the update runs in."
        )


def _sharpness_aware(
    direction_fn,
    rho,
    eps,
    adaptive,
    alpha_in_perturbation,
    perturbation_mode,
    axis_name,
    descent_from_ascent=False,
):
    """Shared skeleton: clean g, ascent e, perturbed g_p, then ``direction_fn(g, g_p)``.

    ``e`` is built from the ``ascent_grads`` extra argument when one is passed (DISAM's
    ``g_DI``), else from ``g``. ``descent_from_ascent`` hands that ascent gradient to
    ``direction_fn`` in place of ``g`` (SAGM's ``disam_descent="variance"``).
    """
    _check_mode(perturbation_mode, axis_name)
    _check_rho(rho)
    global_sync = perturbation_mode == "global" and axis_name is not None

    def init_fn(params):
        del params
        return SharpnessAwareState(count=jnp.zeros([], jnp.int32))

    def update_fn(
        updates,
        state,
        params=None,
        *,
        grad_fn: Optional[GradFn] = None,
        ascent_grads: Optional[optax.Updates] = None,
        **extra_args,
    ):
        del extra_args
        if params is None:
            raise ValueError("This transformation needs params (the unperturbed w).")
        if grad_fn is None:
            raise ValueError(
                "This transformation needs grad_fn=lambda params, i: grads, the gradient "
                "of the SAME minibatch's loss at the given params (optax.contrib.sam's "
                "opaque-mode convention)."
            )
        grads, ascent = updates, ascent_grads
        if global_sync:  # one all-reduce; a None ascent_grads is an empty pytree
            grads, ascent = jax.lax.pmean((grads, ascent), axis_name)
        if ascent is None:
            ascent = grads
        e = perturbation_vector(
            ascent, params, _value(rho, state.count), alpha_in_perturbation, eps, adaptive
        )
        perturbed_grads = grad_fn(_axpy(1.0, e, params), 0)
        if global_sync:
            perturbed_grads = jax.lax.pmean(perturbed_grads, axis_name)
        direction = direction_fn(ascent if descent_from_ascent else grads, perturbed_grads)
        if perturbation_mode == "per_device":
            direction = jax.lax.pmean(direction, axis_name)
        direction = jax.tree.map(lambda d, g: d.astype(g.dtype), direction, updates)
        return direction, SharpnessAwareState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sagm(
    rho: ScalarOrSchedule = RHO,
    alpha: float = SAGM_ALPHA,
    *,
    eps: float = 1e-12,
    adaptive: bool = False,
    combine: str = "mean",
    disam_descent: str = "clean",
    perturbation: str = "global",
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
    """Sharpness-Aware Gradient Matching (Wang et al., CVPR 2023), as its code computes it.

    The first member of its ``optax.chain`` (the module docstring, "Order in a chain"):
    ``updates`` must be the clean gradient.

    1. ``g = grad L_B(w)`` (the ``updates`` passed in).
    2. ``e = (rho / (||g|| + eps) - alpha) * g``  (see :func:`perturbation_vector`).
    3. ``g_p = grad L_B(w + e)`` on the same batch (``grad_fn``).
    4. ``d = 0.5 * (g + g_p)`` (``combine="mean"``, the released code) or
       ``d = g + g_p`` (``combine="sum"``, the gradient of the paper's objective
       ``L(w) + L(w + e)``: twice as large, which Adam nearly ignores but its
       epsilon and coupled weight decay do not).

    With ``alpha = 0`` this is the "ERM + SAM" ablation: ``0.5 * (g + g_sam)``.

    DISAM-SAGM (our definition; DISAM's public code never ran one): with the extra
    argument ``ascent_grads = g_DI`` (:func:`disam_ascent_objective`), step 2 becomes
    ``e = (rho / (||g_DI|| + eps) - alpha) * g_DI`` and step 4 keeps the clean ``g``
    (``disam_descent="clean"``), or uses ``d = 0.5 * (g_DI + g_p)``
    (``disam_descent="variance"``, what one closure returning ``L - lambda V`` would
    give in SAGM's code). Without ``ascent_grads`` the option changes nothing.

    Args:
      rho: perturbation radius, a finite float in [0, 10] (the config's bound; else
        ValueError) or an optax schedule of the update count.
      alpha: weight of the raw gradient subtracted in the ascent step, in [0, 1) (the
        config's ``alpha``; else ValueError).
      eps: added to the norm, so a zero gradient gives ``e = 0``, not NaN.
      adaptive: ASAM-style scaling by ``|w|`` (off in every experiment of the paper).
      combine: ``"mean"`` or ``"sum"``.
      disam_descent: ``"clean"`` or ``"variance"``: the gradient ``d`` adds to ``g_p``
        when ``ascent_grads`` is passed (see above).
      perturbation: ``"global"`` or ``"per_device"`` (m-sharpness, a different
        algorithm; see the module docstring).
      axis_name: the device axis inside ``shard_map``/``pmap``; None under ``jit``.

    Example::

      >>> import jax, jax.numpy as jnp, optax, sagm_jax
      >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
      >>> opt = optax.chain(sagm_jax.sagm(rho=0.05, alpha=1e-3), optax.sgd(0.1))
      >>> w = jnp.zeros(3); state = opt.init(w)
      >>> d, state = opt.update(jax.grad(loss)(w), state, w,
      ...                       grad_fn=lambda p, i: jax.grad(loss)(p))
    """
    _check_hyperparameter("sagm", "alpha", alpha, _SAGM_ALPHA)
    _check_choice("combine", combine, {"mean": "the released code", "sum": "the paper's objective"})
    _check_choice("disam_descent", disam_descent,
                  {"clean": "d from the clean g", "variance": "d from DISAM's g_DI"})
    weight = 0.5 if combine == "mean" else 1.0

    def direction(g, g_p):
        return jax.tree.map(lambda a, b: weight * (a + b), g, g_p)

    return _sharpness_aware(
        direction,
        rho,
        eps,
        adaptive,
        alpha,
        perturbation,
        axis_name,
        descent_from_ascent=disam_descent == "variance",
    )


def sam(
    rho: ScalarOrSchedule = RHO,
    *,
    eps: float = 1e-12,
    adaptive: bool = False,
    perturbation: str = "global",
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
    """Sharpness-Aware Minimization (Foret et al., ICLR 2021).

    The first member of its ``optax.chain``, as :func:`sagm`.

    ``e = rho * g / (||g|| + eps)``; ``d = g_p = grad L_B(w + e)``, consumed at
    the unperturbed ``w``. ``adaptive=True`` gives ASAM's
    ``e = rho * w**2 * g / (|| |w| * g || + eps)``. With the extra argument
    ``ascent_grads = g_DI`` (DISAM, the public code's SAM path) ``e`` is built from
    ``g_DI`` and ``d = g_p`` as before. Other arguments as :func:`sagm`.
    """
    return _sharpness_aware(lambda g, g_p: g_p, rho, eps, adaptive, 0.0, perturbation, axis_name)


def gsam(
    rho: ScalarOrSchedule = RHO,
    alpha: float = GSAM_ALPHA,
    *,
    eps: float = 1e-12,
    adaptive: bool = False,
    perturbation: str = "global",
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
    """Surrogate-gap guided SAM (Zhuang et al., ICLR 2022).

    The first member of its ``optax.chain``, as :func:`sagm`.

    ``e = rho * g / (||g|| + eps)``, ``g_p = grad L_B(w + e)``, then the part of
    the clean gradient orthogonal to ``g_p`` is subtracted::

        cos    = <g, g_p> / (||g|| * ||g_p|| + eps)
        g_perp = g - cos * ||g|| * g_p / (||g_p|| + eps)
        d      = g_p - alpha * g_perp

    This is the authors' PyTorch form, with ``eps`` in both norms: up to ``eps``
    it is ``g_perp = g - (<g, g_p> / ||g_p||^2) g_p``, and a zero ``g`` or
    ``g_p`` gives a finite direction. For rho that follows a learning-rate
    schedule, pass :func:`gsam_rho_schedule`. With the extra argument
    ``ascent_grads = g_DI`` (DISAM) ``e`` is built from ``g_DI`` as in :func:`sam`,
    and ``g_perp`` still decomposes the clean ``g``. Other arguments as :func:`sagm`;
    ``alpha`` in [0, 1] (the config's ``gsam_alpha``), else ValueError.
    """
    _check_hyperparameter("gsam", "alpha", alpha, _GSAM_ALPHA)

    def direction(g, g_p):
        g_norm, g_p_norm = global_norm(g), global_norm(g_p)
        cosine = _vdot(g, g_p) / (g_norm * g_p_norm + eps)
        along = cosine * g_norm / (g_p_norm + eps)
        return jax.tree.map(lambda a, b: b - alpha * (a - along * b), g, g_p)

    return _sharpness_aware(direction, rho, eps, adaptive, 0.0, perturbation, axis_name)


def gsam_rho_schedule(
    learning_rate: optax.Schedule, rho_max: float, rho_min: float, lr_max: float, lr_min: float
) -> optax.Schedule:
    """GSAM's rho that follows the learning rate.

    ``rho_t = rho_min + (rho_max - rho_min) * (lr_t - lr_min) / (lr_max - lr_min)``,
    and ``rho_max`` when ``lr_max == lr_min`` (a constant learning rate).
    """
    if lr_max == lr_min:
        return optax.constant_schedule(rho_max)

    def schedule(count):
        return rho_min + (rho_max - rho_min) * (learning_rate(count) - lr_min) / (lr_max - lr_min)

    return schedule


def mean_over_devices(axis_name: str) -> optax.GradientTransformation:
    """Replaces the updates by their mean over the devices of ``axis_name`` (inside
    ``shard_map`` or ``pmap``)."""
    _check_mode("per_device", axis_name)
    return optax.stateless(lambda updates, params=None: jax.lax.pmean(updates, axis_name))


def rule_optimizer(
    algorithm: str,
    hp,
    *,
    learning_rate: ScalarOrSchedule,
    weight_decay: float,
    adaptive: bool = False,
    perturbation: str = "global",
    axis_name: Optional[str] = None,
    decay_mask=None,
    group_learning_rates=None,
) -> optax.GradientTransformationExtraArgs:
    """The registered plain or head rule ``algorithm``: its transforms (its entry's
    ``build`` with its hyperparameters read from ``hp`` by key, the registry's defaults
    for missing keys), then PyTorch's ``Adam(lr, weight_decay)``.

    PyTorch's Adam decay is COUPLED L2 (not AdamW), added after the head at the
    unperturbed ``w``, so it never enters ``g`` or the perturbation::

        d' = d + weight_decay * w
        m, v = Adam moments of d' (b1 0.9, b2 0.999);  step = -lr * m_hat / (sqrt(v_hat) + 1e-8)

    The chain always accepts ``grad_fn`` and ``ascent_grads`` (DISAM's ``g_DI``); ERM
    uses neither, so one train step serves every rule. ``adaptive``, ``perturbation``
    and ``axis_name`` go to every head (see :func:`sagm`). ``decay_mask`` (optax's
    ``add_decayed_weights`` mask) leaves a method's frozen parameters out of the decay
    (``sagm_jax.methods.networks.decay_mask``).

    ``group_learning_rates``: an optax transformation after the learning rate that scales
    a parameter group's updates by k, so the group steps at ``k * lr`` in the same Adam
    (MIRO's encoders at ``lr * lr_mult``: ``sagm_jax.methods.networks.scale_own_updates``).
    Exact for PyTorch's Adam with coupled decay: a parameter group's ``lr`` enters its
    step only as the last factor (the moments of ``d + wd * w`` do not read it), so
    ``step(k * lr) = k * step(lr)``.
    """
    rule = update_rule(algorithm)
    if rule.kind == "procedure":
        raise ValueError(
            f"algorithm={algorithm!r} is a procedure (sagm_jax.methods.procedures."
            "make_procedure builds it); expected a plain or sharpness-aware rule."
        )
    head = rule.build(
        settings(rule.method, hp), adaptive=adaptive, perturbation=perturbation,
        axis_name=axis_name,
    )
    return optax.chain(
        *head,
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
        optax.scale_by_learning_rate(learning_rate),
        *([] if group_learning_rates is None else [group_learning_rates]),
    )


def paper_optimizer(
    algorithm: str,
    *,
    learning_rate: ScalarOrSchedule,
    weight_decay: float,
    rho: ScalarOrSchedule = RHO,
    alpha: Optional[float] = None,
    combine: str = "mean",
    disam_descent: str = "clean",
    adaptive: bool = False,
    perturbation: str = "global",
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
    """The paper's whole optimizer: the algorithm's head, then PyTorch's ``Adam(lr,
    weight_decay)`` (:func:`rule_optimizer`, with the hyperparameters as arguments).

    Args:
      algorithm: ``erm | sam | gsam | sagm | erm_sam`` (``erm_sam`` is SAGM with
        ``alpha = 0``, Table 3's "ERM + SAM"), or a registered plain or head rule.
      learning_rate: a float or an optax schedule (constant in the paper).
      weight_decay: coupled L2 coefficient.
      rho: perturbation radius (ignored by ERM).
      alpha: SAGM's or GSAM's alpha (two different quantities: config keys ``alpha``
        and ``gsam_alpha``); defaults :data:`SAGM_ALPHA` and :data:`GSAM_ALPHA`.
      combine, adaptive, perturbation, axis_name: see :func:`sagm`.
      disam_descent: SAGM's (and ``erm_sam``'s) descent under DISAM, see
        :func:`sagm`; SAM and GSAM have one descent (``g_p``, and GSAM's ``g``
        decomposition stays clean), so for them, and for ERM, it changes nothing.
    """
    hp = {"rho": rho, "combine": combine, "disam_descent": disam_descent}
    if alpha is not None:
        hp["alpha"] = hp["gsam_alpha"] = alpha
    return rule_optimizer(
        algorithm, hp, learning_rate=learning_rate, weight_decay=weight_decay,
        adaptive=adaptive, perturbation=perturbation, axis_name=axis_name,
    )


# --- the registry's entries --------------------------------------------------------

RHO_HYPERPARAMETER = Hyperparameter(
    "rho", RHO, "radius of the perturbation (SAM, GSAM, SAGM)", ">= 0", fixed(RHO)
)
# e = (rho/||g|| - alpha) g: alpha is the step size of SAGM's descent term. Below 0 that
# term ascends too and e outgrows the rho-ball with ||g||; at 1 or more it is a whole
# gradient step or more, larger than any learning rate here (the paper: 5e-4, 1e-3; its
# code's search: up to 0.1). The search draws the paper's two values.
_SAGM_ALPHA = Hyperparameter(
    "alpha", SAGM_ALPHA, "SAGM's alpha, in its ascent step e = (rho/||g|| - alpha) g",
    "[0, 1)", choice((1e-3, 5e-4)),
    note=" (SAGM's descent step size in e = (rho/||g|| - alpha) g; the paper uses 5e-4 or "
    "1e-3; a negative alpha lengthens the ascent step beyond the rho-ball)",
)
# d = g_p - alpha g_perp: below 0 GSAM descends the surrogate gap's ascent direction (the
# opposite of GSAM); above 1 the orthogonal step outweighs SAM's.
_GSAM_ALPHA = Hyperparameter(
    "gsam_alpha", GSAM_ALPHA,
    "GSAM's alpha (its paper's setting for ResNets), in d = g_p - alpha g_perp", "[0, 1]",
    fixed(GSAM_ALPHA),
    note=" (GSAM's weight of the orthogonal ascent in d = g_p - alpha g_perp; 0 is SAM, its "
    f"paper's setting for ResNets is {GSAM_ALPHA:g})",
)
_COMBINE = Hyperparameter(
    "combine", "mean", 'SAGM: "mean" (the released code) or "sum" (the paper\'s text)',
    "one of mean, sum",
)
_DISAM_DESCENT = Hyperparameter(
    "disam_descent", "clean",
    'DISAM on SAGM: "clean" (d = (g + g_p)/2) or "variance" (g_DI in place of g)',
    "one of clean, variance",
)


def _erm_head(hp, *, perturbation, axis_name, adaptive):
    """No head. Per device, ERM's gradient is the shard's: average it as the heads
    average their direction, so every device applies the same update."""
    del hp, adaptive
    return [mean_over_devices(axis_name)] if perturbation == "per_device" else []


def _sagm_head(alpha_zero: bool):
    def build(hp, **common):
        alpha = 0.0 if alpha_zero else hp["alpha"]
        return [sagm(hp["rho"], alpha, combine=hp["combine"],
                     disam_descent=hp["disam_descent"], **common)]

    return build


register_update_rule(UpdateRule(
    Method("erm", "ERM", (), "Adam on the objective's gradient", "DomainBed",
           (85.5, 77.3, 66.5, 46.1, 43.8, 63.9, "SAGM paper")),
    "plain", _erm_head,
))
register_update_rule(UpdateRule(
    Method("sam", "SAM", (RHO_HYPERPARAMETER,), "gradient at w + rho g/||g||",
           "Foret et al. 2021"),
    "head", lambda hp, **common: [sam(hp["rho"], **common)], disam=True,
))
register_update_rule(UpdateRule(
    Method("gsam", "GSAM", (RHO_HYPERPARAMETER, _GSAM_ALPHA),
           "SAM minus alpha times the clean gradient's part orthogonal to it",
           "Zhuang et al. 2022"),
    "head", lambda hp, **common: [gsam(hp["rho"], hp["gsam_alpha"], **common)], disam=True,
))
register_update_rule(UpdateRule(
    Method("sagm", "SAGM", (RHO_HYPERPARAMETER, _SAGM_ALPHA, _COMBINE, _DISAM_DESCENT),
           "mean of the gradients at w and at w + (rho/||g|| - alpha) g", "Wang et al. 2023",
           (86.6, 80.0, 70.1, 48.8, 45.0, 66.1, "SAGM paper")),
    # SAGM's released code runs its clean pass without MixStyle.
    "head", _sagm_head(alpha_zero=False), disam=True, clean_pass_mixstyle=False,
))
register_update_rule(UpdateRule(
    Method("erm_sam", "ERM + SAM", (RHO_HYPERPARAMETER, _COMBINE, _DISAM_DESCENT),
           "SAGM with alpha 0 (the paper's Table 3)", "Wang et al. 2023"),
    "head", _sagm_head(alpha_zero=True),
))

# The rules this module registers, which :func:`paper_optimizer` builds (``erm_sam`` is
# SAGM with ``alpha = 0``, the paper's Table 3 "ERM + SAM").
ALGORITHMS = ("erm", "sam", "gsam", "sagm", "erm_sam")
