"""Objectives that act on the features and the classifier: RSC and SelfReg.

Both are DomainBed algorithms (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``,
classes ``RSC`` and ``SelfReg``) whose update is ONE loss of the featurizer and the
classifier followed by one Adam step, so here each is an objective (a loss function and
its ``register_objective`` entry): any update rule minimises it (ERM's Adam, or SAM, GSAM,
SAGM, which take its gradient at w and at the perturbed point), with SWAD on top. Neither
changes how the gradient becomes an update, which is what would make it an update rule.

* RSC mutes, for most examples, the features whose gradient towards the true class is in
  the top percentile, and trains on the muted features (``rsc_loss``). It reads the
  classifier through ``Outputs.classify`` (the network's linear head at this pass's
  parameters), so the loss is differentiated through it. No random draws beyond dropout.
* SelfReg adds to the cross-entropy a self-distillation between each example and random
  examples of its class (logits, and features through a projection ``cdpl``), mixed with
  a Beta(0.5, 0.5) weight (``selfreg_loss``). The projection is a module the method
  brings (``sagm_jax.methods.networks.MethodNetwork``).

DomainBed's SelfReg quirk, reproduced by default (``selfreg_projection="frozen"``): its
Adam is ``ERM.__init__``'s, built over ``self.network.parameters()`` (featurizer and
classifier) BEFORE ``SelfReg.__init__`` creates ``cdpl``, so the projection is never
trained: it stays at its initial values while the gradient flows through it into the
featurizer. Here the frozen projection is not a parameter at all: the objective's state
holds the key it is drawn from (taken from the step-0 objective key, so it depends on
the run's seed as the reference's does), and each step rebuilds the same projection
from it. So no optimizer, weight decay, sharpness-aware perturbation or SWAD average can
move it, and it needs no change of the optimizer. ``selfreg_projection="trained"`` is
the fix: the projection's parameters live under ``params["method"]`` (drawn with the
network at step 0) and are trained, perturbed and averaged with the network.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from sagm_jax.methods.networks import MethodNetwork
from sagm_jax.methods.objectives import Step, domain_losses, make_aux
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    Objective,
    register_objective,
    uniform,
)

# ----------------------------------------------------------------------------
# RSC (DomainBed's ``RSC``; the SAGM repository's ``RSC`` is the same computation).


def rsc_masks(features, labels, classify, f_drop_factor: float, b_drop_factor: float):
    """RSC's mask [N, d] (1 = kept) of the features, a constant of the loss.

    g = d/dphi sum_i z(phi)_{i, y_i}, detached (the reference's ``autograd.grad``);
    per example, q_i = percentile(g_i, 100 (1 - f)) over its d features (linear
    interpolation, NumPy's ``percentile``), m_f = [g < q_i] mutes the top-gradient ones;
    Delta_i = softmax(z(phi))_{i, y_i} - softmax(z(phi m_f))_{i, y_i}, the drop of the
    true-class probability; Q = percentile(Delta, 100 (1 - b)) over the batch;
    examples with Delta_i < Q keep every feature: mask = m_f OR [Delta_i < Q].
    """
    features = jax.lax.stop_gradient(features)
    logits, pullback = jax.vjp(classify, features)
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    grads = jax.lax.stop_gradient(pullback(one_hot)[0])
    feature_cut = jnp.percentile(grads, (1.0 - f_drop_factor) * 100.0, axis=1, keepdims=True)
    feature_mask = grads < feature_cut
    muted = classify(features * feature_mask)

    def true_probability(z):
        return jnp.sum(jax.nn.softmax(z, axis=-1) * one_hot, axis=-1)

    changes = jax.lax.stop_gradient(true_probability(logits) - true_probability(muted))
    batch_cut = jnp.percentile(changes, (1.0 - b_drop_factor) * 100.0)
    keep_example = (changes < batch_cut)[:, None]
    return (feature_mask | keep_example).astype(features.dtype)


def rsc_loss(args: Step):
    """L = CE(classify(phi * mask), Y), mask from ``rsc_masks`` (a constant), the mean
    over the concatenated batch; the reported loss is L (DomainBed's)."""
    out = args.forward(args.images)
    if out.classify is None:
        raise ValueError("RSC classifies muted features: forward must return Outputs.classify")
    features = out.features.astype(jnp.float32)

    def classify(f):
        return out.classify(f).astype(jnp.float32)

    mask = rsc_masks(features, args.labels, classify, args.hp["rsc_f_drop_factor"],
                     args.hp["rsc_b_drop_factor"])
    logits = classify(features * mask)
    losses = domain_losses(logits, args.labels, args.num_domains)
    loss = losses.mean()
    return loss, make_aux(args, out, {"loss": loss}, losses)


register_objective(Objective(
    Method("rsc", "RSC", (
        Hyperparameter("rsc_f_drop_factor", 1 / 3,
                       "RSC: fraction of each example's features muted (top gradients)",
                       "[0, 1]", uniform(0, 0.5)),
        Hyperparameter("rsc_b_drop_factor", 1 / 3,
                       "RSC: fraction of the batch whose features are muted", "[0, 1]",
                       uniform(0, 0.5)),
    ), "cross-entropy on features whose top true-class gradients are muted, for the "
       "examples whose true-class probability drops most", "DomainBed (Huang et al. 2020)",
        (85.2, 77.1, 65.5, 46.6, 38.9, 62.7, "DomainBed")),
    rsc_loss, label_alone=True,
))


# ----------------------------------------------------------------------------
# SelfReg (DomainBed's ``SelfReg``).

SELFREG_FEATURE_WEIGHT = 0.3  # the reference's weight of the feature terms
SELFREG_BETA = 0.5  # lam ~ Beta(0.5, 0.5)
PROJECTION_EPS = 1e-5  # BatchNorm1d's eps
_PROJECTION_STREAM = 7  # the frozen projection's key: fold_in(step-0 objective key, 7)


def projection_widths(feature_dim: int) -> tuple[int, int, int, int]:
    """cdpl's widths d -> h -> h -> d, h = d when d = 2048 (ResNet-50) else 2 d."""
    hidden = feature_dim if feature_dim == 2048 else 2 * feature_dim
    return feature_dim, hidden, hidden, feature_dim


def init_projection(key, feature_dim: int) -> dict:
    """cdpl at PyTorch's initialisation: each ``Linear(n_in, n_out)`` kernel [n_in, n_out]
    and bias ~ U(-1/sqrt(n_in), 1/sqrt(n_in)); each ``BatchNorm1d`` scale 1, bias 0."""
    widths = projection_widths(feature_dim)
    params = {}
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        kernel_key, bias_key = jax.random.split(jax.random.fold_in(key, i))
        bound = 1.0 / float(n_in) ** 0.5
        params[f"linear_{i}"] = {
            "kernel": jax.random.uniform(kernel_key, (n_in, n_out), jnp.float32, -bound, bound),
            "bias": jax.random.uniform(bias_key, (n_out,), jnp.float32, -bound, bound),
        }
        params[f"norm_{i}"] = {"scale": jnp.ones([n_out], jnp.float32),
                               "bias": jnp.zeros([n_out], jnp.float32)}
    return params


def project(params: dict, features) -> jax.Array:
    """cdpl = Linear, BN, ReLU, Linear, BN, ReLU, Linear, BN, always in training mode:
    BN(x) = scale (x - mean) / sqrt(var + 1e-5) + bias, mean and biased var over the batch
    (the reference never reads its running statistics)."""
    x = features.astype(jnp.float32)
    layers = len([k for k in params if k.startswith("linear_")])
    for i in range(layers):
        x = x @ params[f"linear_{i}"]["kernel"] + params[f"linear_{i}"]["bias"]
        mean, var = x.mean(axis=0), x.var(axis=0)
        x = (x - mean) / jnp.sqrt(var + PROJECTION_EPS)
        x = x * params[f"norm_{i}"]["scale"] + params[f"norm_{i}"]["bias"]
        if i < layers - 1:
            x = jax.nn.relu(x)
    return x


def within_class_permutation(key, labels) -> jax.Array:
    """[N] partner of each row: a uniformly random permutation of the rows of each class
    (row i is paired with a row of class y_i; every row is some row's partner once), as
    the reference's ``randperm`` of each class's block of the label-sorted batch."""
    n = labels.shape[0]
    shuffle = jax.random.permutation(key, n)
    grouped = jnp.argsort(labels, stable=True)
    shuffled = shuffle[jnp.argsort(labels[shuffle], stable=True)]
    return jnp.zeros([n], jnp.int32).at[grouped].set(shuffled.astype(jnp.int32))


def selfreg_draws(key, labels):
    """``(lam, first, second)``: lam ~ Beta(0.5, 0.5), one per step, and the two
    within-class partners (``within_class_permutation``)."""
    lam_key, first_key, second_key = jax.random.split(key, 3)
    lam = jax.random.beta(lam_key, SELFREG_BETA, SELFREG_BETA).astype(jnp.float32)
    return lam, within_class_permutation(first_key, labels), within_class_permutation(
        second_key, labels)


def init_selfreg_state(num_domains: int) -> dict:
    """The frozen projection's key, zeros until step 0 sets it (``_projection``)."""
    del num_domains
    return {"projection_key": jnp.zeros_like(jax.random.key_data(jax.random.key(0)))}


def _projection(args: Step, feature_dim: int) -> tuple[dict, dict]:
    """``(cdpl's parameters, objective state)``: ``params["method"]`` when trained; when
    frozen, rebuilt each step from the state's key, which the clean pass of step 0 sets
    from the objective key (afterwards it never changes)."""
    if args.hp["selfreg_projection"] == "trained":
        return args.params["method"], args.state
    stored = args.state["projection_key"]
    if args.advance:
        fresh = jax.random.key_data(jax.random.fold_in(args.key, _PROJECTION_STREAM))
        stored = jnp.where(args.step == 0, fresh.astype(stored.dtype), stored)
    key = jax.random.wrap_key_data(stored)
    return init_projection(key, feature_dim), {"projection_key": stored}


def _mse(a, b) -> jax.Array:
    return jnp.mean((a - b) ** 2)


def selfreg_loss(args: Step):
    """With phi the features, z = classify(phi), P = cdpl(phi), partners s (first) and
    t (second) of ``selfreg_draws``, z2 = z[s], P2 = P[s], z3 = lam z2 + (1 - lam) z[t],
    P3 = lam P2 + (1 - lam) P[t]:

    L = CE + c [lam (MSE(z, z2) + 0.3 MSE(phi, P2)) + (1 - lam) (MSE(z, z3) + 0.3 MSE(phi, P3))],

    CE the mean cross-entropy, c = min(CE, 1) detached (the reference's ``C_scale``), MSE
    the mean over all entries; the feature terms compare the unprojected phi with the
    partners' projections, as the reference does. Both sides of every MSE carry the
    gradient. The reported loss is L."""
    out = args.forward(args.images)
    features, logits = out.features.astype(jnp.float32), out.logits.astype(jnp.float32)
    params, state = _projection(args, features.shape[-1])
    projected = project(params, features)
    lam, first, second = selfreg_draws(args.key, args.labels)
    logits_first, projected_first = logits[first], projected[first]
    logits_mixed = lam * logits_first + (1.0 - lam) * logits[second]
    projected_mixed = lam * projected_first + (1.0 - lam) * projected[second]
    losses = domain_losses(logits, args.labels, args.num_domains)
    cross_entropy = losses.mean()
    scale = jnp.minimum(jax.lax.stop_gradient(cross_entropy), 1.0)
    w = SELFREG_FEATURE_WEIGHT
    individual = _mse(logits, logits_first) + w * _mse(features, projected_first)
    mixed = _mse(logits, logits_mixed) + w * _mse(features, projected_mixed)
    loss = cross_entropy + scale * (lam * individual + (1.0 - lam) * mixed)
    return loss, make_aux(args, out, {"loss": loss}, losses, state=state)


def _init_trained_projection(key, shapes, hp) -> dict:
    if hp["selfreg_projection"] != "trained":
        return {}
    return {"params": init_projection(key, shapes.feature_dim)}


register_objective(Objective(
    Method("selfreg", "SelfReg", (
        Hyperparameter("selfreg_projection", "frozen",
                       "SelfReg's projection cdpl: frozen at its init (DomainBed's Adam "
                       "omits it) or trained with the network", "one of frozen, trained"),
    ), "cross-entropy + self-distillation of logits and projected features towards "
       "same-class examples and their Beta(0.5, 0.5) mixtures", "DomainBed (Kim et al. 2021)"),
    selfreg_loss, init_state=init_selfreg_state, label_alone=True,
    network=MethodNetwork(init=_init_trained_projection),
))
