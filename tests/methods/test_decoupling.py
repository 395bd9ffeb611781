"""SD (sagm_jax.methods.decoupling) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` class ``SD`` (its ``update``: one forward of the concatenated
minibatches, CE + sd_reg * mean of the squared logits, one step of torch's Adam),
written here in JAX x64 and differentiated by ``jax.grad``; the package's code is never
the reference. Whole train steps run through ``make_train_step`` on a tiny dense
network. The random search's draw of ``sd_reg`` is re-stated from DomainBed's
``domainbed/hparams_registry.py``."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, torch_adam
from run_fixtures import train_steps

from sagm_jax import methods
from sagm_jax.config import config_problems
from sagm_jax.sweep.hparams import random_hparams

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 3, 4, 2, 5, 4
M, B = 3, 4  # domains, rows per domain
LR, WD = 0.05, 0.01
TOL = dict(rtol=2e-4, atol=2e-6)


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, M * B).astype(np.int32)}


def run_steps(objective, hp, steps):
    """``steps`` train steps of ``objective`` under ERM's Adam: the initial variables,
    the state after each step and each step's metrics."""
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)),
                         train=False)
    states, metrics = train_steps(net, variables, objective, hp, steps, batch,
                                  num_domains=M, lr=LR, wd=WD, key=7)
    return variables, states, metrics


def ref_logits(p, x):
    h = jnp.tanh(x.reshape(len(x), -1) @ p["body"]["kernel"] + p["body"]["bias"])
    return h @ p["classifier"]["kernel"] + p["classifier"]["bias"]


def ref_sd(p, x, y, sd_reg):
    """DomainBed's ``SD.update``: all_p = network(all_x); loss = CE(all_p, all_y) (mean
    over the N rows); penalty = (all_p ** 2).mean() (over N * C); the objective
    loss + sd_reg * penalty; it reports loss and penalty."""
    logits = ref_logits(p, x)
    loss = ref_ce(logits, y).mean()
    penalty = (logits**2).mean()
    return loss + sd_reg * penalty, (loss, penalty)


def assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_sd_three_adam_steps_match_domainbeds_update():
    """Every parameter and both reported values (CE alone, the mean squared logit) over 3
    steps of torch's Adam with coupled weight decay."""
    sd_reg = 0.3
    variables, states, metrics = run_steps("sd", {"sd_reg": sd_reg}, steps=3)
    with jax.enable_x64(True):
        params = f64(variables["params"])
        adam = adam_init(params)
        for t in range(3):
            data = batch(t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            (_, (loss, penalty)), grads = jax.value_and_grad(ref_sd, has_aux=True)(
                params, x, y, sd_reg)
            params, adam = torch_adam(params, grads, adam, LR, WD)
            np.testing.assert_allclose(float(metrics[t]["loss"]), float(loss), **TOL)
            np.testing.assert_allclose(float(metrics[t]["penalty"]), float(penalty), **TOL)
            assert set(metrics[t]) == {"loss", "penalty"}
            assert_close(states[t + 1].params, params)
    # The penalty moved the weights: ERM's steps from the same start differ.
    _, erm_states, _ = run_steps("erm", {}, steps=1)
    kernel = states[1].params["classifier"]["kernel"]
    assert not np.allclose(erm_states[1].params["classifier"]["kernel"], kernel, rtol=1e-3)


def test_sd_registry_entry_and_domainbeds_random_draw():
    """DomainBed's ``_hparam('sd_reg', 0.1, lambda r: 10**r.uniform(-5, -1))`` with its
    ``RandomState(seed_hash(seed_hash(hparams_seed, trial_seed), 'sd_reg'))``; setting 0
    is the default; the row is DomainBed's name alone."""
    def seed_hash(*args):
        return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)

    for hparams_seed, trial_seed in ((1, 0), (2, 1), (7, 2), (19, 0)):
        rng = np.random.RandomState(seed_hash(seed_hash(hparams_seed, trial_seed), "sd_reg"))
        drawn = random_hparams("erm", "PACS", hparams_seed, trial_seed, "sd")
        assert drawn["sd_reg"] == 10 ** rng.uniform(-5, -1)
        assert 1e-5 <= drawn["sd_reg"] <= 1e-1
    assert random_hparams("erm", "PACS", 0, 0, "sd")["sd_reg"] == 0.1
    assert "sd_reg" not in random_hparams("erm", "PACS", 3, 0, "coral")
    assert methods.method_label("sd", "erm") == "SD"
    assert methods.method_label("sd", "sagm") == "SAGM + SD"


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_sd_reg_must_be_positive(value):
    """0 would train ERM under SD's label: refused in one line that says so."""
    from run_fixtures import digits_config

    (problem,) = config_problems(digits_config(objective="sd", sd_reg=value))
    assert problem.startswith(f"config.sd_reg={value}: expected a number > 0")
    assert "ERM labelled SD" in problem
