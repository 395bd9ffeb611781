"""EQRM (sagm_jax.methods.quantile) against float64 re-statements of DomainBed's ``EQRM``
(``domainbed/algorithms.py``) and its ``Nonparametric.icdf`` (``domainbed/lib/misc.py``:
the Gauss-optimal bandwidth, the KDE's CDF, ``continuous_bisect_fun_left``), written here:
the bisection is the reference's Python loop on float64 numbers, which also keeps the
weight of each end in every k (what autograd differentiates); the quantile itself is
checked against SciPy's root of the KDE's CDF. Whole train steps (burn-in, the fresh Adam
at eqrm_lr, the quantile's update) run through ``make_train_step`` on a tiny network
against torch's Adam re-stated in float64; one short RotatedDigits run; the random
search's draws against DomainBed's ``hparams_registry`` formulas."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from scipy import optimize, special, stats

from sagm_jax import cli
from sagm_jax.config import config_problems
from sagm_jax.methods import objectives, quantile
from sagm_jax.methods.update_rules import rule_optimizer
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

from float64_reference import TanhNet, adam_init, f64, ref_ce, torch_adam
from run_fixtures import digits_config
from test_examples import DIGITS, example_of, parse

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 3, 3, 2, 3, 4
M, B = 4, 5
LR = 0.01
TOL = dict(rtol=2e-4, atol=2e-6)


# ---------------------------------------------------------------- float64 re-statement


def ref_bandwidth(data):
    return 1.06 * np.std(data, ddof=1) * len(data) ** -0.2


def ref_cdf(x, data, bw):
    return np.mean(stats.norm.cdf(x, loc=data, scale=bw))


def ref_bisect(f, v, lo, hi, n_steps=32):
    """``continuous_bisect_fun_left`` on floats; each value carries its weight on ``lo``
    (k = c lo + (1 - c) hi), what autograd differentiates. Returns (k, c)."""
    ends = [(lo, 1.0), (hi, 0.0)]
    k = (0.5 * (ends[0][0] + ends[1][0]), 0.5 * (ends[0][1] + ends[1][1]))
    for _ in range(n_steps):
        ends[int(f(k[0]) > v)] = k
        nxt = (0.5 * (ends[0][0] + ends[1][0]), 0.5 * (ends[0][1] + ends[1][1]))
        if nxt[0] == k[0]:
            break
        k = nxt
    return k


def ref_icdf(risks, alpha):
    """``Nonparametric.icdf(alpha)`` in float64: (value, weight c on lo, lo, hi, z)."""
    data = np.sort(np.asarray(risks, np.float64))
    bw = ref_bandwidth(data)
    z = stats.norm.ppf(alpha)
    lo, hi = data[0] + bw * z, data[-1] + bw * z
    k, c = ref_bisect(lambda x: ref_cdf(x, data, bw), alpha, lo, hi)
    return k, c


def ref_quantile_loss(risks, alpha, c):
    """The quantile as the reference's autograd sees it: c lo + (1 - c) hi, with c the
    bisection's weight on lo at these risks (``ref_icdf``), a constant."""
    data = jnp.sort(risks)
    n = data.shape[0]
    bw = 1.06 * jnp.sqrt(jnp.sum((data - data.mean()) ** 2) / (n - 1)) * n ** -0.2
    z = special.ndtri(alpha)
    return c * (data[0] + bw * z) + (1 - c) * (data[-1] + bw * z)


# Compiled once per shape; alpha and the gradient's kind are arguments.
QUANTILE = jax.jit(quantile.kde_quantile, static_argnums=2)
GRADIENT = jax.jit(jax.grad(quantile.kde_quantile), static_argnums=2)

# Five risks with two close pairs and an outlier; the fewest EQRM takes (two).
RISKS = [np.array([0.05, 0.06, 0.93, 0.91, 3.0]), np.array([2.0, 2.1])]


@pytest.mark.parametrize("risks", RISKS, ids=["five", "two"])
@pytest.mark.parametrize("alpha", [0.5, 0.75, 0.97])
def test_quantile_and_its_gradient_are_the_references(risks, alpha):
    """The value is the root of F(x) = alpha (SciPy); the default gradient is the
    reference's bisection weights on the extreme risks and the bandwidth; "implicit" is
    the finite difference of the float64 quantile."""
    data = np.sort(risks)
    bw = ref_bandwidth(data)
    root = optimize.brentq(lambda x: ref_cdf(x, data, bw) - alpha, data[0] - 10 * bw - 1,
                           data[-1] + 10 * bw + 1, xtol=1e-14)
    got = QUANTILE(jnp.asarray(risks, jnp.float32), alpha, "bisection")
    np.testing.assert_allclose(float(got), root, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(got), ref_icdf(risks, alpha)[0], rtol=1e-5, atol=1e-6)

    grad = GRADIENT(jnp.asarray(risks, jnp.float32), alpha, "bisection")
    with jax.enable_x64(True):
        want = jax.grad(ref_quantile_loss)(jnp.asarray(risks, jnp.float64), alpha,
                                           ref_icdf(risks, alpha)[1])
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)

    def f64_quantile(r):
        d = np.sort(r)
        h = ref_bandwidth(d)
        return optimize.brentq(lambda x: ref_cdf(x, d, h) - alpha, d[0] - 10 * h - 1,
                               d[-1] + 10 * h + 1, xtol=1e-15)

    eye = np.eye(len(risks)) * 1e-6
    numeric = [(f64_quantile(risks + e) - f64_quantile(risks - e)) / 2e-6 for e in eye]
    implicit = GRADIENT(jnp.asarray(risks, jnp.float32), alpha, "implicit")
    np.testing.assert_allclose(np.asarray(implicit), numeric, rtol=1e-3, atol=1e-4)


def test_bisection_gradient_reaches_only_the_extreme_risks_and_the_bandwidth():
    """With the bandwidth's own dependence taken out (d h / d r sums to 0 over r and is
    the same whichever middle risk moves, up to its centring), the middle risks get only
    z dh: their gradients differ from the implicit gradient's, whose weights follow the
    kernel density at Q."""
    risks = jnp.asarray(RISKS[0], jnp.float32)
    bisection = np.asarray(GRADIENT(risks, 0.75, "bisection"))
    implicit = np.asarray(GRADIENT(risks, 0.75, "implicit"))
    np.testing.assert_allclose(bisection.sum(), 1.0, rtol=1e-5)  # c + (1 - c)
    np.testing.assert_allclose(implicit.sum(), 1.0, rtol=1e-4)
    assert np.abs(bisection - implicit).max() > 0.1


# ---------------------------------------------------------------- whole train steps


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(t):
    rng = np.random.default_rng(t)
    n = M * B
    # Domain m's images scaled by 1 + m, so the domains' risks differ.
    scale = np.repeat(1.0 + np.arange(M), B)[:, None, None, None]
    return {"image": (rng.normal(size=(n, HEIGHT, WIDTH, CHANNELS)) * scale).astype(np.float32),
            "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def ref_tiny(p, x):
    h = jnp.tanh(x.reshape(len(x), -1) @ p["body"]["kernel"] + p["body"]["bias"])
    return h @ p["classifier"]["kernel"] + p["classifier"]["bias"]


def ref_risks(p, x, y):
    """Each domain's risk from its own forward (``EQRM.risk``)."""
    return jnp.stack([ref_ce(ref_tiny(p, x[m * B:(m + 1) * B]), y[m * B:(m + 1) * B]).mean()
                      for m in range(M)])


def ref_eqrm_value_and_grad(p, x, y, t, hp):
    """DomainBed's ``EQRM.update``: the mean of the risks before the burn-in's end, the
    KDE quantile from it (its bisection's weight c found at these parameters)."""
    if t < hp["eqrm_burnin_iters"]:
        return _ref_mean(p, x, y)
    c = ref_icdf(np.asarray(_ref_risks(p, x, y)), hp["eqrm_quantile"])[1]
    return _ref_quantile(p, x, y, hp["eqrm_quantile"], c)


# Compiled under x64 at their first call (inside the test's ``enable_x64``).
_ref_risks = jax.jit(ref_risks)
_ref_mean = jax.jit(jax.value_and_grad(lambda q, x, y: ref_risks(q, x, y).mean()))
_ref_quantile = jax.jit(jax.value_and_grad(
    lambda q, x, y, alpha, c: ref_quantile_loss(ref_risks(q, x, y), alpha, c)),
    static_argnums=3)


@pytest.mark.parametrize("burnin,algorithm", [(1.0, "erm"), (1.5, "erm"), (0.0, "sam")])
def test_three_steps_match_domainbeds_update(burnin, algorithm):
    """Loss and every parameter after 3 steps, weight decay on. burn-in 1: ERM at step 0,
    then Adam replaced by a fresh one at eqrm_lr at step 1 (the quantile's first step);
    burn-in 1.5 (a random draw's kind of value): ERM at steps 0 and 1, the quantile at
    step 2, and step == 1.5 never holds, so Adam and lr are kept; burn-in 0 under SAM:
    the fresh Adam at step 0, the quantile's gradient at the perturbed point."""
    hp = {"eqrm_quantile": 0.7, "eqrm_burnin_iters": burnin, "eqrm_lr": 0.003}
    wd, rho = 0.05, 0.05
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    opt = rule_optimizer(algorithm, {"rho": rho}, learning_rate=LR, weight_decay=wd)
    step = jax.jit(make_train_step(net, opt, algorithm=algorithm,
                                   method=StepMethod("eqrm", hp, M, learning_rate=LR)))
    state = create_train_state(variables, opt, {})
    with jax.enable_x64(True):
        p, adam, lr = f64(variables["params"]), adam_init(f64(variables["params"])), LR
        for t in range(3):
            data = batch(t)
            state, metrics = step(state, data, jax.random.key(3))
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            if t == burnin:  # DomainBed: ``if self.update_count == eqrm_burnin_iters``
                adam, lr = adam_init(p), hp["eqrm_lr"]
            value, g = ref_eqrm_value_and_grad(p, x, y, t, hp)
            if algorithm == "sam":  # SAM's gradient at w + rho g / ||g||
                norm = jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree.leaves(g)))
                perturbed = jax.tree.map(lambda w, d: w + rho * d / norm, p, g)
                g = ref_eqrm_value_and_grad(perturbed, x, y, t, hp)[1]
            p, adam = torch_adam(p, g, adam, lr, wd)
            np.testing.assert_allclose(float(metrics["loss"]), float(value), **TOL)
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(p), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


@pytest.mark.parametrize("gradient", ["bisection", "implicit"])
def test_one_and_five_devices_agree_after_the_burn_in(gradient):
    """The risks are each whole domain's (the global batch's), also with the 20 rows
    sharded over 5 devices (4 rows each: every domain of 5 straddles two shards), so the
    quantile and its gradient are the one-device ones."""
    hp = {"eqrm_burnin_iters": 1.0, "eqrm_gradient": gradient}
    net = TinyNet()
    params = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), False)["params"]
    data = batch(0)

    def loss(p, x, y):
        def forward(images):
            h, logits = net.apply({"params": p}, images, False, features=True)
            return objectives.Outputs(h, logits, {})

        return objectives.objective_loss("eqrm", hp, forward, x, y, num_domains=M, state={},
                                         step=jnp.int32(4), key=None, advance=True)[0]

    results = []
    for devices in (jax.devices()[:1], jax.devices()[:5]):
        mesh = Mesh(np.array(devices), ("batch",))
        rows, same = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
        args = (jax.device_put(params, same), jax.device_put(data["image"], rows),
                jax.device_put(data["label"], rows))
        results.append(jax.jit(jax.value_and_grad(loss))(*args))
    (one, grad_one), (many, grad_many) = results
    np.testing.assert_allclose(float(many), float(one), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad_many), jax.tree.leaves(grad_one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_eqrm_refuses_one_training_domain_and_needs_the_learning_rate():
    """Before a run, where the dataset's domains are known (RotatedDigits: 6); at the
    step's trace otherwise (an image folder's are listed at set-up)."""
    one = config_problems(digits_config(objective="eqrm", test_envs=(0, 1, 2, 3, 4)))
    assert one == ["config.test_envs=(0, 1, 2, 3, 4) with config.objective=eqrm: 1 training "
                   "environment(s); EQRM's kernel density estimate needs the unbiased "
                   "standard deviation of the domains' risks, which one domain leaves "
                   "undefined; hold out fewer environments, so that 2 or more train."]
    assert config_problems(digits_config(objective="eqrm", test_envs=(0, 1, 2, 3))) == []
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    opt = rule_optimizer("erm", {}, learning_rate=LR, weight_decay=0.0)
    with pytest.raises(ValueError, match="StepMethod.learning_rate"):
        make_train_step(net, opt, algorithm="erm", method=StepMethod("eqrm", {}, 2))
    step = make_train_step(net, opt, algorithm="erm",
                           method=StepMethod("eqrm", {}, 1, learning_rate=LR))
    data = batch(0)
    with pytest.raises(ValueError, match="at least 2 training domains"):
        step(create_train_state(variables, opt, {}), data, jax.random.key(0))


def test_the_refusals_example_command_passes_the_checks(tmp_path):
    """The command line's refusal (exit 2) and its "For example:" command, which keeps
    the objective and takes the config file's test environments."""
    argv = ["main", f"--config={DIGITS}", "--config.objective=eqrm",
            "--config.test_envs=(0,1,2,3,4)", f"--workdir={tmp_path / 'run'}"]
    example = example_of(argv)
    assert "--config.objective=eqrm" in example
    assert not any(word.startswith("--config.test_envs") for word in example)
    config, workdir = parse(["main", *example])
    cli.preflight(config, workdir, ["main", *example], 1)


# ---------------------------------------------------------------- a run, the search


def test_eqrm_trains_on_rotated_digits(tmp_path):
    """2 steps of EQRM, the burn-in's end and the fresh Adam inside the run (SAM's
    composition is checked step by step above)."""
    config = digits_config(steps=2, eval_every=1, objective="eqrm", algorithm="erm",
                           eqrm_burnin_iters=1.0, eqrm_lr=1e-4)
    records = train.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r["loss"]) for r in records)


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def test_random_search_draws_domainbeds_eqrm_hyperparameters():
    """DomainBed's ``hparams_registry``: eqrm_quantile U(0.5, 0.99), eqrm_burnin_iters
    10^U(2.5, 3.5) (no int(): a float), eqrm_lr 10^U(-7, -5); defaults 0.75, 2500, 1e-6."""
    draws = {"eqrm_quantile": lambda r: r.uniform(0.5, 0.99),
             "eqrm_burnin_iters": lambda r: 10 ** r.uniform(2.5, 3.5),
             "eqrm_lr": lambda r: 10 ** r.uniform(-7, -5)}
    for dataset in ("PACS", "RotatedDigits"):
        defaults = random_hparams("erm", dataset, 0, 0, "eqrm")
        assert {k: defaults[k] for k in draws} == {
            "eqrm_quantile": 0.75, "eqrm_burnin_iters": 2500, "eqrm_lr": 1e-6}
        for hparams_seed, trial_seed in [(1, 0), (2, 1), (7, 2)]:
            got = random_hparams("erm", dataset, hparams_seed, trial_seed, "eqrm")
            setting = db_seed_hash(hparams_seed, trial_seed)
            want = {name: draw(np.random.RandomState(db_seed_hash(setting, name)))
                    for name, draw in draws.items()}
            assert {k: got[k] for k in draws} == want
            assert type(got["eqrm_burnin_iters"]) is float
            assert "eqrm_gradient" not in got
