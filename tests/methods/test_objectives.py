"""sagm_jax.methods.objectives against float64 NumPy re-statements of DomainBed's
``domainbed/algorithms.py`` (``ERM``, ``Mixup``, ``CORAL``, ``MMD``, ``GroupDRO``, ``IRM``,
``VREx``) and the SAGM authors' ``CutMix`` (``Wang-pengfei/SAGM``,
``domainbed/algorithms/algorithms.py``).

The network is linear (features = flattened image @ W1, logits = features @ W2), so the
re-statements below compute every loss, penalty and the gradients they need by hand;
the package's own output is never the reference. Random draws (Mixup's pairs, CutMix's
box) are taken from the package's draw functions and then re-applied here.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sagm_jax import methods
from sagm_jax.methods import objectives
from sagm_jax.methods.objectives import Outputs

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 6, 5, 2, 3, 4

# ----------------------------------------------------------------------------
# The network, in JAX (what the objectives receive) and in float64 NumPy.


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(0, 0.3, (HEIGHT * WIDTH * CHANNELS, DIM)), jnp.float32),
        "w2": jnp.asarray(rng.normal(0, 0.7, (DIM, CLASSES)), jnp.float32),
    }


def make_batch(num_domains, per_domain, seed=0):
    rng = np.random.default_rng(seed + 100)
    n = num_domains * per_domain
    images = rng.normal(0, 1, (n, HEIGHT, WIDTH, CHANNELS)).astype(np.float32)
    labels = rng.integers(0, CLASSES, n).astype(np.int32)
    return images, labels


# The objectives a forward of the network alone evaluates: MTL's loss reads its own
# classifier from Step.params (tests/methods/test_adaptive.py checks it).
# Fishr differentiates the network's classifier (Step.params) and keeps its EMA in the
# method's batch_stats (tests/methods/test_fishr.py checks it).
# IGA differentiates the network's pass at other parameters (Step.forward_at;
# tests/methods/test_inter_gradient.py checks it, on 1 and 8 devices too).
NETWORK_ALONE = [name for name in methods.OBJECTIVES
                 if name not in ("mtl", "miro", "fishr", "iga")]


def make_forward(params, calls=None, dtype=jnp.float32):
    def forward(images):
        if calls is not None:
            calls.append(images.shape)
        features = images.reshape(images.shape[0], -1).astype(dtype) @ params["w1"].astype(dtype)
        return Outputs(features, features @ params["w2"].astype(dtype), {"stats": 1},
                       lambda other: other.astype(dtype) @ params["w2"].astype(dtype))

    return forward


def run(objective, params, images, labels, num_domains, *, hp=None, state=None, step=0,
        key=None, advance=True):
    state = objectives.init_state(objective, num_domains) if state is None else state
    return objectives.objective_loss(
        objective, hp or {}, make_forward(params), jnp.asarray(images), jnp.asarray(labels),
        num_domains=num_domains, state=state, step=jnp.int32(step),
        key=jax.random.PRNGKey(0) if key is None else key, advance=advance,
    )


def np_params(params):
    return {k: np.asarray(v, np.float64) for k, v in params.items()}


def np_forward(p, images):
    features = np.asarray(images, np.float64).reshape(len(images), -1) @ p["w1"]
    return features, features @ p["w2"]


def np_softmax(logits):
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def np_cross_entropy(logits, labels):
    """Per-row cross-entropy."""
    return -np.log(np_softmax(logits)[np.arange(len(labels)), labels])


def np_domain_losses(logits, labels, m):
    return np_cross_entropy(logits, labels).reshape(m, -1).mean(axis=1)


def np_coral(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = a.shape[1]
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)  # 1/(n-1)
    return (np.sum((a.mean(0) - b.mean(0)) ** 2) / d
            + np.sum((cov_a - cov_b) ** 2) / d**2)


def np_mmd(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)

    def kernel(x, y):
        distance = np.maximum(((x[:, None, :] - y[None, :, :]) ** 2).sum(-1), 1e-30)
        return sum(np.exp(-g * distance) for g in (1e-3, 1e-2, 1e-1, 1, 10, 100, 1000))

    return kernel(a, a).mean() + kernel(b, b).mean() - 2 * kernel(a, b).mean()


def np_pairwise(features, distance):
    pairs = list(itertools.combinations(range(len(features)), 2))
    return sum(distance(features[i], features[j]) for i, j in pairs) / len(pairs) if pairs else 0.0


def np_scale_gradient(logits, labels, h=1e-6):
    """d/ds mean CE(s z, y) at s = 1, by central differences (the definition)."""
    ce = lambda s: np_cross_entropy(s * logits, labels).mean()  # noqa: E731
    return (ce(1 + h) - ce(1 - h)) / (2 * h)


def np_irm_penalty(logits, labels):
    return np.mean([np_scale_gradient(z[0::2], y[0::2]) * np_scale_gradient(z[1::2], y[1::2])
                    for z, y in zip(logits, labels)])


def close(actual, expected, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# The table and the state.


def test_names_state_and_unknown_objective():
    for call in (lambda: objectives.init_state("bogus", 2),
                 lambda: objectives.reset_optimizer_step("bogus", {}),
                 lambda: run("bogus", make_params(), *make_batch(2, 2), 2)):
        with pytest.raises(ValueError, match="'bogus'.*erm, mixup, cutmix.*vrex"):
            call()
    assert objectives.init_state("erm", 3) == {}
    np.testing.assert_array_equal(objectives.init_state("groupdro", 3)["q"], np.ones(3))
    assert objectives.reset_optimizer_step("irm", {"irm_penalty_anneal_iters": 7}) == 7
    assert objectives.reset_optimizer_step("vrex", {}) == 500  # the registry's default
    assert objectives.reset_optimizer_step("coral", {"irm_penalty_anneal_iters": 7}) is None


@pytest.mark.parametrize("objective", NETWORK_ALONE)
def test_one_forward_float32_losses_and_metrics(objective):
    m, b = 3, 4
    images, labels = make_batch(m, b)
    calls = []
    # Traced only (eval_shape): the calls, dtypes and shapes, without running anything.
    loss, aux = jax.eval_shape(lambda x, y: objectives.objective_loss(
        objective, {}, make_forward(make_params(), calls, jnp.bfloat16), x, y,
        num_domains=m, state=objectives.init_state(objective, m), step=jnp.int32(0),
        key=jax.random.PRNGKey(1), advance=True,
    ), images, labels)
    assert calls == [images.shape]
    assert loss.dtype == jnp.float32 and aux.domain_losses.shape == (m,)
    assert set(aux.batch_stats) == {"stats"}
    expected = {"coral": {"loss", "penalty"}, "mmd": {"loss", "penalty"},
                "sd": {"loss", "penalty"}, "causirl_coral": {"loss", "penalty"},
                "causirl_mmd": {"loss", "penalty"},
                "irm": {"loss", "nll", "penalty"}, "vrex": {"loss", "nll", "penalty"},
                "ib_erm": {"loss", "nll", "IB_penalty"},
                "ib_irm": {"loss", "nll", "IRM_penalty", "IB_penalty"},
                "cad": {"loss", "clf_loss", "bn_loss"},
                "condcad": {"loss", "clf_loss", "bn_loss"},
                "rdm": {"loss", "erm_loss", "matching_penalty", "variance_penalty"}}
    assert set(aux.metrics) == expected.get(objective, {"loss"})
    assert all(v.dtype == jnp.float32 and v.shape == () for v in aux.metrics.values())


# ----------------------------------------------------------------------------
# ERM, CORAL, MMD (sections 1 and 7).


def test_erm_is_the_mean_cross_entropy():
    params, (images, labels) = make_params(), make_batch(3, 4)
    loss, aux = run("erm", params, images, labels, 3)
    logits = np_forward(np_params(params), images)[1]
    close(loss, np_cross_entropy(logits, labels).mean())
    close(aux.domain_losses, np_domain_losses(logits, labels, 3))


def test_coral_penalty_scales_by_d_and_d_squared():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0, 1, (6, 5)), rng.normal(0.5, 2, (7, 5))
    close(objectives.coral_penalty(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)),
          np_coral(a.astype(np.float32), b.astype(np.float32)))
    # A pure mean shift of 1 in every one of d columns costs d / d = 1, not d.
    shifted = a + 1.0
    close(objectives.coral_penalty(jnp.asarray(a, jnp.float32), jnp.asarray(shifted, jnp.float32)),
          1.0, rtol=1e-5)


def test_mmd_penalty_and_its_distance_clamp():
    rng = np.random.default_rng(4)
    a, b = rng.normal(0, 0.3, (5, 3)), rng.normal(0.2, 0.3, (6, 3))
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    close(objectives.mmd_penalty(jnp.asarray(a32), jnp.asarray(b32)), np_mmd(a32, b32),
          rtol=1e-4)
    # 3000 and the next float32 above it: ||u||^2 + ||v||^2 - 2 u.v rounds to -1 in float32,
    # whose unclamped kernel exp(1000) is infinite; the clamp keeps it at 1 per bandwidth.
    u = np.array([[3000.0]], np.float32)
    v = np.nextafter(u, np.float32(4000))
    value = objectives.mmd_penalty(jnp.asarray(u), jnp.asarray(v))
    assert np.isfinite(value)
    close(value, np_mmd(u, v), atol=1e-3)


@pytest.mark.parametrize("kind,distance", [("coral", np_coral), ("mmd", np_mmd)])
def test_pairwise_penalty_is_the_mean_over_domain_pairs(kind, distance):
    features = np.random.default_rng(5).normal(0, 0.4, (3, 6, 4)).astype(np.float32)
    close(objectives.pairwise_penalty(jnp.asarray(features), kind),
          np_pairwise(features, distance), rtol=1e-4)
    assert float(objectives.pairwise_penalty(jnp.asarray(features[:1]), kind)) == 0.0


@pytest.mark.parametrize("objective,distance", [("coral", np_coral), ("mmd", np_mmd)])
def test_feature_matching_objective_reports_data_term_only(objective, distance):
    params, (images, labels) = make_params(), make_batch(3, 4)
    loss, aux = run(objective, params, images, labels, 3, hp={"mmd_gamma": 0.7})
    features, logits = np_forward(np_params(params), images)
    data = np_cross_entropy(logits, labels).mean()
    penalty = np_pairwise(features.reshape(3, 4, -1), distance)
    close(loss, data + 0.7 * penalty, rtol=1e-4)
    close(aux.metrics["loss"], data)
    close(aux.metrics["penalty"], penalty, rtol=1e-4)


# ----------------------------------------------------------------------------
# IRM and VREx (sections 9 and 10).


def np_irm_penalty_grad(logits, labels):
    """d penalty / d logits by hand: d g / d z_ik = (p_k + p_k (z_k - sum_c p_c z_c)
    - [k = y_i]) / n for the rows of g's half; penalty = mean_m g_even g_odd."""
    grad = np.zeros_like(logits)
    m = len(logits)
    halves = (slice(0, None, 2), slice(1, None, 2))
    for d in range(m):
        g = [np_scale_gradient(logits[d][rows], labels[d][rows]) for rows in halves]
        for h, rows in enumerate(halves):
            z, y = logits[d][rows], labels[d][rows]
            p = np_softmax(z)
            dg = p + p * (z - (p * z).sum(-1, keepdims=True))
            dg[np.arange(len(y)), y] -= 1
            grad[d][rows] = g[1 - h] * dg / len(y) / m
    return grad


def test_irm_penalty_and_its_gradient():
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 1.5, (3, 5, CLASSES)).astype(np.float32)  # odd b: halves 3 and 2
    labels = rng.integers(0, CLASSES, (3, 5))
    close(objectives.irm_penalty(jnp.asarray(logits), jnp.asarray(labels)),
          np_irm_penalty(logits.astype(np.float64), labels), rtol=1e-4, atol=1e-7)
    grad = jax.grad(objectives.irm_penalty)(jnp.asarray(logits), jnp.asarray(labels))
    close(grad, np_irm_penalty_grad(logits.astype(np.float64), labels), rtol=1e-4, atol=1e-7)


def np_irm_loss(p, images, labels, m, weight):
    logits = np_forward(p, images)[1]
    return (np_cross_entropy(logits, labels).mean()
            + weight * np_irm_penalty(logits.reshape(m, -1, CLASSES), labels.reshape(m, -1)))


def test_irm_weight_switches_at_the_anneal_step_and_gradient_is_second_order():
    params, (images, labels) = make_params(), make_batch(3, 4)
    hp = {"irm_lambda": 50.0, "irm_penalty_anneal_iters": 3}
    p = np_params(params)
    for step, weight in ((2, 1.0), (3, 50.0), (9, 50.0)):
        loss, aux = run("irm", params, images, labels, 3, hp=hp, step=step)
        close(loss, np_irm_loss(p, images, labels, 3, weight), rtol=1e-4)
    logits = np_forward(p, images)[1]
    close(aux.metrics["nll"], np_cross_entropy(logits, labels).mean())
    close(aux.metrics["penalty"],
          np_irm_penalty(logits.reshape(3, 4, -1), labels.reshape(3, 4)), rtol=1e-4, atol=1e-7)
    # d loss / d w2 at weight 50 against central differences of the re-statement.
    grad = jax.grad(lambda q: run("irm", q, images, labels, 3, hp=hp, step=3)[0])(params)
    expected = np.zeros_like(p["w2"])
    for index in np.ndindex(*p["w2"].shape):
        up, down = {**p, "w2": p["w2"].copy()}, {**p, "w2": p["w2"].copy()}
        up["w2"][index] += 1e-4
        down["w2"][index] -= 1e-4
        expected[index] = (np_irm_loss(up, images, labels, 3, 50.0)
                           - np_irm_loss(down, images, labels, 3, 50.0)) / 2e-4
    close(grad["w2"], expected, rtol=2e-3, atol=1e-4)


def test_vrex_population_variance_weight_switch_and_last_domain_nll():
    params, (images, labels) = make_params(), make_batch(3, 4)
    hp = {"vrex_lambda": 20.0, "vrex_penalty_anneal_iters": 4}
    losses = np_domain_losses(np_forward(np_params(params), images)[1], labels, 3)
    variance = np.var(losses)  # ddof 0
    for step, weight in ((3, 1.0), (4, 20.0)):
        loss, aux = run("vrex", params, images, labels, 3, hp=hp, step=step)
        close(loss, losses.mean() + weight * variance, rtol=1e-4)
    close(aux.metrics["penalty"], variance, rtol=1e-4, atol=1e-7)
    close(aux.metrics["nll"], losses[-1])
    close(aux.domain_losses, losses)


# ----------------------------------------------------------------------------
# GroupDRO (DomainBed's ``GroupDRO``).


def test_groupdro_q_over_three_steps_and_second_evaluation():
    params, m, b, eta = make_params(), 3, 4, 0.3
    p = np_params(params)
    state, q = objectives.init_state("groupdro", m), np.ones(m)
    for step in range(3):
        images, labels = make_batch(m, b, seed=step)
        loss, aux = run("groupdro", params, images, labels, m, hp={"groupdro_eta": eta},
                        state=state, step=step)
        features, logits = np_forward(p, images)
        losses = np_domain_losses(logits, labels, m)
        q = q * np.exp(eta * losses)
        q = q / q.sum()
        close(aux.state["q"], q)
        close(loss, np.sum(q * losses))
        state = aux.state
    # A second evaluation of the last step's loss: q as given, not advanced again.
    fn = lambda prm: run("groupdro", prm, images, labels, m, hp={"groupdro_eta": eta},  # noqa
                         state=state, advance=False)
    (again, aux), grad = jax.value_and_grad(fn, has_aux=True)(params)
    close(aux.state["q"], q)
    close(again, np.sum(q * losses))
    # q is a constant: d L / d w2 = sum_m q_m features_m^T (softmax - onehot) / b.
    dlogits = np_softmax(logits)
    dlogits[np.arange(m * b), labels] -= 1
    dlogits *= np.repeat(q, b)[:, None] / b
    close(grad["w2"], features.T @ dlogits, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------
# Mixup (DomainBed's ``Mixup``).


def test_mixup_draws_pair_each_domain_once_each_way():
    keys = jax.random.split(jax.random.PRNGKey(0), 50)
    firsts, seconds, lams = jax.jit(jax.vmap(lambda k: objectives.mixup_draws(k, 4, 0.2)))(keys)
    for first, second in zip(np.asarray(firsts), np.asarray(seconds)):
        assert sorted(first) == [0, 1, 2, 3]
        np.testing.assert_array_equal(second, np.roll(first, -1))
    lams = np.asarray(lams).ravel()
    assert lams.min() >= 0 and lams.max() <= 1 and abs(lams.mean() - 0.5) < 0.1
    # Beta(0.2, 0.2) puts most of its mass near 0 and 1.
    assert np.mean((lams < 0.1) | (lams > 0.9)) > 0.4


def test_mixup_loss_with_the_drawn_pairs():
    params, m, b = make_params(), 3, 4
    images, labels = make_batch(m, b)
    key = jax.random.PRNGKey(11)
    loss, aux = run("mixup", params, images, labels, m, hp={"mixup_alpha": 0.5}, key=key)
    first, second, lam = (np.asarray(v) for v in objectives.mixup_draws(key, m, 0.5))
    p, x, y = np_params(params), images.reshape(m, b, -1), labels.reshape(m, b)
    terms = []
    for i, j, weight in zip(first, second, lam.astype(np.float64)):
        mixed = weight * x[i].astype(np.float64) + (1 - weight) * x[j]
        logits = mixed @ p["w1"] @ p["w2"]
        terms.append(weight * np_cross_entropy(logits, y[i]).mean()
                     + (1 - weight) * np_cross_entropy(logits, y[j]).mean())
    close(aux.domain_losses, terms, rtol=1e-5)
    close(loss, np.mean(terms))


# ----------------------------------------------------------------------------
# CutMix (the SAGM repository's ``CutMix``).


def np_cutmix_box(lam, u, v, height, width):
    side = np.sqrt(1 - lam)
    half_a, half_b = int(height * side) // 2, int(width * side) // 2
    box = (np.clip(u - half_a, 0, height), np.clip(u + half_a, 0, height),
           np.clip(v - half_b, 0, width), np.clip(v + half_b, 0, width))
    return box, 1 - (box[1] - box[0]) * (box[3] - box[2]) / (height * width)


@pytest.mark.parametrize("lam,u,v", [
    (0.5, 3, 2),  # interior: int(6 * 0.707) = 4 -> rows 1:5; int(5 * 0.707) = 3 -> cols 1:3
    (0.2, 0, 4),  # clipped at the top and the right border
    (0.0, 5, 0),  # the widest box, clipped on two sides
    (1.0, 2, 2),  # no box: lam_box = 1
])
def test_cutmix_box(lam, u, v):
    box, lam_box = objectives.cutmix_box(jnp.float32(lam), jnp.int32(u), jnp.int32(v),
                                         HEIGHT, WIDTH)
    expected_box, expected_lam = np_cutmix_box(lam, u, v, HEIGHT, WIDTH)
    np.testing.assert_array_equal(box, expected_box)
    close(lam_box, expected_lam)


@functools.lru_cache
def _batched_cutmix_draws(beta):
    """``cutmix_draws`` on 12 rows over a batch of keys, ``prob`` traced: one compile."""
    return jax.jit(jax.vmap(
        lambda k, prob: objectives.cutmix_draws(k, 12, HEIGHT, WIDTH, beta, prob),
        in_axes=(0, None)))


def many_cutmix_draws(count, beta=1.0, prob=1.0):
    """``cutmix_draws`` for ``count`` keys, as a list of (key, draws)."""
    keys = jax.random.split(jax.random.PRNGKey(0), count)
    batched = jax.tree.map(np.asarray, _batched_cutmix_draws(beta)(keys, jnp.float32(prob)))
    return [(keys[i], jax.tree.map(lambda v: v[i], batched)) for i in range(count)]


def test_cutmix_draws_coin_permutation_and_box_area():
    assert 0.35 < np.mean([d.apply for _, d in many_cutmix_draws(300, prob=0.5)]) < 0.65
    assert not any(d.apply for _, d in many_cutmix_draws(300, prob=0.0))
    assert not any(d.apply for _, d in many_cutmix_draws(20, beta=0.0))
    for _, d in many_cutmix_draws(300):
        assert d.apply
        assert sorted(d.perm) == list(range(12))
        a1, a2, b1, b2 = d.box
        assert 0 <= a1 <= a2 <= HEIGHT and 0 <= b1 <= b2 <= WIDTH
        close(d.lam_box, 1 - (a2 - a1) * (b2 - b1) / (HEIGHT * WIDTH))


def np_cutmix_loss(p, images, labels, draws, m):
    a1, a2, b1, b2 = np.asarray(draws.box)
    perm, x = np.asarray(draws.perm), np.asarray(images, np.float64).copy()
    if bool(draws.apply):
        x[:, a1:a2, b1:b2, :] = np.asarray(images, np.float64)[perm][:, a1:a2, b1:b2, :]
        own = 1 - (a2 - a1) * (b2 - b1) / (HEIGHT * WIDTH)
    else:
        own, perm = 1.0, np.arange(len(labels))
    logits = np_forward(p, x)[1]
    rows = (own * np_cross_entropy(logits, labels)
            + (1 - own) * np_cross_entropy(logits, labels[perm]))
    return rows.mean(), rows.reshape(m, -1).mean(1)


def _find_key(predicate, prob):
    for key, draws in many_cutmix_draws(300, prob=prob):
        if predicate(draws):
            return key, draws
    raise AssertionError("no such draw in 300 keys")


def _touches_border(d):
    a1, a2, b1, b2 = np.asarray(d.box)
    area = (a2 - a1) * (b2 - b1)
    return bool(d.apply) and 0 < area < HEIGHT * WIDTH and (a1 == 0 or a2 == HEIGHT)


def _interior(d):
    a1, a2, b1, b2 = np.asarray(d.box)
    return bool(d.apply) and 0 < a1 < a2 < HEIGHT and 0 < b1 < b2 < WIDTH


@pytest.mark.parametrize("predicate,prob", [
    (_interior, 1.0), (_touches_border, 1.0), (lambda d: not bool(d.apply), 0.5),
])
def test_cutmix_loss_with_the_drawn_box(predicate, prob):
    params, m, b = make_params(), 3, 4
    images, labels = make_batch(m, b)
    key, draws = _find_key(predicate, prob)  # draws for m * b = 12 rows
    hp = {"cutmix_beta": 1.0, "cutmix_prob": prob}
    loss, aux = run("cutmix", params, images, labels, m, hp=hp, key=key)
    expected, domains = np_cutmix_loss(np_params(params), images, labels, draws, m)
    close(loss, expected)
    close(aux.domain_losses, domains)


# ----------------------------------------------------------------------------
# The global batch: 1 device and 8 devices agree.


@pytest.mark.parametrize("objective", NETWORK_ALONE)
def test_one_and_eight_devices_agree(objective):
    m, b = 3, 8  # 24 rows: domain boundaries fall inside devices' shards
    params, (images, labels) = make_params(), make_batch(m, b)
    hp = {"irm_penalty_anneal_iters": 2, "vrex_penalty_anneal_iters": 2, "mmd_gamma": 0.5}

    def loss(prm, x, y, state, key):
        return objectives.objective_loss(
            objective, hp, make_forward(prm), x, y, num_domains=m, state=state,
            step=jnp.int32(3), key=key, advance=True,
        )[0]

    results = []
    for devices in (jax.devices()[:1], jax.devices()[:8]):
        mesh = Mesh(np.array(devices), ("batch",))
        rows, same = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
        args = (jax.device_put(params, same), jax.device_put(images, rows),
                jax.device_put(labels, rows),
                jax.device_put(objectives.init_state(objective, m), same),
                jax.device_put(jax.random.PRNGKey(5), same))
        results.append(jax.jit(jax.value_and_grad(loss))(*args))
    assert len(jax.devices()) == 8
    (loss_one, grad_one), (loss_eight, grad_eight) = results
    close(loss_eight, np.asarray(loss_one), rtol=1e-5)
    for key in ("w1", "w2"):
        # Summation order differs with sharding: entries far below the gradient's scale
        # are compared at 1e-5 of that scale. MMD's gradient sums seven exponential
        # kernels over every pair of rows in float32; jax 0.10's sharded reductions put it
        # 3e-5 of the scale apart (measured; CausIRL_MMD's, over the pooled rows, 4e-5),
        # so it is compared at 1e-4.
        scale = float(np.abs(grad_one[key]).max())
        tolerance = 1e-4 if objective in ("mmd", "causirl_mmd") else 1e-5
        close(grad_eight[key], np.asarray(grad_one[key]), rtol=1e-5, atol=tolerance * scale)


# ----------------------------------------------------------------------------
# OrgMixup (the SAGM repository's ``OrgMixup``): one weight, a permutation of all rows.


def test_org_mixup_draws_permute_every_row_with_one_weight():
    keys = jax.random.split(jax.random.PRNGKey(0), 200)
    perms, lams = jax.jit(jax.vmap(lambda k: objectives.org_mixup_draws(k, 12, 0.2)))(keys)
    perms, lams = np.asarray(perms), np.asarray(lams)
    assert perms.shape == (200, 12) and lams.shape == (200,)
    for perm in perms:
        assert sorted(perm) == list(range(12))
    # Across domains (rows 0..3 of domain 0 reach the other domains' rows), i may map to i.
    assert (perms[:, :4] >= 4).any() and (perms == np.arange(12)).any()
    assert lams.min() >= 0 and lams.max() <= 1 and abs(lams.mean() - 0.5) < 0.1
    assert np.mean((lams < 0.1) | (lams > 0.9)) > 0.4  # Beta(0.2, 0.2)


def np_org_mixup(p, images, labels, perm, lam, m):
    """The reference's update in float64: x~ = lam x + (1 - lam) x[perm]; L = lam CE(y) +
    (1 - lam) CE(y[perm]); its gradient by hand for the linear network
    (dL/dlogits = (softmax - lam onehot(y) - (1 - lam) onehot(y[perm])) / N)."""
    x = np.asarray(images, np.float64).reshape(len(images), -1)
    mixed = lam * x + (1 - lam) * x[perm]
    features = mixed @ p["w1"]
    logits = features @ p["w2"]
    per_row = (lam * np_cross_entropy(logits, labels)
               + (1 - lam) * np_cross_entropy(logits, labels[perm]))
    onehot = np.eye(CLASSES)
    target = lam * onehot[labels] + (1 - lam) * onehot[labels[perm]]
    dlogits = (np_softmax(logits) - target) / len(x)
    grads = {"w2": features.T @ dlogits, "w1": mixed.T @ (dlogits @ p["w2"].T)}
    return per_row.mean(), per_row.reshape(m, -1).mean(axis=1), grads


def test_org_mixup_loss_and_gradient_with_the_drawn_permutation():
    params, m, b = make_params(), 3, 4
    images, labels = make_batch(m, b)
    key, hp = jax.random.PRNGKey(12), {"mixup_alpha": 0.5}
    (loss, aux), grads = jax.value_and_grad(
        lambda q: run("org_mixup", q, images, labels, m, hp=hp, key=key), has_aux=True
    )(params)
    perm, lam = (np.asarray(v) for v in objectives.org_mixup_draws(key, m * b, 0.5))
    assert 0.05 < lam < 0.95 and sorted(perm) == list(range(m * b))
    expected, domains, expected_grads = np_org_mixup(
        np_params(params), images, labels, perm, np.float64(lam), m
    )
    close(loss, expected)
    close(aux.domain_losses, domains)
    close(aux.metrics["loss"], expected)
    for name in ("w1", "w2"):
        close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6)
    # The default weight is Mixup's (the registry shares the key).
    assert methods.OBJECTIVES["org_mixup"].method.hyperparameters[0].default == 0.2
