"""Local sharpness h_rho, the measure of the paper's Figure 3.

For a dataset ``D`` (for example a target domain)::

    g        = grad L_D(w)
    h_rho(w) = L_D(w + rho * g / (||g|| + eps)) - L_D(w)

A smaller ``h`` at the same ``rho`` means a flatter minimum; near a minimum
``sigma_max(Hessian) ~ 2 h / rho**2``. ``L_D`` is the mean loss over EVERY
example of ``D``: the data come as batches whose ``loss_fn`` returns a sum and a
count, so a padded, masked last batch weighs exactly its real examples.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np


def sharpness(
    loss_fn: Callable, params, batches: Iterable, rhos: Sequence[float], eps: float = 1e-12
) -> dict:
    """Computes ``h_rho`` at ``params`` for every ``rho`` in ``rhos``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> (loss_sum, count)``: the SUM of the
        per-example losses of the batch and the number of examples counted
        (the mask's sum for a padded batch), two scalars; anything else (a mean loss
        alone) is a TypeError saying so. It is jitted here.
      params: the point ``w``.
      batches: the dataset ``D``, iterated once per rho plus once: a list, or a
        re-iterable whose ``__iter__`` starts a fresh pass (a one-shot iterator is
        read into a list first).
      rhos: the radii.
      eps: added to ``||g||`` so a zero gradient gives ``h = 0``.

    Returns:
      ``{"loss": L_D(w), "grad_norm": ||g||, "rho": [...], "sharpness": [h_rho, ...]}``
      as Python floats (accumulated in float64 on the host).
    """
    if isinstance(batches, Iterator):
        batches = list(batches)
    if not any(True for _ in batches):
        raise ValueError("sharpness() needs at least one batch of the dataset D.")
    _check_loss_fn(loss_fn, params, next(iter(batches)))
    sum_and_count = jax.jit(loss_fn)
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

    total, count = 0.0, 0.0
    grad_sum = jax.tree.map(lambda w: np.zeros(np.shape(w), np.float64), params)
    for batch in batches:
        (loss_sum, n), g = value_and_grad(params, batch)
        total += float(loss_sum)
        count += float(n)
        grad_sum = jax.tree.map(lambda a, b: a + np.asarray(b, np.float64), grad_sum, g)
    if count <= 0:
        raise ValueError("sharpness(): the batches hold no counted example.")
    clean_loss = total / count
    grads = jax.tree.map(lambda x: x / count, grad_sum)
    grad_norm = float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(grads))))

    curve = []
    for rho in rhos:
        scale = rho / (grad_norm + eps)
        shifted = jax.tree.map(
            lambda w, g: (np.asarray(w, np.float64) + scale * g).astype(np.asarray(w).dtype),
            params,
            grads,
        )
        perturbed_total = 0.0
        for batch in batches:
            loss_sum, _ = sum_and_count(shifted, batch)
            perturbed_total += float(loss_sum)
        curve.append(perturbed_total / count - clean_loss)
    return {
        "loss": clean_loss,
        "grad_norm": grad_norm,
        "rho": [float(r) for r in rhos],
        "sharpness": curve,
    }


def _check_loss_fn(loss_fn: Callable, params, batch) -> None:
    """TypeError unless ``loss_fn(params, batch)`` returns ``(loss_sum, count)``, two
    scalars, found from its shapes alone (``jax.eval_shape``: nothing is computed). A
    mean loss would otherwise meet JAX's "expected function with aux output" error."""
    out = jax.eval_shape(loss_fn, params, batch)
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if pair and all(hasattr(x, "shape") and x.shape == () for x in out):
        return
    shapes = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", out)
    got = f"a {shapes} array" if hasattr(out, "shape") else f"{type(out).__name__} {shapes}"
    raise TypeError(
        "sharpness(): loss_fn(params, batch) must return (loss_sum, count): the SUM of the "
        "batch's per-example losses and the number of examples counted, two scalars (a "
        f"mean loss f: lambda p, b: (f(p, b) * n, n) with n the batch's size); it returned {got}."
    )

