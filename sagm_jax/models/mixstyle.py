"""MixStyle (Zhou et al., "Domain Generalization with MixStyle", ICLR 2021).

This module owns the feature-statistics mixing layer and its two ways of choosing whose
statistics a row takes. For a batch of feature maps ``x`` of shape [B, H, W, C] (NHWC)
it computes, per example ``b`` and channel ``c``, the instance statistics over the
spatial axes

    mu[b, c]    = mean_{h,w} x[b, h, w, c]
    sigma[b, c] = sqrt(var_{h,w} x[b, h, w, c] + eps)

where ``var`` is the unbiased (N - 1) variance, as ``torch.Tensor.var`` computes it
in the reference code. Both are treated as constants (stop-gradient, the
reference's ``.detach()``). With a partner ``perm[b]`` for each row and weights
``lam[b] ~ Beta(alpha, alpha)`` it returns

    mu_mix    = lam * mu + (1 - lam) * mu[perm]
    sigma_mix = lam * sigma + (1 - lam) * sigma[perm]
    out       = (x - mu) / sigma * sigma_mix + mu_mix.

The partners (``mix``):

* ``"random"`` (the SAGM repository's ``MixStyle``, ``domainbed/models/mixstyle.py``):
  ``perm`` is a random permutation of the whole batch, and the whole batch is restyled
  with probability ``p`` (one draw per batch); otherwise ``out = x``.
* ``"crossdomain"`` (its ``MixStyle2`` with the ``Mixstyle2`` algorithm's pairing,
  ``domainbed/algorithms/algorithms.py``): the batch is M domains' minibatches of
  ``domain_rows`` = b rows each, concatenated in order, and b is even. The reference
  forwards M pairs: pair i = (first half of domain i, second half of domain
  (i + 1) mod M), b rows; in a pair each first-half row takes the statistics of a
  second-half row through a random bijection, and each second-half row those of a
  first-half row through another (its ``perm = arange(B-1, -1, -1)`` cut in two halves,
  each half shuffled). Every row is in exactly one pair, so the one forward of the
  whole batch with these partners is the M forwards (frozen BatchNorm). Each pair is
  restyled with probability ``p``, one draw per pair, as each of the reference's
  forwards draws its own.

The layer is active only when the caller asks for it (``active=True``), which the
networks set to ``train and mixstyle``; all random draws come from the Linen rng stream
``'mixstyle'``, so a call is a pure function of its inputs and that key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

MIXSTYLE_RNG = "mixstyle"
# How a row chooses whose statistics it mixes with (module docstring).
MIXES = ("random", "crossdomain")


def mix_statistics(x: jax.Array, lam: jax.Array, perm: jax.Array, eps: float) -> jax.Array:
    """Restyle ``x`` [B, H, W, C] with mixing weights ``lam`` [B] and permutation ``perm`` [B]."""
    height, width = x.shape[1], x.shape[2]
    if height * width < 2:
        raise ValueError(
            f"MixStyle needs at least 2 spatial positions to estimate a variance; got a "
            f"feature map of spatial size {height}x{width} (use a larger input image)."
        )
    mu = jax.lax.stop_gradient(jnp.mean(x, axis=(1, 2), keepdims=True))
    var = jnp.var(x, axis=(1, 2), keepdims=True, ddof=1)
    sigma = jax.lax.stop_gradient(jnp.sqrt(var + eps))
    lam = lam.reshape(-1, 1, 1, 1).astype(x.dtype)
    mu_mix = lam * mu + (1.0 - lam) * mu[perm]
    sigma_mix = lam * sigma + (1.0 - lam) * sigma[perm]
    return (x - mu) / sigma * sigma_mix + mu_mix


def crossdomain_pairs(num_domains: int, domain_rows: int) -> tuple[jax.Array, jax.Array]:
    """The rows of the reference's M pairs: ``(first, second)``, each [M, b/2];
    ``first[i]`` = the first half of domain i, ``second[i]`` = the second half of
    domain (i + 1) mod M (``Mixstyle2.pair_batches``)."""
    half = domain_rows // 2
    starts = jnp.arange(num_domains) * domain_rows
    first = starts[:, None] + jnp.arange(half)[None, :]
    second = jnp.roll(starts, -1)[:, None] + half + jnp.arange(half)[None, :]
    return first, second


def crossdomain_partners(key, num_domains: int, domain_rows: int) -> jax.Array:
    """[M b] partner rows: within pair i, first[i, k] takes second[i, s_i(k)] and
    second[i, k] takes first[i, t_i(k)], with s_i, t_i independent uniform
    permutations of the b/2 positions (the reference's two shuffled halves)."""
    first, second = crossdomain_pairs(num_domains, domain_rows)
    half = domain_rows // 2
    first_key, second_key = jax.random.split(key)
    shuffle = jax.vmap(lambda k: jax.random.permutation(k, half))
    s = shuffle(jax.random.split(first_key, num_domains))
    t = shuffle(jax.random.split(second_key, num_domains))
    partners = jnp.zeros(num_domains * domain_rows, jnp.int32)
    partners = partners.at[first].set(jnp.take_along_axis(second, s, axis=1))
    return partners.at[second].set(jnp.take_along_axis(first, t, axis=1))


def check_crossdomain_batch(batch: int, domain_rows: int) -> int:
    """The number of domains M of a batch of ``batch`` rows, ``domain_rows`` each; a
    ValueError when the batch is not whole domains of an even number of rows (the
    reference's halves; an odd count breaks its ``chunk(2)``)."""
    if domain_rows < 2 or domain_rows % 2 or batch % domain_rows:
        raise ValueError(
            f"crossdomain MixStyle pairs halves of each domain's minibatch: it needs an even "
            f"number of rows per domain (got domain_rows={domain_rows}) and a batch of whole "
            f"domains (got {batch} rows)."
        )
    return batch // domain_rows


class MixStyle(nn.Module):
    """Mixes instance statistics across a random permutation of the batch (``mix`` =
    "random") or across the reference's pairs of domains (``mix`` = "crossdomain").

    Attributes:
      p: probability that a given call restyles the batch (crossdomain: each pair).
      alpha: parameter of the symmetric Beta distribution of the mixing weights.
      eps: added to the variance before the square root.
      mix: one of ``MIXES``.
      domain_rows: crossdomain: the rows b of each domain's minibatch.
    """

    p: float = 0.5
    alpha: float = 0.1
    eps: float = 1e-6
    mix: str = "random"
    domain_rows: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, active: bool) -> jax.Array:
        if self.mix not in MIXES:
            raise ValueError(f"MixStyle mix={self.mix!r}: expected one of {', '.join(MIXES)}.")
        if not active:
            return x
        batch = x.shape[0]
        if self.mix == "crossdomain":
            num_domains = check_crossdomain_batch(batch, self.domain_rows)
        apply_key, lam_key, perm_key = jax.random.split(self.make_rng(MIXSTYLE_RNG), 3)
        lam = jax.random.beta(lam_key, self.alpha, self.alpha, (batch,))
        if self.mix == "random":
            perm = jax.random.permutation(perm_key, batch)
            # One coin per batch, as in the reference (`random.random() > p` skips).
            apply = jax.random.uniform(apply_key) < self.p
            rows_applied = jnp.broadcast_to(apply, (batch,))
        else:
            perm = crossdomain_partners(perm_key, num_domains, self.domain_rows)
            # One coin per pair: the reference forwards each pair on its own.
            apply = jax.random.uniform(apply_key, (num_domains,)) < self.p
            first, second = crossdomain_pairs(num_domains, self.domain_rows)
            rows_applied = jnp.zeros(batch, bool).at[first].set(apply[:, None])
            rows_applied = rows_applied.at[second].set(apply[:, None])
        mixed = mix_statistics(x, lam, perm, self.eps)
        # Recorded only when the caller makes 'intermediates' mutable (tests, debugging);
        # Linen's init leaves that collection out by default.
        self.sow("intermediates", "draws", {"applied": apply, "lam": lam, "perm": perm})
        return jnp.where(rows_applied.reshape(-1, 1, 1, 1), mixed, x)
