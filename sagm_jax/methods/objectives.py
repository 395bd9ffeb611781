"""The objectives: the loss one train step minimises from the per-domain minibatches.

This module owns every objective (ERM, Mixup, CutMix, OrgMixup, CORAL, MMD, GroupDRO, IRM,
VREx), each a loss function with its registry entry beside it
(``registry.register_objective``), as DomainBed's ``domainbed/algorithms.py`` and, for
CutMix and OrgMixup, the SAGM authors' ``Wang-pengfei/SAGM``,
``domainbed/algorithms/algorithms.py``, state them; their random draws (Mixup's pairs
and weights, CutMix's coin, box and permutation, OrgMixup's permutation and weight), their
penalties (public: ``coral_penalty``, ``mmd_penalty``, ``pairwise_penalty``,
``irm_penalty``) and their state (GroupDRO's ``q``; IRM's and VREx's anneal reads the
step counter, and ``reset_optimizer_step`` tells the train step when Adam restarts).

The train step calls ``objective_loss`` once per loss evaluation with a ``forward``
closure, which it calls exactly ONCE on all N = M*b rows:

* ERM, CORAL, MMD, GroupDRO, IRM, VREx forward the concatenated batch and slice the one
  forward per domain (rows ``m*b:(m+1)*b`` are domain m). The reference forwards each
  domain separately for CORAL, MMD and GroupDRO; with frozen BatchNorm the two agree
  except for the dropout draws, whose distribution is the same.
* Mixup forwards the M mixed pairs (b rows each) concatenated in one call, equal to the
  reference's M separate forwards under the same proviso.
* CutMix forwards the pasted batch, OrgMixup the mixed batch (as the reference).

Per-domain statistics reshape the batch to [M, b, ...]. Under ``jax.jit`` with the batch
sharded over devices that reshape is of the GLOBAL batch, so means, covariances, kernels
and domain losses are over each whole domain, never per shard.

Every loss and penalty is computed in float32, whatever the dtype of the features and
logits. The objective's random draws come from ``key``; the train step passes the same
key to the clean and the perturbed pass of a sharpness-aware step, so both differentiate
one loss function.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    log_uniform,
    objective,
    register_objective,
    settings,
)

# DomainBed's Gaussian kernel bandwidths (``AbstractMMD.gaussian_kernel``).
MMD_GAMMAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)
# DomainBed clamps squared distances below at this value before the kernel.
MMD_DISTANCE_FLOOR = 1e-30


class Outputs(NamedTuple):
    """What ``forward(images)`` returns."""

    features: jax.Array  # [N, d] pooled post-dropout features
    logits: jax.Array  # [N, C]
    batch_stats: Any  # passed through untouched
    # ``classify(features) -> logits``: the network's classifier at this pass's parameters
    # (``networks.classify``), for objectives that classify other features (RSC, SelfReg).
    classify: Callable[[jax.Array], jax.Array] | None = None
    # The network's intermediate features of this pass, ``{name: array}`` (``"stem"``,
    # ``"block1"``, ...; ``sagm_jax.models.resnet.INTERMEDIATES``), when the objective
    # called ``forward(images, intermediates=True)``; None otherwise.
    intermediates: Any = None
    # ``intermediates_at(variables, images) -> {name: array}``: the run's network in
    # evaluation mode at other ``variables`` (``{"params", "batch_stats"}``, a copy a
    # method keeps: MIRO's frozen oracle), its intermediate features on ``images``.
    intermediates_at: Callable[[Any, jax.Array], dict] | None = None


class Aux(NamedTuple):
    """The auxiliary output of ``objective_loss``."""

    state: dict  # the objective state after this step
    metrics: dict  # scalars; "loss" is the value the reference reports
    domain_losses: jax.Array  # [M] terms whose mean is the objective's data term
    batch_stats: Any  # from the one forward


class CutMixDraws(NamedTuple):
    """One CutMix draw for a whole batch (the SAGM repository's ``CutMix``)."""

    apply: jax.Array  # bool scalar: the coin said cut (and beta > 0)
    lam_box: jax.Array  # float32: 1 - box area / (H * W), the weight of the own labels
    perm: jax.Array  # [N] int32: row i receives its box from row perm[i]
    box: jax.Array  # [4] int32: (a1, a2, b1, b2), rows a1:a2 of H and columns b1:b2 of W


class Step(NamedTuple):
    """What an objective's loss reads: ``hp`` its hyperparameters (defaults filled in),
    ``forward`` (call it once), ``images`` [N, H, W, C] and ``labels`` [N] of the
    ``num_domains`` minibatches in order, its ``state``, the ``step`` counter, ``key`` for
    its random draws, ``advance`` (see :func:`objective_loss`) and ``params``, the
    parameters this pass evaluates (the method's own under ``params["method"]``,
    ``sagm_jax.methods.networks``). ``forward(images, intermediates=True)`` also fills
    ``Outputs.intermediates`` (MIRO). ``forward_at(params) -> forward`` is the same pass
    (the same dropout and MixStyle draws) at other parameters, for a loss that
    differentiates the network itself (IGA's per-domain gradients); call it instead of
    ``forward`` (IGA calls it once per domain, on that domain's rows); None where the
    caller gives none."""

    hp: dict
    forward: Callable[[jax.Array], Outputs]
    images: jax.Array
    labels: jax.Array
    num_domains: int
    state: dict
    step: jax.Array
    key: jax.Array
    advance: bool
    params: Any = None
    forward_at: Callable[[Any], Callable[[jax.Array], Outputs]] | None = None


def init_state(name: str, num_domains: int) -> dict:
    """The objective's state before the first step (its entry's ``init_state``:
    GroupDRO's q = ones(M)), else {}."""
    entry = objective(name)
    return {} if entry.init_state is None else entry.init_state(num_domains)


def reset_optimizer_step(name: str, hp: dict) -> int | tuple | None:
    """The step before whose update a fresh optimizer replaces the old one: the value of
    the entry's ``restart_key`` (IRM's and VREx's anneal length A; the reference replaces
    Adam before the update of step A, whose penalty weight first is lambda), a tuple of
    steps for a tuple of keys (IB_IRM's two anneals). None for the objectives that never
    reset it."""
    entry = objective(name)
    if entry.restart_key is None:
        return None
    values = settings(entry.method, hp)  # traced in a pack
    if isinstance(entry.restart_key, tuple):
        return tuple(values[key] for key in entry.restart_key)
    return values[entry.restart_key]


def objective_loss(
    name: str, hp: dict, forward, images, labels, *, num_domains: int, state: dict,
    step, key, advance: bool, params=None, forward_at=None,
) -> tuple[jax.Array, Aux]:
    """The loss of ``objective`` on one step's batch, and its ``Aux``.

    ``images`` [N, H, W, C] (augmented, normalized) and ``labels`` [N] hold the
    ``num_domains`` minibatches of b = N / M rows in ascending environment order.
    ``forward(images) -> Outputs`` is called exactly once. ``step`` is the number of
    updates before this one (IRM's and VREx's counter), ``key`` the objective's random
    draws (Mixup, CutMix). ``advance`` is True for the clean pass, whose state (GroupDRO's
    q) advances once per step; False for a second evaluation of the same step's loss,
    which uses ``state`` (already advanced) as given. ``params`` are the parameters
    ``forward`` evaluates at, for objectives that train modules of their own;
    ``forward_at(params)`` the pass at other parameters (``Step.forward_at``).
    """
    entry = objective(name)
    if images.shape[0] % num_domains:
        raise ValueError(
            f"{images.shape[0]} rows do not split into {num_domains} equal domain minibatches"
        )
    hp = settings(entry.method, hp)
    return entry.loss(
        Step(hp, forward, images, labels, num_domains, state, step, key, advance, params,
             forward_at)
    )


# ----------------------------------------------------------------------------
# Cross-entropy, per domain.


def per_example_cross_entropy(logits, labels) -> jax.Array:
    """Cross-entropy of each example, computed in float32 (the one definition: the
    train step, the evaluator's losses and the sharpness curves use it)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def domain_losses(logits, labels, num_domains: int) -> jax.Array:
    """[M] mean cross-entropy of each domain's rows."""
    return per_example_cross_entropy(logits, labels).reshape(num_domains, -1).mean(axis=1)


def by_domain(x, num_domains: int) -> jax.Array:
    """[N, ...] -> [M, b, ...]."""
    return x.reshape(num_domains, -1, *x.shape[1:])


def _annealed_weight(step, anneal_iters: int, weight: float) -> jax.Array:
    """IRM's and VREx's penalty weight: 1 for steps 0..A-1, ``weight`` from step A on."""
    return jnp.where(step >= anneal_iters, jnp.float32(weight), jnp.float32(1.0))


def make_aux(args: Step, out: Outputs, metrics: dict, losses, state=None) -> Aux:
    """The ``Aux`` of a loss: ``metrics``, the domain terms ``losses``, the forward's
    BatchNorm statistics and ``state`` (``args.state`` when None: unchanged)."""
    return Aux(args.state if state is None else state, metrics, losses, out.batch_stats)


# ----------------------------------------------------------------------------
# ERM (DomainBed's ``ERM``).


def _erm(args: Step):
    """L = CE(f(X), Y) over the concatenated batch = the mean of the domain losses."""
    out = args.forward(args.images)
    losses = domain_losses(out.logits, args.labels, args.num_domains)
    loss = losses.mean()
    return loss, make_aux(args, out, {"loss": loss}, losses)


register_objective(Objective(
    Method("erm", "ERM", (), "mean cross-entropy of the concatenated minibatches",
           "DomainBed", (85.5, 77.5, 66.5, 46.1, 40.9, 63.3, "DomainBed")),
    _erm,
))


# ----------------------------------------------------------------------------
# Mixup (DomainBed's ``Mixup``).


def mixup_draws(key, num_domains: int, alpha: float):
    """DomainBed's inter-domain pairs and weights: ``(first, second, lam)``.

    pi = a random permutation of the M domains; pair i = (first[i], second[i]) =
    (pi_i, pi_(i+1) mod M), so every domain is once first and once second;
    lam[i] ~ Beta(alpha, alpha), one weight per pair shared by all its rows.
    """
    perm_key, lam_key = jax.random.split(key)
    first = jax.random.permutation(perm_key, num_domains)
    second = jnp.roll(first, -1)
    lam = jax.random.beta(lam_key, alpha, alpha, (num_domains,)).astype(jnp.float32)
    return first, second, lam


def _mixup(args: Step):
    """J = (1/M) sum_i [lam_i CE(f(x~_i), y_first_i) + (1 - lam_i) CE(f(x~_i), y_second_i)],
    x~_i = lam_i x_first_i + (1 - lam_i) x_second_i (pair i of ``mixup_draws``).

    The M mixed minibatches go through one forward, concatenated in pair order;
    ``domain_losses[i]`` is pair i's term (pairs in the order of the pair list)."""
    m = args.num_domains
    first, second, lam = mixup_draws(args.key, m, args.hp["mixup_alpha"])
    x = by_domain(args.images, m).astype(jnp.float32)
    y = by_domain(args.labels, m)
    weight = lam.reshape(m, *([1] * (x.ndim - 1)))
    mixed = weight * x[first] + (1.0 - weight) * x[second]
    out = args.forward(mixed.reshape(args.images.shape).astype(args.images.dtype))
    logits = by_domain(out.logits, m)
    own = jax.vmap(per_example_cross_entropy)(logits, y[first]).mean(axis=1)
    other = jax.vmap(per_example_cross_entropy)(logits, y[second]).mean(axis=1)
    pair_losses = lam * own + (1.0 - lam) * other
    loss = pair_losses.mean()
    return loss, make_aux(args, out, {"loss": loss}, pair_losses)


register_objective(Objective(
    Method("mixup", "Mixup", (
        Hyperparameter("mixup_alpha", 0.2, "Mixup's Beta(alpha, alpha) for the mixing weight",
                       "> 0", log_uniform(-1, 1)),
    ), "inter-domain Mixup: one Beta weight per cyclic pair of shuffled domains",
        "DomainBed (Yan et al. 2020)", (84.6, 77.4, 68.1, 47.9, 39.2, 63.4, "DomainBed")),
    _mixup,
))


# ----------------------------------------------------------------------------
# CutMix (the SAGM repository's ``CutMix``).


def cutmix_box(lam, centre_a, centre_b, height: int, width: int):
    """The SAGM repository's box for area weight ``lam`` centred at (centre_a, centre_b):
    ``(box, lam_box)``.

    c = sqrt(1 - lam); w_a = int(H c), w_b = int(W c);
    a1 = clip(u - w_a//2, 0, H), a2 = clip(u + w_a//2, 0, H), b1, b2 likewise over W;
    lam_box = 1 - (a2 - a1)(b2 - b1) / (H W). The reference calls ``np.int``, which NumPy
    1.24 removed; this is plain ``int`` (floor of a non-negative number).
    """
    side = jnp.sqrt(1.0 - jnp.asarray(lam, jnp.float32))
    half_a = jnp.floor(height * side).astype(jnp.int32) // 2
    half_b = jnp.floor(width * side).astype(jnp.int32) // 2
    a1, a2 = jnp.clip(centre_a - half_a, 0, height), jnp.clip(centre_a + half_a, 0, height)
    b1, b2 = jnp.clip(centre_b - half_b, 0, width), jnp.clip(centre_b + half_b, 0, width)
    box = jnp.stack([a1, a2, b1, b2]).astype(jnp.int32)
    lam_box = 1.0 - ((a2 - a1) * (b2 - b1)).astype(jnp.float32) / (height * width)
    return box, lam_box


def cutmix_draws(key, n: int, height: int, width: int, beta: float, prob: float) -> CutMixDraws:
    """One CutMix draw for a batch of ``n`` images of ``height`` x ``width``, in the
    reference's order: coin r ~ U(0, 1) (cut when beta > 0 and r < prob),
    lam ~ Beta(beta, beta), a permutation of the n rows (across domains; i may map to
    i), centres u ~ U{0..H-1}, v ~ U{0..W-1}; the box from ``cutmix_box``."""
    coin_key, lam_key, perm_key, a_key, b_key = jax.random.split(key, 5)
    apply = (beta > 0) & (jax.random.uniform(coin_key) < prob)
    # A select, not a Python branch: a pack traces beta (sagm_jax.training.packed).
    lam = jnp.where(beta > 0, jax.random.beta(lam_key, beta, beta), jnp.float32(1.0))
    perm = jax.random.permutation(perm_key, n).astype(jnp.int32)
    centre_a = jax.random.randint(a_key, (), 0, height)
    centre_b = jax.random.randint(b_key, (), 0, width)
    box, lam_box = cutmix_box(lam, centre_a, centre_b, height, width)
    return CutMixDraws(jnp.asarray(apply), lam_box, perm, box)


def _cutmix(args: Step):
    """X[:, a1:a2, b1:b2] <- X[perm][:, a1:a2, b1:b2] (one box for the batch);
    L = mean_i [lam_box CE(f(X)_i, y_i) + (1 - lam_box) CE(f(X)_i, y_perm(i))], and
    L = CE(f(X), Y) when the coin says no. The box is a mask (static shapes under jit);
    ``domain_losses`` are the per-domain means of the per-row loss."""
    n, height, width = args.images.shape[:3]
    draws = cutmix_draws(args.key, n, height, width, args.hp["cutmix_beta"],
                         args.hp["cutmix_prob"])
    a1, a2, b1, b2 = draws.box
    rows, cols = jnp.arange(height), jnp.arange(width)
    inside = ((rows >= a1) & (rows < a2))[:, None] & ((cols >= b1) & (cols < b2))[None, :]
    pasted = jnp.where((inside & draws.apply)[None, :, :, None], args.images[draws.perm],
                       args.images)
    out = args.forward(pasted)
    own_weight = jnp.where(draws.apply, draws.lam_box, 1.0)
    per_row = own_weight * per_example_cross_entropy(out.logits, args.labels) + (
        1.0 - own_weight) * per_example_cross_entropy(out.logits, args.labels[draws.perm])
    losses = by_domain(per_row, args.num_domains).mean(axis=1)
    loss = per_row.mean()
    return loss, make_aux(args, out, {"loss": loss}, losses)


register_objective(Objective(
    Method("cutmix", "CutMix", (
        Hyperparameter("cutmix_beta", 1.0, "CutMix's Beta(beta, beta) for the box area", ">= 0"),
        Hyperparameter("cutmix_prob", 1.0, "probability that a step cuts and mixes", "[0, 1]"),
    ), "one box pasted from a shuffled batch, labels mixed by the box's area",
        "SAGM repository (Yun et al. 2019)"),
    _cutmix,
))


# ----------------------------------------------------------------------------
# OrgMixup (the SAGM repository's ``OrgMixup``: Mixup of the whole batch, domains ignored).


def org_mixup_draws(key, n: int, alpha: float):
    """``(perm, lam)``: a random permutation of the n rows of the concatenated batch
    (across domains; i may map to i, as ``torch.randperm``) and ONE weight
    lam ~ Beta(alpha, alpha) for the whole batch."""
    perm_key, lam_key = jax.random.split(key)
    perm = jax.random.permutation(perm_key, n).astype(jnp.int32)
    lam = jax.random.beta(lam_key, alpha, alpha).astype(jnp.float32)
    return perm, lam


def _org_mixup(args: Step):
    """X~ = lam X + (1 - lam) X[perm];
    L = lam CE(f(X~), Y) + (1 - lam) CE(f(X~), Y[perm]) (means over all N rows), the
    reference's loss. ``domain_losses`` are the per-domain means of the per-row loss
    (their mean is L)."""
    perm, lam = org_mixup_draws(args.key, args.images.shape[0], args.hp["mixup_alpha"])
    x = args.images.astype(jnp.float32)
    mixed = lam * x + (1.0 - lam) * x[perm]
    out = args.forward(mixed.astype(args.images.dtype))
    per_row = lam * per_example_cross_entropy(out.logits, args.labels) + (
        1.0 - lam) * per_example_cross_entropy(out.logits, args.labels[perm])
    loss = per_row.mean()
    return loss, make_aux(args, out, {"loss": loss}, by_domain(per_row, args.num_domains).mean(1))


register_objective(Objective(
    Method("org_mixup", "OrgMixup", (
        # Mixup's key and default; the SAGM repository draws 10^U(-1,-1), always 0.1.
        Hyperparameter("mixup_alpha", 0.2, "Mixup's Beta(alpha, alpha) for the mixing weight",
                       "> 0", log_uniform(-1, -1)),
    ), "Mixup of the whole batch across domains: one Beta weight, a random row permutation",
        "SAGM repository (Zhang et al. 2018)"),
    _org_mixup,
))


# ----------------------------------------------------------------------------
# CORAL and MMD (DomainBed's ``AbstractMMD``, ``CORAL``, ``MMD``).


def coral_penalty(a, b) -> jax.Array:
    """DomainBed's CORAL distance between feature sets a [n, d] and b [n', d]:

    mu = column means, C = (phi - mu)^T (phi - mu) / (n - 1);
    D = mean_k (mu_a - mu_b)_k^2 + mean_{k,l} (C_a - C_b)_{kl}^2
      = ||d mu||^2 / d + ||d C||_F^2 / d^2   (not the CORAL paper's 1 / (4 d^2)).
    """
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)

    def mean_and_covariance(x):
        mean = x.mean(axis=0)
        centred = x - mean
        return mean, centred.T @ centred / (x.shape[0] - 1)

    mean_a, cov_a = mean_and_covariance(a)
    mean_b, cov_b = mean_and_covariance(b)
    return jnp.mean((mean_a - mean_b) ** 2) + jnp.mean((cov_a - cov_b) ** 2)


def _gaussian_kernels(x, y) -> jax.Array:
    """K(x_i, y_j) = sum_gamma exp(-gamma delta_ij), delta = ||x_i||^2 + ||y_j||^2 - 2 x_i.y_j
    clamped below at 1e-30 (float rounding can make it negative)."""
    x_norm = jnp.sum(x * x, axis=1, keepdims=True)
    y_norm = jnp.sum(y * y, axis=1, keepdims=True)
    delta = jnp.maximum((y_norm.T - 2.0 * x @ y.T) + x_norm, MMD_DISTANCE_FLOOR)
    return sum(jnp.exp(-gamma * delta) for gamma in MMD_GAMMAS)


def mmd_penalty(a, b) -> jax.Array:
    """DomainBed's multi-bandwidth Gaussian MMD between a [n, d] and b [n', d]:

    D = mean K(a, a) + mean K(b, b) - 2 mean K(a, b), each mean over all entries
    (biased estimate, diagonal included), K the sum over gamma in {1e-3, ..., 1e3} of
    exp(-gamma max(||u - v||^2, 1e-30)) with ||u - v||^2 = ||u||^2 + ||v||^2 - 2 u.v.
    """
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return (_gaussian_kernels(a, a).mean() + _gaussian_kernels(b, b).mean()
            - 2.0 * _gaussian_kernels(a, b).mean())


_PENALTIES = {"coral": coral_penalty, "mmd": mmd_penalty}


def pairwise_penalty(features, kind: str) -> jax.Array:
    """P = sum_{i<j} D(phi_i, phi_j) / (M (M - 1) / 2) over the M domains' features
    [M, b, d], D = ``coral_penalty`` (kind "coral") or ``mmd_penalty`` ("mmd");
    P = 0 when M = 1."""
    if kind not in _PENALTIES:
        raise ValueError(f"unknown feature penalty {kind!r}; choose one of {', '.join(_PENALTIES)}")
    distance = _PENALTIES[kind]
    pairs = list(itertools.combinations(range(features.shape[0]), 2))
    if not pairs:
        return jnp.float32(0.0)
    return sum(distance(features[i], features[j]) for i, j in pairs) / len(pairs)


def _feature_matching(kind: str):
    def objective(args: Step):
        """L = J + mmd_gamma P, J = mean_m CE(z_m, y_m), P = ``pairwise_penalty``; the
        reported loss is J alone (DomainBed's), the penalty P."""
        out = args.forward(args.images)
        losses = domain_losses(out.logits, args.labels, args.num_domains)
        data = losses.mean()
        penalty = pairwise_penalty(by_domain(out.features, args.num_domains), kind)
        loss = data + args.hp["mmd_gamma"] * penalty
        return loss, make_aux(args, out, {"loss": data, "penalty": penalty}, losses)

    return objective


# 0 would train ERM under the label CORAL or MMD: refused (DomainBed draws 10^U(-1, 1)).
_MMD_GAMMA = Hyperparameter(
    "mmd_gamma", 1.0, "weight of the CORAL/MMD feature penalty", "> 0", log_uniform(-1, 1),
    note=" (with 0 there is no feature penalty: the run would be ERM labelled CORAL or MMD; "
    "--config.objective=erm trains ERM)",
)
register_objective(Objective(
    Method("coral", "CORAL", (_MMD_GAMMA,),
           "ERM + gamma * mean over domain pairs of the feature mean/covariance gap",
           "DomainBed (Sun & Saenko 2016)", (86.2, 78.8, 68.7, 47.6, 41.5, 64.6, "DomainBed")),
    _feature_matching("coral"), label_alone=True, min_batch_per_env=2,
    min_batch_reason="CORAL's covariance is unbiased (it divides by b - 1), so one example "
    "per domain gives 0/0",
))
register_objective(Objective(
    Method("mmd", "MMD", (_MMD_GAMMA,),
           "ERM + gamma * mean over domain pairs of a multi-bandwidth Gaussian MMD",
           "DomainBed (Li et al. 2018)", (84.6, 77.5, 66.3, 42.2, 23.4, 58.8, "DomainBed")),
    _feature_matching("mmd"), label_alone=True,
))


# ----------------------------------------------------------------------------
# GroupDRO (DomainBed's ``GroupDRO``).


def _groupdro(args: Step):
    """With this step's detached domain losses l: q <- q exp(eta l), q <- q / sum q (once
    per step, ``advance``), then L = sum_m q_m l_m with q a constant (DomainBed HEAD:
    no division by M)."""
    out = args.forward(args.images)
    losses = domain_losses(out.logits, args.labels, args.num_domains)
    q = args.state["q"]
    if args.advance:
        q = q * jnp.exp(args.hp["groupdro_eta"] * jax.lax.stop_gradient(losses))
        q = q / q.sum()
    q = jax.lax.stop_gradient(q)
    loss = jnp.sum(q * losses)
    return loss, make_aux(args, out, {"loss": loss}, losses, state={"q": q})


register_objective(Objective(
    Method("groupdro", "GroupDRO", (
        Hyperparameter("groupdro_eta", 1e-2, "step size of the domain weights q", "> 0",
                       log_uniform(-3, -1)),
    ), "domain losses weighted by q, q <- q * exp(eta * loss) each step",
        "DomainBed (Sagawa et al. 2020)", (84.4, 76.7, 66.0, 43.2, 33.3, 60.7, "DomainBed")),
    _groupdro,
    init_state=lambda num_domains: {"q": jnp.ones([num_domains], jnp.float32)},
    label_alone=True,
))


# ----------------------------------------------------------------------------
# IRM and VREx (DomainBed's ``IRM``, ``VREx``).


def _scale_gradients(logits, labels) -> jax.Array:
    """d/ds CE(s z, y)|_{s=1} = mean_i (sum_c softmax(z_i)_c z_ic - z_{i,y_i}) for each
    leading index: logits [M, n, C], labels [M, n] -> [M]."""
    expected = jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    true = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(expected - true, axis=-1)


def irm_penalty(logits, labels) -> jax.Array:
    """IRMv1's split-batch penalty over domains: logits [M, b, C], labels [M, b].

    penalty = mean_m g_even_m g_odd_m, g = d/ds CE(s z, y)|_{s=1} on rows [0::2]
    (even) and [1::2] (odd) of domain m, in closed form (see ``_scale_gradients``);
    differentiable, so the loss's gradient goes through it (second order)."""
    logits = logits.astype(jnp.float32)
    even = _scale_gradients(logits[:, 0::2], labels[:, 0::2])
    odd = _scale_gradients(logits[:, 1::2], labels[:, 1::2])
    return jnp.mean(even * odd)


def _irm(args: Step):
    """L = nll + w penalty, nll = mean_m CE(z_m, y_m), penalty = ``irm_penalty``,
    w = irm_lambda from step A = irm_penalty_anneal_iters on, else 1."""
    out = args.forward(args.images)
    m = args.num_domains
    losses = domain_losses(out.logits, args.labels, m)
    nll = losses.mean()
    penalty = irm_penalty(by_domain(out.logits, m), by_domain(args.labels, m))
    weight = _annealed_weight(args.step, args.hp["irm_penalty_anneal_iters"],
                              args.hp["irm_lambda"])
    loss = nll + weight * penalty
    return loss, make_aux(args, out, {"loss": loss, "nll": nll, "penalty": penalty}, losses)


register_objective(Objective(
    Method("irm", "IRM", (
        Hyperparameter("irm_lambda", 1e2, "weight of IRM's penalty after the anneal", ">= 0",
                       log_uniform(-1, 5)),
        Hyperparameter("irm_penalty_anneal_iters", 500,
                       "steps with penalty weight 1; Adam restarts at this step", "int >= 0",
                       log_uniform(0, 4, integer=True)),
    ), "mean domain loss + lambda * IRMv1 penalty (split-batch estimate)",
        "DomainBed (Arjovsky et al. 2019)", (83.5, 78.5, 64.3, 47.6, 33.9, 61.6, "DomainBed")),
    _irm, restart_key="irm_penalty_anneal_iters", label_alone=True, min_batch_per_env=2,
    min_batch_reason="IRM's penalty multiplies the gradients of each domain's even and odd "
    "examples, so one example per domain leaves the odd half empty",
))

def _vrex(args: Step):
    """L = mu + w penalty, mu = mean_m l_m, penalty = mean_m (l_m - mu)^2 (population
    variance), w = vrex_lambda from step A = vrex_penalty_anneal_iters on, else 1. The
    reported ``nll`` is l_(M-1), the last domain's loss (the reference's logging quirk)."""
    out = args.forward(args.images)
    losses = domain_losses(out.logits, args.labels, args.num_domains)
    mean = losses.mean()
    penalty = jnp.mean((losses - mean) ** 2)
    weight = _annealed_weight(args.step, args.hp["vrex_penalty_anneal_iters"],
                              args.hp["vrex_lambda"])
    loss = mean + weight * penalty
    metrics = {"loss": loss, "nll": losses[-1], "penalty": penalty}
    return loss, make_aux(args, out, metrics, losses)


register_objective(Objective(
    Method("vrex", "VREx", (
        Hyperparameter("vrex_lambda", 1e1, "weight of the variance penalty after the anneal",
                       ">= 0", log_uniform(-1, 5)),
        Hyperparameter("vrex_penalty_anneal_iters", 500,
                       "steps with penalty weight 1; Adam restarts at this step", "int >= 0",
                       log_uniform(0, 4, integer=True)),
    ), "mean domain loss + lambda * variance of the domain losses",
        "DomainBed (Krueger et al. 2021)", (84.9, 78.3, 66.4, 46.4, 33.6, 61.9, "DomainBed")),
    _vrex, restart_key="vrex_penalty_anneal_iters", label_alone=True,
))
