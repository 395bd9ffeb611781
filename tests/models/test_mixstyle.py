"""MixStyle: the mixing formula against NumPy, when it acts, its randomness, its gradient;
crossdomain MixStyle (the SAGM repository's Mixstyle2) against the reference's pairs."""

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.models import mixstyle
from sagm_jax.models.mixstyle import MixStyle, mix_statistics
from sagm_jax.models.synthetic import draw_torchvision_weights


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
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, train=False))
    assert "mixstyle1" not in shapes["params"]  # MixStyle has no parameters
    # Seeded torchvision-shaped weights (compiling the init took 6 s).
    variables = models.convert_torchvision(draw_torchvision_weights("resnet18", 0, num_classes=3))
    assert jax.tree.structure(variables) == jax.tree.structure(shapes)

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


# ----------------------------------------------------------------------------
# Crossdomain MixStyle: the SAGM repository's ``Mixstyle2`` (its ``pair_batches`` and
# ``MixStyle2``, ``domainbed/algorithms/algorithms.py`` and ``domainbed/models/mixstyle.py``).


def numpy_mixstyle2(x, lam, applied, first_shuffles, second_shuffles, b, eps=1e-6):
    """The reference's M forwards in float64. Pair i = (first half of domain i, second
    half of domain (i+1) mod M), B = b rows; in each, its ``MixStyle2``: with
    perm = [B-1, ..., 0] cut in halves perm_b = [B-1..B/2], perm_a = [B/2-1..0], the pair
    takes the partners cat(perm_b[r_b], perm_a[r_a]) with the shuffles r_b, r_a (one
    coin per pair). Returns the restyled batch in the rows' own order."""
    x = np.asarray(x, np.float64)
    m, half = len(x) // b, b // 2
    out = x.copy()
    for i in range(m):
        j = (i + 1) % m
        rows = np.r_[i * b : i * b + half, j * b + half : (j + 1) * b]
        if not applied[i]:
            continue
        reverse = np.arange(b - 1, -1, -1)
        perm_b, perm_a = reverse[:half], reverse[half:]
        local = np.concatenate([perm_b[first_shuffles[i]], perm_a[second_shuffles[i]]])
        out[rows] = numpy_mixstyle(x[rows], lam[rows], local, eps)[0]
    return out


def reference_shuffles(perm, m, b):
    """The shuffles r_b, r_a of each pair that give the layer's partners ``perm``: a
    first-half row k whose partner is local row q >= B/2 has r_b[k] = B-1-q; a second-half
    row k with partner q < B/2 has r_a[k] = B/2-1-q. Each must be a permutation of the
    B/2 positions (the reference's structure: halves of the pair only)."""
    half, firsts, seconds = b // 2, [], []
    for i in range(m):
        j = (i + 1) % m
        rows = np.r_[i * b : i * b + half, j * b + half : (j + 1) * b]
        local = {int(row): index for index, row in enumerate(rows)}
        partners = np.array([local[int(perm[row])] for row in rows])  # KeyError: left the pair
        first, second = b - 1 - partners[:half], half - 1 - partners[half:]
        assert sorted(first) == list(range(half)) and sorted(second) == list(range(half))
        firsts.append(first)
        seconds.append(second)
    return firsts, seconds


def test_crossdomain_matches_the_reference_pairs_with_its_own_draws():
    m, b = 3, 4
    x = features(4, shape=(m * b, 5, 4, 3))
    layer = MixStyle(p=0.5, alpha=0.3, mix="crossdomain", domain_rows=b)
    run = jax.jit(lambda key: layer.apply(
        {}, jnp.asarray(x), active=True, rngs={"mixstyle": key}, mutable=["intermediates"]))
    coins = []
    for key in jax.random.split(jax.random.PRNGKey(5), 8):
        out, state = run(key)
        (draws,) = state["intermediates"]["draws"]
        lam, perm, applied = (np.asarray(draws[k]) for k in ("lam", "perm", "applied"))
        assert applied.shape == (m,) and np.all((lam >= 0) & (lam <= 1))
        firsts, seconds = reference_shuffles(perm, m, b)
        expected = numpy_mixstyle2(x, lam.astype(np.float64), applied, firsts, seconds, b)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        coins.append(applied)
    # One coin per pair: some call restyles one pair and leaves another.
    assert any(c.any() and not c.all() for c in coins)


def test_crossdomain_partners_are_every_cross_pair_row_over_many_draws():
    m, b = 2, 4
    keys = jax.random.split(jax.random.PRNGKey(0), 300)
    perms = np.asarray(jax.vmap(lambda k: mixstyle.crossdomain_partners(k, m, b))(keys))
    # Row 0 (domain 0, first half) takes domain 1's second half, rows 6 and 7, evenly;
    # row 6 takes domain 0's first half, rows 0 and 1; row 2 (domain 0, second half) is
    # pair 1's and takes domain 1's first half, rows 4 and 5.
    for row, allowed in ((0, {6, 7}), (6, {0, 1}), (2, {4, 5})):
        counts = np.bincount(perms[:, row], minlength=m * b)
        assert set(np.flatnonzero(counts)) == allowed
        assert counts[min(allowed)] > 100 and counts[max(allowed)] > 100  # Binomial(300, 1/2)


def test_crossdomain_refuses_a_batch_it_cannot_pair():
    x = jnp.asarray(features(shape=(6, 5, 4, 3)))
    rngs = {"mixstyle": jax.random.PRNGKey(0)}
    for rows in (3, 4, 0):  # odd; 6 rows are not whole domains of 4; unknown
        with pytest.raises(ValueError, match="even number of rows per domain"):
            MixStyle(mix="crossdomain", domain_rows=rows).apply({}, x, active=True, rngs=rngs)
    with pytest.raises(ValueError, match="expected one of random, crossdomain"):
        MixStyle(mix="bogus").apply({}, x, active=True, rngs=rngs)


def test_config_passes_crossdomain_to_the_resnet_and_refuses_what_it_cannot_pair():
    from sagm_jax import config as config_lib

    config = config_lib.base_config()
    config.update(arch="resnet18", pretrained_weights="none", mixstyle=True,
                  mixstyle_mix="crossdomain", mixstyle_after=(1,), batch_per_env=2,
                  algorithm="erm", dataset="PACS", dropout=0.0)
    assert not config_lib.config_problems(config)
    built = {}

    def build():  # traced only: the network from the config, without running it
        built["model"], variables, _ = models.from_config(
            config, 3, (32, 32, 3), jax.random.PRNGKey(0), pretrained=False)
        return variables

    variables, seen = jax.eval_shape(build), []

    def record(call, args, kwargs, context):
        if isinstance(context.module, MixStyle):
            seen.append((context.module.mix, context.module.domain_rows))
        return call(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda v: built["model"].apply(
            v, jnp.zeros((6, 32, 32, 3)), train=True, mixstyle=True,
            rngs={"mixstyle": jax.random.PRNGKey(1)}), variables)
    assert seen == [("crossdomain", 2)]  # one layer, after stage 1, 3 domains of 2 rows
    config.update(batch_per_env=3, perturbation="per_device", algorithm="fish")
    problems = "\n".join(config_lib.config_problems(config))
    for expected in ("batch_per_env=3", "perturbation=per_device", "algorithm=fish"):
        assert f"config.mixstyle_mix=crossdomain with config.{expected}" in problems
    config.mixstyle_mix = "bogus"
    assert "config.mixstyle_mix=bogus" in "\n".join(config_lib.config_problems(config))
