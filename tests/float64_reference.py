"""Float64 re-statements that the method tests share: a cast of a pytree to float64,
PyTorch's Adam on pytrees, and the per-row cross-entropy; and the tiny network most of
them train (:class:`TanhNet`) with its float64 forward (:func:`tanh_net`).

Each test re-states its method's reference update with these (never with the code it
checks); the arrays are JAX float64 (the tests enable ``jax_enable_x64``) or NumPy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def f64(tree):
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), tree)


def ref_ce(logits, y):
    """Cross-entropy of each row (``F.cross_entropy(..., reduction="none")``)."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]


def adam_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"t": 0, "m": zeros, "v": zeros}


def torch_adam(params, grads, state, lr, wd, betas=(0.9, 0.999)):
    """One step of ``torch.optim.Adam(lr, weight_decay=wd, betas)`` (eps 1e-8) on
    matching pytrees: the coupled decay ``g + wd * w`` enters the moments; the step is
    ``lr * (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)``, as PyTorch writes it.
    Returns the new parameters and state."""
    b1, b2 = betas
    t = state["t"] + 1
    g = jax.tree.map(lambda gr, w: gr + wd * w, grads, params)
    m = jax.tree.map(lambda a, b: b1 * a + (1 - b1) * b, state["m"], g)
    v = jax.tree.map(lambda a, b: b2 * a + (1 - b2) * b * b, state["v"], g)
    new = jax.tree.map(lambda w, a, b: w - lr * (a / (1 - b1**t))
                       / (jnp.sqrt(b) / np.sqrt(1 - b2**t) + 1e-8), params, m, v)
    return new, {"t": t, "m": m, "v": v}


class TanhNet(nn.Module):
    """features = tanh(flatten(x) @ body + b), logits = features @ classifier + c."""

    dim: int
    classes: int

    @nn.compact
    def __call__(self, x, train: bool, mixstyle: bool = False, features: bool = False):
        h = jnp.tanh(nn.Dense(self.dim, name="body")(x.reshape(x.shape[0], -1)))
        logits = nn.Dense(self.classes, name="classifier")(h)
        return (h, logits) if features else logits


class ConvTanhNet(nn.Module):
    """:class:`TanhNet` with a convolution for its body (a VALID ``kernel``, the image's
    size: one position): features = tanh(flatten(conv(x))), for the tests that look for
    the step's convolutions (where XLA's CPU backend runs them)."""

    dim: int
    classes: int
    kernel: tuple

    @nn.compact
    def __call__(self, x, train: bool, mixstyle: bool = False, features: bool = False):
        h = nn.Conv(self.dim, self.kernel, padding="VALID", name="body")(x)
        h = jnp.tanh(h.reshape(h.shape[0], -1))
        logits = nn.Dense(self.classes, name="classifier")(h)
        return (h, logits) if features else logits


def tanh_net(p, x):
    """:class:`TanhNet`'s (features, logits) from its parameters ``p``, in their dtype."""
    h = jnp.tanh(x.reshape(len(x), -1) @ p["body"]["kernel"] + p["body"]["bias"])
    return h, h @ p["classifier"]["kernel"] + p["classifier"]["bias"]
