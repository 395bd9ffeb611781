"""sagm_jax.methods.representation (RSC, SelfReg) against float64 re-statements of
DomainBed's ``domainbed/algorithms.py`` classes ``RSC`` and ``SelfReg``.

The network is a linear featurizer (phi = flattened image @ W1) and DomainBed's linear
classifier (z = phi @ W2 + b2). RSC's reference is NumPy (its feature gradient is W2's
true-class column, its percentiles ``np.percentile``); SelfReg's is JAX in float64,
written here independently of the package, differentiated by ``jax.grad``. The random
draws (SelfReg's Beta weight and within-class partners, the frozen projection's initial
values) are taken from the package's draw functions and re-applied here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import digits_config

from sagm_jax import methods
from sagm_jax.methods import objectives, representation
from sagm_jax.methods.objectives import Outputs
from sagm_jax.training import loading, train

HEIGHT, WIDTH, DIM, CLASSES = 2, 5, 6, 3


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(0, 0.5, (HEIGHT * WIDTH, DIM)), jnp.float32),
        "classifier": {"kernel": jnp.asarray(rng.normal(0, 0.8, (DIM, CLASSES)), jnp.float32),
                       "bias": jnp.asarray(rng.normal(0, 0.3, (CLASSES,)), jnp.float32)},
    }


def make_batch(num_domains, per_domain, seed=0):
    rng = np.random.default_rng(seed + 50)
    n = num_domains * per_domain
    images = rng.normal(0, 1, (n, HEIGHT, WIDTH, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, n).astype(np.int32)
    return images, labels


def make_forward(params):
    def classify(features):
        head = params["classifier"]
        return features @ head["kernel"] + head["bias"]

    def forward(images):
        features = images.reshape(images.shape[0], -1) @ params["w1"]
        return Outputs(features, classify(features), {"stats": 1}, classify)

    return forward


@functools.cache
def _jitted_loss_and_grad(name, hp_items, m, advance):
    """One compiled value-and-grad per objective, hyperparameters, M and pass."""

    def loss(prm, images, labels, state, step, key):
        return objectives.objective_loss(
            name, dict(hp_items), make_forward(prm), images, labels, num_domains=m,
            state=state, step=step, key=key, advance=advance, params=prm,
        )

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def loss_and_grad(name, params, images, labels, m, *, hp=None, state, step=0, key=None,
                  advance=True):
    fn = _jitted_loss_and_grad(name, tuple(sorted((hp or {}).items())), m, advance)
    return fn(params, jnp.asarray(images), jnp.asarray(labels), state, jnp.int32(step),
              jax.random.PRNGKey(3) if key is None else key)


def close(actual, expected, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


def close_tree(actual, expected, rtol=1e-4, atol=1e-6):
    jax.tree.map(lambda a, e: close(a, np.asarray(e, np.float64), rtol, atol), actual, expected)


def np_softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ----------------------------------------------------------------------------
# RSC.


def np_rsc(params, images, labels, f_drop, b_drop):
    """DomainBed's RSC.update in float64: the loss, its gradients and the examples muted."""
    w1 = np.asarray(params["w1"], np.float64)
    w2 = np.asarray(params["classifier"]["kernel"], np.float64)
    b2 = np.asarray(params["classifier"]["bias"], np.float64)
    x = np.asarray(images, np.float64).reshape(len(images), -1)
    n, rows = len(labels), np.arange(len(labels))
    one_hot = np.eye(CLASSES)[labels]
    feats = x @ w1
    logits = feats @ w2 + b2
    grads = one_hot @ w2.T  # d/dphi sum(z * one_hot) of a linear classifier
    cut = np.percentile(grads, (1 - f_drop) * 100, axis=1)[:, None]
    mask_f = (grads < cut).astype(np.float64)
    muted = (feats * mask_f) @ w2 + b2
    changes = np_softmax(logits)[rows, labels] - np_softmax(muted)[rows, labels]
    keep = changes < np.percentile(changes, (1 - b_drop) * 100)
    mask = np.logical_or(mask_f, keep[:, None]).astype(np.float64)
    z = (feats * mask) @ w2 + b2
    probs = np_softmax(z)
    loss = -np.log(probs[rows, labels]).mean()
    dz = (probs - one_hot) / n
    dfeat = (dz @ w2.T) * mask
    grad = {"w1": x.T @ dfeat, "classifier": {"kernel": (feats * mask).T @ dz,
                                              "bias": dz.sum(axis=0)}}
    return loss, grad, int((~keep).sum())


@pytest.mark.parametrize("f_drop,b_drop", [(1 / 3, 1 / 3), (0.2, 0.45)])
def test_rsc_loss_and_gradients_are_the_reference(f_drop, b_drop):
    m, b = 3, 4
    params, (images, labels) = make_params(), make_batch(m, b)
    hp = {"rsc_f_drop_factor": f_drop, "rsc_b_drop_factor": b_drop}
    (loss, aux), grad = loss_and_grad("rsc", params, images, labels, m, hp=hp, state={})
    expected, expected_grad, muted = np_rsc(params, images, labels, f_drop, b_drop)
    assert 0 < muted < m * b  # some examples are muted, some keep every feature
    close(loss, expected)
    close(aux.metrics["loss"], expected)
    assert set(aux.metrics) == {"loss"} and aux.batch_stats == {"stats": 1}
    close(aux.domain_losses.mean(), expected)
    close_tree(grad, expected_grad)


def test_rsc_needs_the_classifier():
    images, labels = make_batch(2, 2)

    def forward(x):
        return Outputs(x.reshape(len(x), -1), x.reshape(len(x), -1)[:, :CLASSES], {})

    with pytest.raises(ValueError, match="classify"):
        objectives.objective_loss("rsc", {}, forward, jnp.asarray(images), jnp.asarray(labels),
                                  num_domains=2, state={}, step=jnp.int32(0),
                                  key=jax.random.PRNGKey(0), advance=True)


# ----------------------------------------------------------------------------
# SelfReg.


def ref_selfreg_loss(params, projection, images, labels, lam, first, second):
    """DomainBed's SelfReg loss in float64 JAX. The reference sorts the batch by label and
    shuffles within each class's block; pairing row i with ``first[i]`` and ``second[i]``
    (same class) in the unsorted order is the same pairing, relabelled."""
    x = jnp.asarray(images, jnp.float64).reshape(len(images), -1)
    feat = x @ params["w1"]
    head = params["classifier"]
    output = feat @ head["kernel"] + head["bias"]
    proj = feat
    for i in range(3):
        proj = proj @ projection[f"linear_{i}"]["kernel"] + projection[f"linear_{i}"]["bias"]
        centred = proj - proj.mean(axis=0)
        proj = centred / jnp.sqrt((centred ** 2).mean(axis=0) + 1e-5)
        proj = proj * projection[f"norm_{i}"]["scale"] + projection[f"norm_{i}"]["bias"]
        if i < 2:
            proj = jnp.maximum(proj, 0.0)
    output_2, feat_2 = output[first], proj[first]
    output_3 = lam * output_2 + (1 - lam) * output[second]
    feat_3 = lam * feat_2 + (1 - lam) * proj[second]

    def mse(a, b):
        return jnp.mean((a - b) ** 2)

    log_probs = output - jax.scipy.special.logsumexp(output, axis=1, keepdims=True)
    cl_loss = -jnp.mean(log_probs[jnp.arange(len(labels)), labels])
    c_scale = jnp.minimum(jax.lax.stop_gradient(cl_loss), 1.0)
    return cl_loss + c_scale * (lam * (mse(output, output_2) + 0.3 * mse(feat, feat_2))
                                + (1 - lam) * (mse(output, output_3) + 0.3 * mse(feat, feat_3)))


_draws = jax.jit(representation.selfreg_draws)


def reference_value_and_grad(params, projection, images, labels, key):
    lam, first, second = _draws(key, jnp.asarray(labels))
    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree.map(lambda v: jnp.asarray(np.asarray(v), jnp.float64), tree)
        fn = jax.jit(jax.value_and_grad(ref_selfreg_loss, argnums=(0, 1)))
        loss, grads = fn(to64(params), to64(projection), images, jnp.asarray(labels),
                         float(lam), np.asarray(first), np.asarray(second))
        return float(loss), jax.tree.map(np.asarray, grads)


def test_selfreg_draws_pair_within_classes():
    labels = jnp.asarray(np.random.default_rng(0).integers(0, 4, 40), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    lams, firsts, seconds = jax.jit(jax.vmap(_draws, in_axes=(0, None)))(keys, labels)
    for partner in np.concatenate([firsts, seconds]):
        assert sorted(partner.tolist()) == list(range(40))
        np.testing.assert_array_equal(np.asarray(labels)[partner], labels)
    # Beta(0.5, 0.5): mean 1/2, variance 1/8.
    assert abs(np.mean(lams) - 0.5) < 0.08 and abs(np.var(lams) - 0.125) < 0.03


def test_selfreg_frozen_projection_is_the_reference_and_never_moves():
    m, b = 2, 6
    params, (images, labels) = make_params(1), make_batch(m, b, seed=1)
    state = objectives.init_state("selfreg", m)
    keys = [jax.random.PRNGKey(10), jax.random.PRNGKey(11), jax.random.PRNGKey(12)]
    (loss, aux), grad = loss_and_grad("selfreg", params, images, labels, m, state=state,
                                      key=keys[0])
    stored = aux.state["projection_key"]
    assert np.any(np.asarray(stored) != 0)  # step 0 drew it
    projection = jax.jit(representation.init_projection, static_argnums=1)(
        jax.random.wrap_key_data(stored), DIM)
    assert projection["linear_0"]["kernel"].shape == (DIM, 2 * DIM)
    assert float(jnp.abs(projection["linear_0"]["kernel"]).max()) <= DIM ** -0.5
    expected, (expected_grad, _) = reference_value_and_grad(params, projection, images, labels,
                                                            keys[0])
    close(loss, expected)
    close(aux.metrics["loss"], expected)
    close_tree(grad, expected_grad)
    # Later steps (and a perturbed pass, advance=False) keep the step-0 projection.
    moved = jax.tree.map(lambda p: p * 1.1, params)
    for step, key, advance in ((1, keys[1], True), (2, keys[2], False)):
        (loss, aux), grad = loss_and_grad("selfreg", moved, images, labels, m, state=aux.state,
                                          step=step, key=key, advance=advance)
        np.testing.assert_array_equal(aux.state["projection_key"], stored)
        expected, (expected_grad, _) = reference_value_and_grad(moved, projection, images,
                                                                labels, key)
        close(loss, expected)
        close_tree(grad, expected_grad)
    assert "method" not in grad  # nothing for an optimizer to move


def test_selfreg_trained_projection_gets_its_gradient():
    m, b = 3, 4
    params, (images, labels) = make_params(2), make_batch(m, b, seed=2)
    hp = {"selfreg_projection": "trained"}
    shapes = methods.networks.Shapes((HEIGHT, WIDTH, 1), DIM, CLASSES, m)
    own = representation._init_trained_projection(jax.random.PRNGKey(4), shapes, hp)
    assert representation._init_trained_projection(jax.random.PRNGKey(4), shapes,
                                                    {"selfreg_projection": "frozen"}) == {}
    params = {**params, "method": own["params"]}
    key = jax.random.PRNGKey(9)
    (loss, _), grad = loss_and_grad("selfreg", params, images, labels, m, hp=hp,
                                      state=objectives.init_state("selfreg", m), key=key)
    base = {k: v for k, v in params.items() if k != "method"}
    expected, (expected_grad, expected_projection) = reference_value_and_grad(
        base, params["method"], images, labels, key)
    close(loss, expected)
    close_tree({k: v for k, v in grad.items() if k != "method"}, expected_grad)
    close_tree(grad["method"], expected_projection, atol=1e-5)
    assert float(jnp.abs(grad["method"]["linear_0"]["kernel"]).max()) > 0


# ----------------------------------------------------------------------------
# End to end: RSC under SAGM, SelfReg (frozen projection) with SWAD.


@pytest.mark.slow
@pytest.mark.parametrize("method", [{"objective": "rsc", "algorithm": "sagm"},
                                    {"objective": "selfreg", "swad": True}],
                         ids=lambda m: "-".join(map(str, m.values())))
def test_trains_end_to_end(tmp_path, method):
    records = train.train_and_evaluate(digits_config(steps=3, eval_every=1, **method),
                                       str(tmp_path))
    assert records[0]["step"] == 0 and records[-1]["step"] == 2  # SWAD records its segments
    assert all(np.isfinite(r["loss"]) for r in records)
    # The frozen projection is no parameter: the run's network carries no "method" variables.
    assert "method" not in loading.load_run(str(tmp_path), "latest")[1]["params"]
