"""sagm_jax.sharpness against the closed form of a least-squares loss, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagm_jax


def test_sharpness_matches_closed_form_with_padded_batches():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(37, 4)), rng.normal(size=37)
    w = {"w": rng.normal(size=4)}
    rhos = [0.0, 0.01, 0.1, 1.0]

    # L(w) = mean 0.5 (x.w - y)^2; g = x^T r / n; L(w + s g/|g|) - L(w) exact.
    residual = x @ w["w"] - y
    loss = 0.5 * np.mean(residual**2)
    g = x.T @ residual / len(y)
    direction = g / np.linalg.norm(g)
    expected = [0.5 * np.mean((x @ (w["w"] + r * direction) - y) ** 2) - loss for r in rhos]

    def loss_fn(params, batch):
        per_example = 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2
        return jnp.sum(per_example * batch["mask"]), jnp.sum(batch["mask"])

    # Batches of 8; the last one padded with garbage that the mask removes.
    pad = 40 - len(y)
    xp = np.concatenate([x, 100 * np.ones((pad, 4))])
    yp = np.concatenate([y, 100 * np.ones(pad)])
    mask = np.concatenate([np.ones(len(y)), np.zeros(pad)])
    batches = [
        {"x": xp[i : i + 8], "y": yp[i : i + 8], "mask": mask[i : i + 8]} for i in range(0, 40, 8)
    ]

    with jax.enable_x64(True):
        result = sagm_jax.sharpness(loss_fn, w, batches, rhos)
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(result["grad_norm"], np.linalg.norm(g), rtol=1e-12)
    np.testing.assert_allclose(result["sharpness"], expected, rtol=1e-9, atol=1e-15)
    assert result["sharpness"][0] == pytest.approx(0.0, abs=1e-15)
    # Quadratic loss: h = rho |g| + rho^2 d^T H d / 2, so it grows faster than linearly.
    assert result["sharpness"][3] > 10 * result["sharpness"][2] > 0


def test_sharpness_at_zero_gradient_is_finite_and_rejects_empty_data():
    loss_fn = lambda p, b: (jnp.sum(0.0 * p["w"]) + b, 1.0)
    result = sagm_jax.sharpness(loss_fn, {"w": jnp.ones(3)}, [jnp.float32(2.0)], [0.05])
    assert result["sharpness"] == [0.0]
    with pytest.raises(ValueError, match="at least one batch"):
        sagm_jax.sharpness(loss_fn, {"w": jnp.ones(3)}, [], [0.05])


def test_a_loss_fn_that_returns_a_scalar_is_named_with_what_it_must_return():
    def mean_loss(params, batch):  # a mean, not (sum, count)
        return jnp.mean((batch - params["w"]) ** 2)

    with pytest.raises(TypeError) as error:
        sagm_jax.sharpness(mean_loss, {"w": jnp.ones(3)}, [jnp.zeros(3)], [0.05])
    message = str(error.value)
    assert message.startswith("sharpness(): loss_fn(params, batch) must return (loss_sum, "
                              "count)"), message
    assert "a float32[] array" in message and "aux output" not in message
