"""CausIRL: CORAL or MMD between two random splits of the pooled features.

DomainBed's ``AbstractCausIRL`` and its two subclasses ``CausIRL_CORAL`` and
``CausIRL_MMD`` (``facebookresearch/DomainBed``, ``domainbed/algorithms.py``; Chevalley
et al. 2022, "Invariant Causal Mechanisms through Distribution Matching"). Each step,
for each domain m of the M minibatches (b rows each), the reference draws a split point
``s_m = np.random.randint(0, b)``, uniform on {0, ..., b - 1}, and pools

    A = concat_m phi_m[:s_m],     B = concat_m phi_m[s_m:],

then minimises

    L = J + mmd_gamma * P,     J = mean_m CE(z_m, y_m),
    P = nan_to_num(D(A, B)) if |A| > 1 and |B| > 1, else 0,

with D DomainBed's CORAL distance (``objectives.coral_penalty``: mean squared gap of the
means plus of the unbiased covariances) or its multi-bandwidth Gaussian MMD
(``objectives.mmd_penalty``). It reports ``loss`` = J and ``penalty`` = P, as CORAL does.
One loss of one step's batch under ERM's Adam: an objective, so it composes with every
update rule, DISAM and SWAD.

Quirks of the reference, reproduced:

* s_m never equals b, so B holds at least one row of every domain and A may be empty:
  |A| = sum_m s_m has mean M (b - 1) / 2, |B| = N - |A|.
* The penalty is 0, with no gradient, when either part has at most one row (so with
  b = 1 always, which the config refuses: the run would be ERM).
* The reference adds 1e-16 to the logits before the cross-entropy, which does not change
  it (the softmax is shift invariant; in float32 the sum rounds back to the logit).

Computed differently, with the same result: the reference concatenates rows of
data-dependent count; under ``jax.jit`` the shapes are static, so the split is a mask
``a`` [N] (row r of domain m is in A iff r < s_m) and D is computed with weighted sums
over all N rows (:func:`split_coral`, :func:`split_mmd`), equal to D of the concatenated
parts. The split points come from the objective's key, the same in the clean and the
perturbed pass of a sharpness-aware step (one loss function); JAX's draws, not NumPy's
numbers, with the reference's distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.objectives import (
    _MMD_GAMMA,
    Step,
    _gaussian_kernels,
    domain_losses,
    make_aux,
)
from sagm_jax.methods.registry import Method, Objective, register_objective


def split_points(key, num_domains: int, per_domain: int) -> jax.Array:
    """[M] int32 split points s_m ~ U{0, ..., b - 1}, independent per domain (the
    reference's ``np.random.randint(0, len(features[i]))``)."""
    return jax.random.randint(key, (num_domains,), 0, per_domain, dtype=jnp.int32)


def first_part_mask(points, per_domain: int) -> jax.Array:
    """[M * b] float32: 1 for the rows of A (row r of domain m with r < s_m), else 0 (B)."""
    rows = jnp.arange(per_domain)
    return (rows[None, :] < points[:, None]).reshape(-1).astype(jnp.float32)


def _moments(x, weights):
    """Mean and unbiased covariance of the rows of ``x`` weighted 1 or 0 by ``weights``;
    the counts are clamped (at 1 and 2) only where the penalty is 0 anyway, so that no
    0/0 reaches the gradient."""
    count = weights.sum()
    mean = (weights[:, None] * x).sum(axis=0) / jnp.maximum(count, 1.0)
    centred = (x - mean) * weights[:, None]
    return mean, centred.T @ centred / jnp.maximum(count - 1.0, 1.0)


def split_coral(features, in_first) -> jax.Array:
    """DomainBed's CORAL distance between A (rows with ``in_first`` = 1) and B (the rest):
    mean_k (mu_A - mu_B)_k^2 + mean_{k,l} (C_A - C_B)_{kl}^2, C unbiased (/(n - 1))."""
    x = features.astype(jnp.float32)
    mean_a, cov_a = _moments(x, in_first)
    mean_b, cov_b = _moments(x, 1.0 - in_first)
    return jnp.mean((mean_a - mean_b) ** 2) + jnp.mean((cov_a - cov_b) ** 2)


def split_mmd(features, in_first) -> jax.Array:
    """DomainBed's Gaussian MMD between A and B: mean K(A, A) + mean K(B, B)
    - 2 mean K(A, B), each mean over all entries of the block, from one kernel matrix
    K [N, N] of the pooled rows (``objectives._gaussian_kernels``): with a = ``in_first``
    and c = 1 - a, mean K(A, A) = a^T K a / |A|^2, mean K(A, B) = a^T K c / (|A| |B|)."""
    x = features.astype(jnp.float32)
    kernel = _gaussian_kernels(x, x)
    a, c = in_first, 1.0 - in_first
    n_a, n_c = jnp.maximum(a.sum(), 1.0), jnp.maximum(c.sum(), 1.0)
    return (a @ kernel @ a / n_a**2 + c @ kernel @ c / n_c**2
            - 2.0 * (a @ kernel @ c) / (n_a * n_c))


_DISTANCES = {"coral": split_coral, "mmd": split_mmd}


def split_penalty(features, in_first, kind: str) -> jax.Array:
    """P = nan_to_num(D(A, B)) when |A| > 1 and |B| > 1, else 0 (the reference's rule),
    D = :func:`split_coral` (``kind`` "coral") or :func:`split_mmd` ("mmd")."""
    if kind not in _DISTANCES:
        raise ValueError(f"unknown CausIRL distance {kind!r}; choose one of "
                         f"{', '.join(_DISTANCES)}")
    count = in_first.sum()
    defined = (count > 1) & (in_first.shape[0] - count > 1)
    value = jnp.nan_to_num(_DISTANCES[kind](features, in_first))
    return jnp.where(defined, value, jnp.float32(0.0))


def _causirl(kind: str):
    def loss(args: Step):
        """L = J + mmd_gamma P, J = mean_m CE(z_m, y_m), P = :func:`split_penalty` of the
        split drawn from ``args.key``; reported: ``loss`` = J, ``penalty`` = P."""
        out = args.forward(args.images)
        m = args.num_domains
        per_domain = args.images.shape[0] // m
        losses = domain_losses(out.logits, args.labels, m)
        data = losses.mean()
        in_first = first_part_mask(split_points(args.key, m, per_domain), per_domain)
        penalty = split_penalty(out.features, in_first, kind)
        total = data + args.hp["mmd_gamma"] * penalty
        return total, make_aux(args, out, {"loss": data, "penalty": penalty}, losses)

    return loss


_MIN_BATCH_REASON = (
    "CausIRL's split point of each domain is drawn from 0..b-1, so with one example per "
    "domain the first part is always empty and the penalty always 0 (the run would be ERM)"
)
for _name, _label, _kind, _summary in (
    ("causirl_coral", "CausIRL_CORAL", "coral",
     "ERM + gamma * CORAL gap between two random splits of the pooled features"),
    ("causirl_mmd", "CausIRL_MMD", "mmd",
     "ERM + gamma * Gaussian MMD between two random splits of the pooled features"),
):
    register_objective(Objective(
        Method(_name, _label, (_MMD_GAMMA,), _summary, "DomainBed (Chevalley et al. 2022)"),
        _causirl(_kind), label_alone=True, min_batch_per_env=2,
        min_batch_reason=_MIN_BATCH_REASON,
    ))
