"""Contrastive domain-bottleneck objectives: CAD and CondCAD.

DomainBed's ``domainbed/algorithms.py`` classes ``AbstractCAD``, ``CAD`` and ``CondCAD``
(Ruan, Dubois & Maddison 2022, "Optimal Representations for Covariate Shift"): ERM's
cross-entropy plus ``lmbda`` times a supervised-contrastive loss (after Khosla et al.'s
SupCon) that makes an example's domain hard to tell from its features, unconditionally
(CAD: minimise I(D; Z)) or given the label (CondCAD: I(D; Z | Y)). One loss of the
featurizer, the classifier and the optional projection head, then one Adam step: an
objective here (any update rule minimises it; SAM, GSAM, SAGM and DISAM take its gradient
at w and at the perturbed point, SWAD averages on top). No state, no random draws.

With z_i the features of row i (through the projection head when ``is_project``, then
divided by max(||z_i||, 1e-12) when ``is_normalized``), d_i its domain, y_i its label,
T = ``temperature``, T0 = 0.07 (the reference's ``base_temperature``):

    l_ij = z_i . z_j / T for j != i,  l_ii = 0   (the reference multiplies by the
                                                  off-diagonal mask)
    log p_ij = l_ij - log sum_{k != i} exp(l_ik)                 (CAD)
    log q_ij = l_ij - log sum_{k != i, y_k = y_i} exp(l_ik)      (CondCAD)

and the bottleneck loss of row i (``is_flipped``, DomainBed's default and only draw:
maximise the probability of the OTHER domains; else minimise that of the same domain):

    CAD      flipped:  -(T/T0) log sum_{j: d_j != d_i} p_ij
             else:      (T/T0) log sum_{j: d_j = d_i} p_ij       (j = i included, l_ii = 0)
    CondCAD  flipped:  -(T/T0) log sum_{j != i: y_j = y_i, d_j != d_i} q_ij
             else:      (T/T0) log sum_{j != i: y_j = y_i, d_j = d_i} q_ij

over the rows the reference keeps: CAD's rows with another row of their label; CondCAD's
rows whose sum above is not empty. The loss is the mean over the kept rows whose value is
finite (the reference's ``finite_mean``: CAD's flipped row with no other-domain row is
+inf and left out), 0 when none is. L = CE + lmbda * bottleneck; the reported losses are
DomainBed's ``clf_loss``, ``bn_loss`` and ``total_loss`` (here ``loss``).

The reference's quirks (docs/methods.md, "CAD and CondCAD"):

* ``is_project=True`` cannot run in the reference: ``AbstractCAD.__init__`` builds the
  head from ``feature_dim``, a name it never defines (NameError); DomainBed's search
  always draws False. Here the head is the one it writes, Linear(d, d), ReLU,
  Linear(d, 128), on the featurizer's width d (the evident intent), at torch's Linear
  initialisation, trained by the run's optimizer with the network (the reference's Adam
  lists its parameters) under ``params["method"]`` (``networks.MethodNetwork``).
* CAD's unflipped loss counts the example itself among its same-domain examples, with the
  logit 0 its masked diagonal holds (``mask_d`` keeps the diagonal; SupCon's positives
  do not). Reproduced by default; ``cad_self_term="excluded"`` leaves it out.
* CAD keeps only the rows with another example of their label, though its loss reads no
  label (``mask_valid`` from ``mask_y``). Reproduced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.adaptive import torch_uniform
from sagm_jax.methods.networks import MethodNetwork
from sagm_jax.methods.objectives import Step, domain_losses, make_aux
from sagm_jax.methods.registry import (
    Distribution,
    Hyperparameter,
    Method,
    Objective,
    choice,
    register_objective,
)

BASE_TEMPERATURE = 0.07  # the reference's ``base_temperature``
PROJECTION_WIDTH = 128  # the projection head's output width
NORMALIZE_EPS = 1e-12  # ``F.normalize``'s floor of the norm
SELF_TERMS = ("zero_logit", "excluded")


# ----------------------------------------------------------------------------
# The projection head (``AbstractCAD.project``).


def init_projection_head(key, feature_dim: int) -> dict:
    """Linear(d, d) and Linear(d, 128) at torch's initialisation: kernel [n_in, n_out] and
    bias ~ U(-1/sqrt(n_in), 1/sqrt(n_in))."""
    keys = jax.random.split(key, 4)
    widths = ((feature_dim, feature_dim), (feature_dim, PROJECTION_WIDTH))
    return {
        f"linear_{i}": {"kernel": torch_uniform(keys[2 * i], (n_in, n_out), n_in),
                        "bias": torch_uniform(keys[2 * i + 1], (n_out,), n_in)}
        for i, (n_in, n_out) in enumerate(widths)
    }


def project(params: dict, features) -> jax.Array:
    """The head: relu(z W0 + b0) W1 + b1, in float32."""
    hidden = jax.nn.relu(features @ params["linear_0"]["kernel"] + params["linear_0"]["bias"])
    return hidden @ params["linear_1"]["kernel"] + params["linear_1"]["bias"]


def _init_head(key, shapes, hp) -> dict:
    if not hp["is_project"]:
        return {}
    return {"params": {"project": init_projection_head(key, shapes.feature_dim)}}


# ----------------------------------------------------------------------------
# The bottleneck loss (``AbstractCAD.bn_loss``).


def masked_logsumexp(x, mask) -> tuple[jax.Array, jax.Array]:
    """``(s, nonempty)``: s_i = log sum_{j: mask_ij} exp(x_ij) for each row, shifted by
    the row's masked maximum (a constant); 0 for a row whose mask is empty (its
    ``nonempty`` False), where the reference's logsumexp is -inf. No inf or NaN enters
    the value or the gradient of a row that is left out."""
    nonempty = mask.any(axis=1)
    masked = jnp.where(mask, x, -jnp.inf)
    shift = jax.lax.stop_gradient(jnp.where(nonempty, masked.max(axis=1), 0.0))
    total = jnp.exp(masked - shift[:, None]).sum(axis=1)
    value = jnp.log(jnp.where(nonempty, total, 1.0)) + shift
    return jnp.where(nonempty, value, 0.0), nonempty


def _bottleneck_rows(logits, same_label, same_domain, off_diagonal, conditional: bool,
                     flipped: bool, self_term: str):
    """Each row's bottleneck term divided by T/T0, and whether the reference averages it
    (kept and finite); see the module docstring."""
    positive = same_label & off_diagonal
    if conditional:
        selected = positive & (~same_domain if flipped else same_domain)
        denominator, _ = masked_logsumexp(logits, positive)
        kept = selected.any(axis=1)
    else:
        same = same_domain if self_term == "zero_logit" else same_domain & off_diagonal
        selected = ~same_domain if flipped else same
        denominator, _ = masked_logsumexp(logits, off_diagonal)
        kept = positive.any(axis=1)
    log_prob = logits - denominator[:, None]
    value, finite = masked_logsumexp(log_prob, selected)
    return (-value if flipped else value), kept & finite


def bottleneck_loss(features, labels, domains, *, temperature, conditional: bool,
                    flipped: bool, normalized: bool, self_term: str = "zero_logit"):
    """DomainBed's ``bn_loss`` of features [N, d] (already projected), labels [N] and
    domains [N]: the mean over the averaged rows of (T/T0) times their term, 0 when no row
    is averaged (module docstring)."""
    z = features.astype(jnp.float32)
    if normalized:
        z = z / jnp.maximum(jnp.linalg.norm(z, axis=1, keepdims=True), NORMALIZE_EPS)
    n = z.shape[0]
    off_diagonal = ~jnp.eye(n, dtype=bool)
    logits = jnp.where(off_diagonal, z @ z.T / temperature, 0.0)
    rows, averaged = _bottleneck_rows(
        logits, labels[:, None] == labels[None, :], domains[:, None] == domains[None, :],
        off_diagonal, conditional, flipped, self_term)
    count = averaged.sum()
    mean = jnp.where(averaged, rows, 0.0).sum() / jnp.maximum(count, 1)
    return (temperature / BASE_TEMPERATURE) * mean


def _cad(conditional: bool):
    def loss(args: Step):
        """L = CE + lmbda * ``bottleneck_loss`` of the features (projected when
        ``is_project``); the domains are the minibatches' order. Reported: ``loss``
        (DomainBed's ``total_loss``), ``clf_loss``, ``bn_loss``."""
        hp, m = args.hp, args.num_domains
        self_term = hp.get("cad_self_term", SELF_TERMS[0])  # CAD's only
        if self_term not in SELF_TERMS:
            raise ValueError(f"cad_self_term={self_term!r}: expected one of "
                             f"{', '.join(SELF_TERMS)}.")
        out = args.forward(args.images)
        features = out.features.astype(jnp.float32)
        if hp["is_project"]:
            own = (args.params or {}).get("method", {})
            if "project" not in own:
                raise ValueError("is_project=True: the projection head's parameters are "
                                 "missing from params['method']['project'].")
            features = project(own["project"], features)
        domains = jnp.repeat(jnp.arange(m), args.images.shape[0] // m)
        bottleneck = bottleneck_loss(
            features, args.labels, domains, temperature=hp["temperature"],
            conditional=conditional, flipped=hp["is_flipped"], normalized=hp["is_normalized"],
            self_term=self_term)
        losses = domain_losses(out.logits, args.labels, m)
        classification = losses.mean()
        total = classification + hp["lmbda"] * bottleneck
        metrics = {"loss": total, "clf_loss": classification, "bn_loss": bottleneck}
        return total, make_aux(args, out, metrics, losses)

    return loss


def _flag(value: bool) -> Distribution:
    """DomainBed's ``lambda r: value``: always ``value``."""
    return Distribution(str(value), lambda rng: value)


# DomainBed's hyperparameters of both, under its names (``hparams_registry.py``).
HYPERPARAMETERS = (
    Hyperparameter(
        "lmbda", 0.1, "CAD/CondCAD: weight of the contrastive domain-bottleneck loss", "> 0",
        choice((1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2)),
        note=" (with 0 there is no bottleneck: the run would be ERM labelled CAD; "
        "--config.objective=erm trains ERM)"),
    Hyperparameter("temperature", 0.1, "CAD/CondCAD: the contrastive loss's temperature T",
                   "> 0", choice((0.05, 0.1))),
    Hyperparameter("is_normalized", False,
                   "CAD/CondCAD: divide the features by their norm in the bottleneck loss",
                   "bool", _flag(False)),
    Hyperparameter("is_project", False,
                   "CAD/CondCAD: the bottleneck loss reads the features through a trained "
                   "head Linear(d, d), ReLU, Linear(d, 128) (DomainBed's cannot build it)",
                   "bool", _flag(False)),
    Hyperparameter("is_flipped", True,
                   "CAD/CondCAD: maximise the other domains' probability (True) or "
                   "minimise the same domain's (False)", "bool", _flag(True)),
)
# CAD's fix of its unflipped loss (the module docstring), not drawn.
SELF_TERM = Hyperparameter(
    "cad_self_term", "zero_logit",
    'CAD unflipped: the example counts among its same-domain examples with logit 0 '
    '("zero_logit", DomainBed\'s) or not ("excluded")', "one of zero_logit, excluded")

register_objective(Objective(
    Method("cad", "CAD", (*HYPERPARAMETERS, SELF_TERM),
           "cross-entropy + lmbda * contrastive loss that hides each example's domain "
           "among the batch's (minimises I(D; Z))", "DomainBed (Ruan et al. 2022)"),
    _cad(conditional=False), label_alone=True,
    network=MethodNetwork(init=_init_head),
))
register_objective(Objective(
    Method("condcad", "CondCAD", HYPERPARAMETERS,
           "cross-entropy + lmbda * contrastive loss that hides each example's domain "
           "among its class's examples (minimises I(D; Z | Y))", "DomainBed (Ruan et al. 2022)"),
    _cad(conditional=True), label_alone=True,
    network=MethodNetwork(init=_init_head),
))
