"""RDM (sagm_jax.methods.risk_distribution) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` (``RDM.update`` with its ``my_cdist``, ``gaussian_kernel``
and ``mmd``) written here in JAX x64: per-domain cross-entropies of one forward, the
worst domain by its mean loss (the choice carries no gradient), the eight-bandwidth
Gaussian MMD of the worst domain's losses against all losses, the unbiased variances,
the weights 0 before the anneal's end, the fresh Adam at ``rdm_lr`` there, and the
reported values. Whole train steps run through ``make_train_step`` under Adam and SAM;
one short RotatedDigits run crosses the anneal; the per-dataset defaults and draws are
DomainBed's ``hparams_registry`` rule for RDM, written out here."""

import hashlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, tanh_net, torch_adam
from run_fixtures import digits_config

from sagm_jax import cli
from sagm_jax.config import config_problems, resnet50_config
from sagm_jax.methods.update_rules import rule_optimizer
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 3, 2, 4, 3
M, B = 3, 4
LR, WD, RHO = 0.01, 0.05, 0.05
TOL = {"rtol": 2e-4, "atol": 2e-6}
# The parameters: float32 distances s^2 + t^2 - 2 s t (the reference's ``my_cdist``, in
# float32 there too) lose ~1e-7 s^2 to cancellation, times gamma up to 1000 in the kernel;
# 1e-5 is 0.3% of one step of Adam here.
PARAM_TOL = {"rtol": 2e-4, "atol": 1e-5}
GAMMAS = [0.0001, 0.001, 0.01, 0.1, 1, 10, 100, 1000]


def batch(seed):
    rng = np.random.default_rng(seed)
    scale = np.repeat(1.0 + np.arange(M), B)[:, None, None, None]  # the domains differ
    return {"image": (rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)) * scale
                      ).astype(np.float32),
            "label": rng.integers(0, CLASSES, M * B).astype(np.int32)}


# ---------------------------------------------------------------- float64 re-statement


def ref_kernel(u, v):
    d = jnp.maximum((u[:, None] - v[None, :]) ** 2, 1e-30)
    return sum(jnp.exp(-g * d) for g in GAMMAS)


def ref_mmd(u, v):
    return ref_kernel(u, u).mean() + ref_kernel(v, v).mean() - 2 * ref_kernel(u, v).mean()


def ref_confs(p, x, y):
    logits = tanh_net(p, x)[1]
    return jnp.stack([ref_ce(logits[d * B:(d + 1) * B], y[d * B:(d + 1) * B]) for d in range(M)])


def ref_update(p, x, y, worst, t, hp):
    """``RDM.update``'s total loss and reported values, the worst domain given."""
    confs = ref_confs(p, x, y)  # [M, b]
    erm = confs.mean(axis=1).mean()
    matching = ref_mmd(confs[worst], confs.reshape(-1))
    variance = jnp.var(confs.reshape(-1), ddof=1) + jnp.var(confs[worst], ddof=1)
    on = t >= hp["rdm_penalty_anneal_iters"]
    total = (erm + (hp["rdm_lambda"] if on else 0.0) * matching
             + (hp["rdm_variance_weight"] if on else 0.0) * variance)
    return total, {"loss": total, "erm_loss": erm, "matching_penalty": matching,
                   "variance_penalty": variance}


def ref_value_and_grad(p, x, y, t, hp):
    worst = int(np.argmax(np.asarray(ref_confs(p, x, y).mean(axis=1))))
    return jax.value_and_grad(lambda q: ref_update(q, x, y, worst, t, hp), has_aux=True)(p)


@pytest.mark.parametrize("anneal,algorithm", [(1, "erm"), (0, "sam")])
def test_three_steps_match_domainbeds_update(anneal, algorithm):
    """Every reported value and parameter after each of 3 steps, weight decay on. Anneal 1:
    ERM at step 0, the fresh Adam at rdm_lr and both penalties from step 1; anneal 0 under
    SAM: the fresh Adam at step 0 and the penalised gradient at the perturbed point."""
    hp = {"rdm_lambda": 2.0, "rdm_penalty_anneal_iters": anneal, "rdm_variance_weight": 0.5,
          "rdm_lr": 0.003}
    net = TanhNet(DIM, CLASSES)
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), False)
    opt = rule_optimizer(algorithm, {"rho": RHO}, learning_rate=LR, weight_decay=WD)
    step = jax.jit(make_train_step(net, opt, algorithm=algorithm,
                                   method=StepMethod("rdm", hp, M, learning_rate=LR)))
    state = create_train_state(variables, opt, {})
    worst_seen = set()
    with jax.enable_x64(True):
        p, adam, lr = f64(variables["params"]), adam_init(f64(variables["params"])), LR
        for t in range(3):
            data = batch(t)
            state, metrics = step(state, data, jax.random.key(3))
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            if t == anneal:  # ``if self.update_count == rdm_penalty_anneal_iters``
                adam, lr = adam_init(p), hp["rdm_lr"]
            worst_seen.add(int(np.argmax(np.asarray(ref_confs(p, x, y).mean(axis=1)))))
            (_, reported), g = ref_value_and_grad(p, x, y, t, hp)
            if algorithm == "sam":
                norm = jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree.leaves(g)))
                g = ref_value_and_grad(
                    jax.tree.map(lambda w, d, n=norm: w + RHO * d / n, p, g), x, y, t, hp)[1]
            p, adam = torch_adam(p, g, adam, lr, WD)
            assert set(metrics) == set(reported)
            for key, want in reported.items():
                np.testing.assert_allclose(float(metrics[key]), float(want), **TOL,
                                           err_msg=f"step {t}: {key}")
            for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(p), strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), **PARAM_TOL,
                                           err_msg=f"step {t}")
    assert worst_seen != {0}  # the worst domain is not merely the first


def test_rdm_refuses_one_training_domain_and_one_row_per_domain():
    one = config_problems(digits_config(objective="rdm", test_envs=(0, 1, 2, 3, 4)))
    assert len(one) == 1 and "config.objective=rdm" in one[0] and "NaN" in one[0], one
    rows = config_problems(digits_config(objective="rdm", batch_per_env=1))
    assert len(rows) == 1 and "b - 1" in rows[0], rows
    assert config_problems(digits_config(objective="rdm", test_envs=(0, 1, 2, 3))) == []


@pytest.mark.slow
def test_rdm_trains_on_rotated_digits(tmp_path):
    """3 steps: ERM at step 0, the fresh Adam at rdm_lr and the penalties from step 1."""
    config = digits_config(objective="rdm", algorithm="erm", steps=3, eval_every=2,
                           rdm_penalty_anneal_iters=1, rdm_lr=1e-4)
    records = train.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in records] == [0, 2]
    assert records[0]["loss"] == records[0]["erm_loss"]  # weights 0 during the anneal
    assert records[-1]["loss"] > records[-1]["erm_loss"]
    assert all(np.isfinite(r["matching_penalty"]) for r in records)


# ---------------------------------------------------------------- DomainBed's draws


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def db_rdm_hparams(dataset, hparams_seed, trial_seed):
    """DomainBed's ``hparams_registry._hparams("RDM", dataset, seed)`` for the keys we
    train with (its unconditional resnet_dropout; RDM's block; lr, weight_decay and
    batch_size with RDM's own branch), defaults at hparams_seed 0."""
    small = dataset in ("RotatedMNIST", "ColoredMNIST", "RotatedDigits")
    table = {} if small else {"resnet_dropout": (0.0, lambda r: r.choice([0.0, 0.1, 0.5]))}
    if dataset in ["DomainNet"]:
        table["rdm_lambda"] = (0.5, lambda r: r.uniform(0.1, 1.0))
    elif dataset in ["PACS", "TerraIncognita"]:
        table["rdm_lambda"] = (5.0, lambda r: r.uniform(1.0, 10.0))
    else:
        table["rdm_lambda"] = (5.0, lambda r: r.uniform(0.1, 10.0))
    if dataset == "DomainNet":
        table["rdm_penalty_anneal_iters"] = (2400, lambda r: int(r.uniform(1500, 3000)))
    else:
        table["rdm_penalty_anneal_iters"] = (1500, lambda r: int(r.uniform(800, 2700)))
    if dataset in ["TerraIncognita", "OfficeHome", "DomainNet"]:
        table["variance_weight"] = (0.0, lambda r: r.choice([0.0]))
    else:
        table["variance_weight"] = (0.004, lambda r: r.uniform(0.001, 0.007))
    table["rdm_lr"] = (1.5e-5, lambda r: r.uniform(8e-6, 2e-5))
    if small:
        table["lr"] = (1e-3, lambda r: 10 ** r.uniform(-4.5, -2.5))
        table["weight_decay"] = (0.0, lambda r: 0.0)
        table["batch_size"] = (64, lambda r: int(2 ** r.uniform(3, 9)))
    else:
        table["lr"] = (5e-5, lambda r: 10 ** r.uniform(-5, -3.5))
        table["weight_decay"] = (0.0, lambda r: 10 ** r.uniform(-6, -2))
        if dataset in ["DomainNet", "TerraIncognita"]:
            table["batch_size"] = (40, lambda r: int(r.uniform(30, 60)))
        else:
            table["batch_size"] = (88, lambda r: int(r.uniform(70, 100)))
    setting = db_seed_hash(hparams_seed, trial_seed)
    ours = {"resnet_dropout": "dropout", "batch_size": "batch_per_env",
            "variance_weight": "rdm_variance_weight"}
    return {ours.get(name, name): default if hparams_seed == 0
            else draw(np.random.RandomState(db_seed_hash(setting, name)))
            for name, (default, draw) in table.items()}


@pytest.mark.parametrize("dataset", ["PACS", "DomainNet", "OfficeHome", "TerraIncognita",
                                     "RotatedDigits"])
def test_sweep_draws_domainbeds_rdm_hyperparameters_per_dataset(dataset):
    for h, t in itertools.product((0, 1, 5, 17), (0, 2)):
        got = random_hparams("erm", dataset, h, t, objective="rdm")
        assert got == db_rdm_hparams(dataset, h, t), (dataset, h, t)


def test_a_single_run_takes_rdms_defaults_on_domainnet():
    """DomainNet's rdm_lambda, anneal, variance weight and batch; the config file's lr."""
    config = resnet50_config("DomainNet")
    config.objective, lr = "rdm", config.lr
    cli.reference_defaults(config, ["main", "--config.objective=rdm", "--config.algorithm=erm"])
    assert (config.rdm_lambda, config.rdm_penalty_anneal_iters, config.rdm_variance_weight,
            config.batch_per_env, config.lr) == (0.5, 2400, 0.0, 40, lr)
