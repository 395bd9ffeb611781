"""Float64 re-statements that the method tests share: a cast of a pytree to float64,
PyTorch's Adam on pytrees, and the per-row cross-entropy.

Each test re-states its method's reference update with these (never with the code it
checks); the arrays are JAX float64 (the tests enable ``jax_enable_x64``) or NumPy."""

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
