"""IB_ERM and IB_IRM (sagm_jax.methods.bottleneck) against a float64 re-statement of
DomainBed's ``domainbed/algorithms.py`` (``IB_ERM``, ``IB_IRM``) written here in JAX x64:
the feature variance as torch's ``var(dim=0)`` (divisor b - 1), IRM's penalty through the
derivative of the cross-entropy in a scale (``autograd.grad`` there, ``jax.grad`` of the
scale here), the anneals, the reported values (``nll`` is the loss: the reference's
in-place ``loss += ...`` on the ``nll`` tensor) and the fresh Adam the reference builds
at each anneal's end; the package's code is never the reference. Whole train steps of a
tiny dense network run through ``make_train_step``; one short RotatedDigits run trains
IB_IRM under SAGM; the sweep's draws are DomainBed's ``hparams_registry``'s."""

import hashlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, tanh_net, torch_adam
from run_fixtures import digits_config, train_steps

from sagm_jax import methods
from sagm_jax.methods import objectives
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 3, 4, 2, 5, 3
M, B = 2, 5  # domains, rows per domain (odd: IRM's halves of 3 and 2)
LR, WD = 0.01, 0.1
TOL = dict(rtol=2e-4, atol=2e-6)


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, M * B).astype(np.int32)}


def run_steps(objective, hp, steps):
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)),
                         train=False)
    states, metrics = train_steps(net, variables, objective, hp, steps, batch,
                                  num_domains=M, lr=LR, wd=WD, key=3)
    return variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement


ref_forward = tanh_net


def ref_irm_penalty(logits, y):
    """``IRM._irm_penalty``: grad_1 * grad_2, each the derivative in a scale s (at 1) of
    the mean cross-entropy of the rows [::2] and [1::2] of s * logits."""
    def grad_at_one(z, labels):
        return jax.grad(lambda s: ref_ce(z * s, labels).mean())(jnp.float64(1.0))

    return grad_at_one(logits[::2], y[::2]) * grad_at_one(logits[1::2], y[1::2])


def ref_update_loss(p, x, y, step, hp, irm):
    """One ``update``'s loss and reported values, domain by domain as the reference."""
    features, logits = ref_forward(p, x)
    nll = irm_pen = ib_pen = 0.0
    for d in range(M):
        rows = slice(d * B, (d + 1) * B)
        nll = nll + ref_ce(logits[rows], y[rows]).mean()
        if irm:
            irm_pen = irm_pen + ref_irm_penalty(logits[rows], y[rows])
        ib_pen = ib_pen + jnp.var(features[rows], axis=0, ddof=1).mean()
    nll, irm_pen, ib_pen = nll / M, irm_pen / M, ib_pen / M
    ib_w = hp["ib_lambda"] if step >= hp["ib_penalty_anneal_iters"] else 0.0
    loss = nll + ib_w * ib_pen
    reported = {"IB_penalty": ib_pen}
    if irm:
        irm_w = hp["irm_lambda"] if step >= hp["irm_penalty_anneal_iters"] else 1.0
        loss = loss + irm_w * irm_pen
        reported["IRM_penalty"] = irm_pen
    return loss, {"loss": loss, "nll": loss, **reported}  # nll: the in-place add


def reference_run(variables, objective, hp, steps):
    irm = objective == "ib_irm"
    resets = {hp["ib_penalty_anneal_iters"]}
    if irm:
        resets.add(hp["irm_penalty_anneal_iters"])
    p = f64(variables["params"])
    adam = adam_init(p)
    params, reported = [], []
    for t in range(steps):
        data = batch(t)
        x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
        if t in resets:  # a fresh Adam, before this step's update
            adam = adam_init(p)
        (_, values), g = jax.value_and_grad(
            lambda q: ref_update_loss(q, x, y, t, hp, irm), has_aux=True)(p)
        p, adam = torch_adam(p, g, adam, LR, WD)
        params.append(p)
        reported.append(values)
    return params, reported


CASES = {
    # IB's weight 0 at step 0, Adam fresh and weight ib_lambda from step 1.
    "ib_erm": ({"ib_lambda": 3.0, "ib_penalty_anneal_iters": 1}, 3),
    # IRM's weight 1 then 5 from step 2, IB's 0 then 3 from step 1: two fresh Adams.
    "ib_irm": ({"irm_lambda": 5.0, "irm_penalty_anneal_iters": 2, "ib_lambda": 3.0,
                "ib_penalty_anneal_iters": 1}, 4),
}


@pytest.mark.parametrize("objective", sorted(CASES))
def test_steps_match_domainbeds_update(objective):
    """Every parameter and every reported value after each of 3 (IB_ERM) or 4 (IB_IRM)
    steps, across the anneals' switches and the fresh Adams of the reference."""
    hp, steps = CASES[objective]
    variables, states, metrics = run_steps(objective, hp, steps)
    with jax.enable_x64(True):
        params, reported = reference_run(variables, objective, hp, steps)
    for t in range(steps):
        assert set(metrics[t]) == set(reported[t])
        for key, want in reported[t].items():
            np.testing.assert_allclose(float(metrics[t][key]), float(want), **TOL,
                                       err_msg=f"step {t}: {key}")
        for got, want in zip(jax.tree.leaves(states[t + 1].params), jax.tree.leaves(params[t]),
                             strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL,
                                       err_msg=f"step {t}")


def test_restart_steps_and_batch_minimum():
    assert objectives.reset_optimizer_step("ib_erm", {"ib_penalty_anneal_iters": 7}) == 7
    assert objectives.reset_optimizer_step(
        "ib_irm", {"irm_penalty_anneal_iters": 3, "ib_penalty_anneal_iters": 9}) == (3, 9)
    assert objectives.reset_optimizer_step("ib_irm", {}) == (500, 500)  # the defaults
    for name in ("ib_erm", "ib_irm"):
        entry = methods.objective(name)
        assert entry.min_batch_per_env == 2 and entry.label_alone
        assert methods.method_label(name, "erm") == entry.method.label == name.upper()


@pytest.mark.slow
def test_ib_irm_trains_under_sagm_on_rotated_digits(tmp_path):
    """IB_IRM + SAGM end to end: both anneals switch and Adam restarts inside the run."""
    config = digits_config(objective="ib_irm", algorithm="sagm", steps=3, eval_every=2,
                           irm_penalty_anneal_iters=1, ib_penalty_anneal_iters=2)
    records = train.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in records] == [0, 2]
    for key in ("loss", "nll", "IRM_penalty", "IB_penalty"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert records[-1]["nll"] == records[-1]["loss"]  # DomainBed's reported nll


# ---------------------------------------------------------------- the sweep's draws


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def db_draws(algorithm, dataset, hparams_seed, trial_seed):
    """DomainBed's ``hparams_registry`` for IB_ERM / IB_IRM: defaults at hparams_seed 0,
    else each name's own ``RandomState(seed_hash(seed_hash(h, t), name))`` draw."""
    small = dataset == "RotatedMNIST"
    table = {"resnet_dropout": (0.0, lambda r: r.choice([0.0, 0.1, 0.5]))}
    if algorithm == "IB_IRM":
        table["irm_lambda"] = (1e2, lambda r: 10 ** r.uniform(-1, 5))
        table["irm_penalty_anneal_iters"] = (500, lambda r: int(10 ** r.uniform(0, 4)))
    table["ib_lambda"] = (1e2, lambda r: 10 ** r.uniform(-1, 5))
    table["ib_penalty_anneal_iters"] = (500, lambda r: int(10 ** r.uniform(0, 4)))
    if small:
        table["lr"] = (1e-3, lambda r: 10 ** r.uniform(-4.5, -2.5))
        table["weight_decay"] = (0.0, lambda r: 0.0)
        table["batch_size"] = (64, lambda r: int(2 ** r.uniform(3, 9)))
        del table["resnet_dropout"]  # the MNIST CNN has no dropout here
    else:
        table["lr"] = (5e-5, lambda r: 10 ** r.uniform(-5, -3.5))
        table["weight_decay"] = (0.0, lambda r: 10 ** r.uniform(-6, -2))
        table["batch_size"] = (32, lambda r: int(2 ** r.uniform(3, 5.5)))
    setting = db_seed_hash(hparams_seed, trial_seed)
    ours = {"resnet_dropout": "dropout", "batch_size": "batch_per_env"}
    return {ours.get(name, name): default if hparams_seed == 0
            else draw(np.random.RandomState(db_seed_hash(setting, name)))
            for name, (default, draw) in table.items()}


@pytest.mark.parametrize("db_algorithm", ["IB_ERM", "IB_IRM"])
def test_sweep_draws_are_domainbeds(db_algorithm):
    for dataset, h, t in itertools.product(("PACS", "RotatedMNIST"), (0, 1, 5, 17), (0, 2)):
        got = random_hparams("erm", dataset, h, t, objective=db_algorithm.lower())
        assert got == db_draws(db_algorithm, dataset, h, t), (dataset, h, t)
