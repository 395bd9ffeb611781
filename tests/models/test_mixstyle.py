"""MixStyle: the mixing formula against NumPy, when it acts, its randomness, its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.models.mixstyle import MixStyle, mix_statistics


def numpy_mixstyle(x, lam, perm, eps):
    """The reference formula in float64: unbiased spatial variance, as torch.Tensor.var."""
    x = np.asarray(x, dtype=np.float64)
    mu = x.mean(axis=(1, 2), keepdims=True)
    sigma = np.sqrt(x.var(axis=(1, 2), keepdims=True, ddof=1) + eps)
    lam = np.asarray(lam, dtype=np.float64).reshape(-1, 1, 1, 1)
    mu_mix = lam * mu + (1 - lam) * mu[perm]
    sigma_mix = lam * sigma + (1 - lam) * sigma[perm]
    return (x - mu) / sigma * sigma_mix + mu_mix, sigma_mix / sigma


def features(seed=0, shape=(6, 5, 4, 3)):
    # Channel-wise offsets and scales, so the per-example statistics differ.
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal(shape) * rng.uniform(0.5, 3, (shape[0], 1, 1, shape[3]))
        + rng.standard_normal((shape[0], 1, 1, shape[3]))
    ).astype(np.float32)


def test_mixing_matches_numpy():
    x = features()
    lam = np.array([0.0, 1.0, 0.3, 0.9, 0.5, 0.01], np.float32)
    perm = np.array([3, 0, 5, 1, 2, 4])
    expected, _ = numpy_mixstyle(x, lam, perm, 1e-6)
    np.testing.assert_allclose(
        mix_statistics(jnp.asarray(x), jnp.asarray(lam), jnp.asarray(perm), 1e-6),
        expected,
        rtol=1e-5,
        atol=1e-5,
    )


def test_layer_matches_numpy_with_its_own_draws():
    """With p=1 the layer is the formula applied with its drawn lam and permutation."""
    x = features(1)
    key = jax.random.PRNGKey(7)
    out, state = MixStyle(p=1.0).apply(
        {}, jnp.asarray(x), active=True, rngs={"mixstyle": key}, mutable=["intermediates"]
    )
    (draws,) = state["intermediates"]["draws"]
    lam, perm = np.asarray(draws["lam"]), np.asarray(draws["perm"])
    assert bool(draws["applied"])
    assert sorted(perm) == list(range(x.shape[0])) and np.all((lam >= 0) & (lam <= 1))
    expected, _ = numpy_mixstyle(x, lam, perm, 1e-6)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out, x)


def test_gradient_treats_statistics_as_constants():
    """d out / d x = sigma_mix / sigma elementwise once mu and sigma are detached."""
    x = features(2)
    lam = np.array([0.2, 0.7, 0.4, 0.9, 0.5, 0.1], np.float32)
    perm = np.array([1, 2, 3, 4, 5, 0])
    weights = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    grad = jax.grad(
        lambda v: jnp.sum(mix_statistics(v, jnp.asarray(lam), jnp.asarray(perm), 1e-6) * weights)
    )(jnp.asarray(x))
    _, ratio = numpy_mixstyle(x, lam, perm, 1e-6)
    np.testing.assert_allclose(grad, weights * ratio, rtol=1e-5, atol=1e-6)


def test_identity_when_inactive_or_never_applied():
    x = jnp.asarray(features())
    layer = MixStyle(p=1.0)
    np.testing.assert_array_equal(layer.apply({}, x, active=False), x)  # needs no rng when off
    np.testing.assert_array_equal(
        MixStyle(p=0.0).apply({}, x, active=True, rngs={"mixstyle": jax.random.PRNGKey(0)}), x
    )


def test_deterministic_given_the_key_and_applied_with_probability_p():
    x = jnp.asarray(features())
    layer = MixStyle(p=0.5)
    run = jax.jit(lambda key: layer.apply({}, x, active=True, rngs={"mixstyle": key}))
    np.testing.assert_array_equal(run(jax.random.PRNGKey(3)), run(jax.random.PRNGKey(3)))
    applied = [
        not np.array_equal(run(key), x) for key in jax.random.split(jax.random.PRNGKey(0), 200)
    ]
    # Binomial(200, 0.5): mean 100, standard deviation ~7; 60..140 is far beyond 5 sigma.
    assert 60 < sum(applied) < 140


def test_init_in_training_mode_returns_only_variables():
    model = models.create("resnet18", 3, mixstyle_after=(1,))
    x = jnp.zeros((2, 32, 32, 3))
    rngs = {"params": jax.random.PRNGKey(0), "mixstyle": jax.random.PRNGKey(1)}
    shapes = jax.eval_shape(lambda: model.init(rngs, x, train=True, mixstyle=True))
    assert set(shapes) == {"params", "batch_stats"}


def test_rejects_a_single_spatial_position():
    with pytest.raises(ValueError, match="1x1"):
        mix_statistics(jnp.ones((2, 1, 1, 3)), jnp.ones(2), jnp.arange(2), 1e-6)


def test_resnet_mixstyle_only_when_training_and_asked():
    model = models.create("resnet18", 3, mixstyle_after=(1, 2, 3))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 32, 32, 3))
    variables = jax.jit(lambda key: model.init(key, x, train=False))(jax.random.PRNGKey(0))
    assert "mixstyle1" not in variables["params"]  # MixStyle has no parameters

    @jax.jit
    def run(key):
        rngs = {"mixstyle": key}
        # Frozen BN and no dropout: the training pass without MixStyle equals evaluation.
        return (
            model.apply(variables, x, train=True, mixstyle=False, rngs=rngs),
            model.apply(variables, x, train=False, mixstyle=True, rngs=rngs),
            model.apply(variables, x, train=True, mixstyle=True, rngs=rngs),
        )

    # Each layer applies with p = 0.5; over 6 keys some call restyles (all skip: 1 / 8^6).
    outputs = [run(key) for key in jax.random.split(jax.random.PRNGKey(2), 6)]
    plain = outputs[0][1]
    for clean_pass, eval_asked, _ in outputs:
        np.testing.assert_allclose(clean_pass, plain, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(eval_asked, plain)
    assert any(not np.allclose(perturbed, plain) for _, _, perturbed in outputs)
