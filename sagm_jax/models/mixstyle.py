"""MixStyle (Zhou et al., "Domain Generalization with MixStyle", ICLR 2021).

This module owns the feature-statistics mixing layer. For a batch of feature
maps ``x`` of shape [B, H, W, C] (NHWC) it computes, per example ``b`` and
channel ``c``, the instance statistics over the spatial axes

    mu[b, c]    = mean_{h,w} x[b, h, w, c]
    sigma[b, c] = sqrt(var_{h,w} x[b, h, w, c] + eps)

where ``var`` is the unbiased (N - 1) variance, as ``torch.Tensor.var`` computes it
in the reference code. Both are treated as constants (stop-gradient, the
reference's ``.detach()``). With a random permutation ``perm`` of the batch and
weights ``lam[b] ~ Beta(alpha, alpha)`` it returns

    mu_mix    = lam * mu + (1 - lam) * mu[perm]
    sigma_mix = lam * sigma + (1 - lam) * sigma[perm]
    out       = (x - mu) / sigma * sigma_mix + mu_mix.

The whole batch is restyled with probability ``p`` (one draw per batch);
otherwise ``out = x``. The layer is active only when the caller asks for it
(``active=True``), which the networks set to ``train and mixstyle``; all random
draws come from the Linen rng stream ``'mixstyle'``, so a call is a pure
function of its inputs and that key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

MIXSTYLE_RNG = "mixstyle"


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


class MixStyle(nn.Module):
    """Mixes instance statistics across a random permutation of the batch.

    Attributes:
      p: probability that a given call restyles the batch.
      alpha: parameter of the symmetric Beta distribution of the mixing weights.
      eps: added to the variance before the square root.
    """

    p: float = 0.5
    alpha: float = 0.1
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array, active: bool) -> jax.Array:
        if not active:
            return x
        apply_key, lam_key, perm_key = jax.random.split(self.make_rng(MIXSTYLE_RNG), 3)
        batch = x.shape[0]
        lam = jax.random.beta(lam_key, self.alpha, self.alpha, (batch,))
        perm = jax.random.permutation(perm_key, batch)
        mixed = mix_statistics(x, lam, perm, self.eps)
        # One coin per batch, as in the reference (`random.random() > p` skips).
        apply = jax.random.uniform(apply_key) < self.p
        # Recorded only when the caller makes 'intermediates' mutable (tests, debugging);
        # Linen's init leaves that collection out by default.
        self.sow("intermediates", "draws", {"applied": apply, "lam": lam, "perm": perm})
        return jnp.where(apply, mixed, x)
