"""CausIRL_CORAL and CausIRL_MMD (sagm_jax.methods.causal) against a float64
re-statement of DomainBed's ``domainbed/algorithms.py`` class ``AbstractCausIRL`` (its
``update``, ``mmd``, ``gaussian_kernel``, ``my_cdist``), written here in JAX x64: the
split point of each domain is re-applied by slicing and concatenating the features as
the reference does, the CORAL distance with its mean and unbiased covariances, the MMD
with distances as plain squared differences; the package's code is never the reference.
The split points are the package's draw (the objective key of each step, as the train
step derives it), re-applied here; their distribution is checked against the
reference's ``np.random.randint(0, b)``. Whole train steps run through
``make_train_step`` on a tiny dense network; one short run trains CausIRL_MMD under SAGM
on RotatedDigits."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, torch_adam
from run_fixtures import digits_config, train_steps

from sagm_jax import methods
from sagm_jax.config import config_problems
from sagm_jax.methods import causal
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train
from sagm_jax.training.train_step import (
    step_keys,
)

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 3, 4, 2, 5, 4
M, B = 3, 4  # domains, rows per domain
LR, WD, GAMMA = 0.05, 0.01, 0.7
TOL = dict(rtol=2e-4, atol=2e-6)
RUN_KEY = 7


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, M * B).astype(np.int32)}


def run_steps(objective, steps):
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)),
                         train=False)
    states, metrics = train_steps(net, variables, objective, {"mmd_gamma": GAMMA}, steps,
                                  batch, num_domains=M, lr=LR, wd=WD, key=RUN_KEY)
    return variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement


def ref_coral(x, y):
    """``mmd`` with kernel_type "mean_cov": (mean_x - mean_y)^2 averaged over d, plus the
    gap of the covariances cent^T cent / (len - 1) averaged over d^2."""
    cent_x, cent_y = x - x.mean(0), y - y.mean(0)
    cova_x = cent_x.T @ cent_x / (len(x) - 1)
    cova_y = cent_y.T @ cent_y / (len(y) - 1)
    return ((x.mean(0) - y.mean(0)) ** 2).mean() + ((cova_x - cova_y) ** 2).mean()


def ref_kernel(x, y):
    """sum over gamma in {1e-3, ..., 1e3} of exp(-gamma max(||x_i - y_j||^2, 1e-30))."""
    distance = jnp.maximum(((x[:, None, :] - y[None, :, :]) ** 2).sum(-1), 1e-30)
    return sum(jnp.exp(-g * distance) for g in (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0))


def ref_mmd(x, y):
    return ref_kernel(x, x).mean() + ref_kernel(y, y).mean() - 2 * ref_kernel(x, y).mean()


REF_DISTANCES = {"causirl_coral": ref_coral, "causirl_mmd": ref_mmd}


def ref_penalty(features, points, distance):
    """The loop of ``AbstractCausIRL.update``: first = concat features[i][:slice_i],
    second = concat features[i][slice_i:]; nan_to_num(mmd(first, second)) when both
    have more than one row, else 0."""
    first = jnp.concatenate([f[:s] for f, s in zip(features, points)])
    second = jnp.concatenate([f[s:] for f, s in zip(features, points)])
    if len(first) > 1 and len(second) > 1:
        return jnp.nan_to_num(distance(first, second))
    return jnp.float64(0.0)


def ref_update_loss(p, x, y, points, distance):
    """One forward per domain, objective = mean_i CE(classifs_i + 1e-16, y_i), the
    penalty of the split; returns objective + gamma penalty and the reported values."""
    features, objective = [], 0.0
    for i in range(M):
        h = jnp.tanh(x[i].reshape(B, -1) @ p["body"]["kernel"] + p["body"]["bias"])
        logits = h @ p["classifier"]["kernel"] + p["classifier"]["bias"]
        objective += ref_ce(logits + 1e-16, y[i]).mean()
        features.append(h)
    objective /= M
    penalty = ref_penalty(features, points, distance)
    return objective + GAMMA * penalty, (objective, penalty)


def objective_points(t):
    """Step t's split points: the package's draw from the objective key of that step."""
    key = step_keys(jax.random.key(RUN_KEY), t)[2]
    return [int(s) for s in causal.split_points(key, M, B)]


@pytest.mark.parametrize("objective", ["causirl_coral", "causirl_mmd"])
def test_three_adam_steps_match_domainbeds_update(objective):
    """Every parameter and both reported values (the mean CE, the penalty) over 3 steps
    of torch's Adam, each step with its own drawn split."""
    variables, states, metrics = run_steps(objective, steps=3)
    # The package's MMD takes ||u||^2 + ||v||^2 - 2 u.v in float32, whose rounding
    # (~1e-7 of ||u||^2) the widest kernel exp(-1000 d) amplifies a thousandfold; the
    # re-statement squares differences in float64. After 3 Adam steps of 0.05 a weight
    # is 7e-6 apart (measured), so the weights are compared at 2e-5, 4e-4 of a step.
    tolerance = dict(rtol=2e-4, atol=2e-5 if objective == "causirl_mmd" else 2e-6)
    with jax.enable_x64(True):
        params = f64(variables["params"])
        adam = adam_init(params)
        for t in range(3):
            data, points = batch(t), objective_points(t)
            x = jnp.asarray(data["image"], jnp.float64).reshape(M, B, HEIGHT, WIDTH, CHANNELS)
            y = jnp.asarray(data["label"]).reshape(M, B)
            (_, (loss, penalty)), grads = jax.value_and_grad(ref_update_loss, has_aux=True)(
                params, x, y, points, REF_DISTANCES[objective])
            params, adam = torch_adam(params, grads, adam, LR, WD)
            assert set(metrics[t]) == {"loss", "penalty"}
            np.testing.assert_allclose(float(metrics[t]["loss"]), float(loss), **TOL)
            np.testing.assert_allclose(float(metrics[t]["penalty"]), float(penalty),
                                       rtol=1e-3, atol=1e-6)
            # Steps 0 and 2 split into parts of 5 rows or more; step 1's first part holds
            # one row, so its penalty is 0 (the reference's ``torch.tensor(0)``).
            assert (float(penalty) > 0) == (sum(points) > 1) == (t != 1), points
            for got, want in zip(jax.tree.leaves(states[t + 1].params),
                                 jax.tree.leaves(params), strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tolerance)


@pytest.mark.parametrize("kind,objective", [("coral", "causirl_coral"), ("mmd", "causirl_mmd")])
def test_penalty_of_a_given_split_is_the_references(kind, objective):
    """Splits of every size: A of 3, 9, 2 rows; A of one row and A empty (penalty 0 and
    no gradient, the reference's ``torch.tensor(0)``)."""
    penalty = jax.jit(jax.value_and_grad(
        lambda f, mask: causal.split_penalty(f.reshape(M * B, DIM), mask, kind)))
    for points in ((1, 2, 0), (3, 3, 3), (0, 0, 2), (0, 1, 0), (0, 0, 0)):
        features = np.random.default_rng(sum(points)).normal(0, 0.6, (M, B, DIM))
        features = features.astype(np.float32)
        in_first = causal.first_part_mask(jnp.asarray(points, jnp.int32), B)
        value, grad = penalty(jnp.asarray(features), in_first)
        with jax.enable_x64(True):
            expected = ref_penalty(list(jnp.asarray(features, jnp.float64)), points,
                                   REF_DISTANCES[objective])
        np.testing.assert_allclose(float(value), float(expected), rtol=1e-4, atol=1e-6)
        assert np.all(np.isfinite(grad))
        if sum(points) <= 1:
            assert float(value) == 0.0 and not np.any(grad)


def test_split_points_are_uniform_below_b_and_independent():
    """The reference's ``np.random.randint(0, b)`` per domain: uniform on {0..b-1} (never
    b, so the second part always holds a row of every domain), independent of the
    other domains' and of the other steps' draws."""
    keys = jax.random.split(jax.random.key(3), 4000)
    points = np.asarray(jax.vmap(lambda k: causal.split_points(k, M, B))(keys))
    assert points.shape == (4000, M) and points.min() == 0 and points.max() == B - 1
    frequencies = np.stack([np.bincount(points[:, m], minlength=B) / 4000 for m in range(M)])
    np.testing.assert_allclose(frequencies, 1 / B, atol=0.03)
    joint = np.mean((points[:, 0] == 0) & (points[:, 1] == 0))
    assert abs(joint - 1 / B**2) < 0.015
    assert objective_points(0) != objective_points(1) or objective_points(1) != objective_points(2)
    mask = np.asarray(causal.first_part_mask(jnp.asarray([2, 0, 3]), B)).reshape(M, B)
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])


def test_registry_draws_and_the_batch_that_would_train_erm():
    """DomainBed's ``_hparam('mmd_gamma', 1., lambda r: 10**r.uniform(-1, 1))`` for both
    (``RandomState(seed_hash(seed_hash(hparams_seed, trial_seed), 'mmd_gamma'))``),
    DomainBed's names as rows, and one example per domain refused before the run."""
    def seed_hash(*args):
        return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)

    for objective, label in (("causirl_coral", "CausIRL_CORAL"), ("causirl_mmd", "CausIRL_MMD")):
        for hparams_seed, trial_seed in ((1, 0), (4, 2), (11, 1)):
            rng = np.random.RandomState(seed_hash(seed_hash(hparams_seed, trial_seed),
                                                  "mmd_gamma"))
            drawn = random_hparams("erm", "VLCS", hparams_seed, trial_seed, objective)
            assert drawn["mmd_gamma"] == 10 ** rng.uniform(-1, 1)
        assert random_hparams("erm", "VLCS", 0, 0, objective)["mmd_gamma"] == 1.0
        assert methods.method_label(objective, "erm") == label
        (problem,) = config_problems(digits_config(objective=objective, batch_per_env=1))
        assert problem.startswith(f"config.batch_per_env=1 with config.objective={objective}")
        assert "the penalty always 0" in problem


def test_causirl_mmd_trains_under_sagm_on_rotated_digits(tmp_path):
    records = train.train_and_evaluate(
        digits_config(objective="causirl_mmd", algorithm="sagm", steps=2, eval_every=1),
        str(tmp_path),
    )
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["penalty"]) for r in records)
    assert records[-1]["penalty"] > 0
