"""CAD and CondCAD (sagm_jax.methods.contrastive) against a float64 re-statement of
DomainBed's ``domainbed/algorithms.py`` (``AbstractCAD.bn_loss`` and ``update``), written
here in JAX x64 the way the reference computes it: boolean masks, ``log`` of the masks
(-inf) inside ``logsumexp``, the diagonal multiplied to 0, the detached row maximum, the
kept rows selected by boolean indexing, ``finite_mean``, and torch's Adam. The package's
code is never the reference. Whole train steps (3 Adam steps) run through
``make_train_step`` on a tiny dense network; one short RotatedDigits run trains CAD with
its projection head under SAGM; the sweep's draws are DomainBed's ``hparams_registry``."""

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, torch_adam
from ml_collections import ConfigDict
from run_fixtures import digits_config

from sagm_jax import methods
from sagm_jax.config import validate
from sagm_jax.methods import contrastive, networks
from sagm_jax.methods.update_rules import rule_optimizer
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import loading, train
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 3, 1, 5, 4
M, B = 3, 4  # domains, rows per domain
LR = 0.01
TOL = {"rtol": 2e-4, "atol": 2e-6}
# Step 0's labels (domains 0, 1, 2): class 3 occurs once (CAD drops that row), class 2
# only in domain 1 (CondCAD's flipped loss drops those rows), and some rows have no
# same-label partner in their own domain (CondCAD's unflipped loss drops them).
STEP0_LABELS = np.array([0, 1, 0, 3, 1, 2, 2, 0, 0, 1, 1, 0], np.int32)


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(t):
    rng = np.random.default_rng(t)
    labels = STEP0_LABELS if t == 0 else rng.integers(0, CLASSES, M * B).astype(np.int32)
    return {"image": rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": labels}


def run_steps(objective, hp, wd, steps=3):
    """``steps`` train steps of ERM's Adam on the objective: the initial variables, the
    states after each step and each step's metrics."""
    entry = methods.objective(objective)
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    own = networks.init_method_variables(entry.network, jax.random.key(1), shapes, hp)
    variables = networks.with_method_variables(dict(variables), own)
    model = networks.wrap(net, entry.network, hp)
    opt = rule_optimizer("erm", {}, learning_rate=LR, weight_decay=wd)
    step = jax.jit(make_train_step(model, opt, algorithm="erm",
                                   method=StepMethod(objective, hp, M)))
    state = create_train_state(variables, opt, {})
    states, metrics = [], []
    for t in range(steps):
        state, m = step(state, batch(t), jax.random.key(7))
        states.append(state)
        metrics.append(m)
    return variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement


def ref_bn_loss(z, y, dom, project, temperature, conditional, flipped, normalized,
                self_excluded=False):
    """``AbstractCAD.bn_loss``: z [N, d] float64, y and dom NumPy [N]; returns the loss
    and the number of rows ``finite_mean`` averages."""
    n = z.shape[0]
    mask_y = y[:, None] == y[None, :]
    mask_d = dom[:, None] == dom[None, :]
    mask_drop = ~np.eye(n, dtype=bool)
    mask_y = mask_y & mask_drop
    mask_y_n_d = mask_y & ~mask_d
    mask_y_d = mask_y & mask_d
    if project is not None:
        hidden = jnp.maximum(z @ project["linear_0"]["kernel"] + project["linear_0"]["bias"], 0)
        z = hidden @ project["linear_1"]["kernel"] + project["linear_1"]["bias"]
    if normalized:
        z = z / jnp.maximum(jnp.sqrt((z * z).sum(1, keepdims=True)), 1e-12)
    logits = (z @ z.T) / temperature * mask_drop
    logits = logits - jax.lax.stop_gradient(logits.max(1, keepdims=True))
    lse = jax.scipy.special.logsumexp
    ratio = temperature / 0.07

    def log(mask):  # torch's mask.float().log(): 0 -> -inf
        return np.where(mask, 0.0, -np.inf)
    if not conditional:
        log_prob = logits - lse(logits + log(mask_drop), axis=1, keepdims=True)
        valid = mask_y.sum(1) > 0
        log_prob, mask_d = log_prob[valid], mask_d[valid]
        if flipped:
            bn = -ratio * lse(log_prob + log(~mask_d), axis=1)
        else:
            same = mask_d & mask_drop[valid] if self_excluded else mask_d
            bn = ratio * lse(log_prob + log(same), axis=1)
    else:
        valid = (mask_y_n_d if flipped else mask_y_d).sum(1) > 0
        mask_y, mask_y_d, mask_y_n_d = mask_y[valid], mask_y_d[valid], mask_y_n_d[valid]
        logits = logits[valid]
        log_prob_y = logits - lse(logits + log(mask_y), axis=1, keepdims=True)
        chosen = mask_y_n_d if flipped else mask_y_d
        bn = (-ratio if flipped else ratio) * lse(log_prob_y + log(chosen), axis=1)
    finite = jnp.isfinite(bn)
    count = finite.sum()
    mean = jnp.where(finite, bn, 0.0).sum()
    return jnp.where(count != 0, mean / jnp.maximum(count, 1), 0.0), count


def ref_update_loss(q, x, y, hp, conditional):
    """``AbstractCAD.update``: clf_loss + lmbda * bn_loss, the domains in minibatch order;
    ``y`` NumPy (the masks are constants)."""
    net = q["net"]
    z = jnp.tanh(x.reshape(len(x), -1) @ net["body"]["kernel"] + net["body"]["bias"])
    logits = z @ net["classifier"]["kernel"] + net["classifier"]["bias"]
    dom = np.repeat(np.arange(M), B)
    bn, count = ref_bn_loss(z, y, dom, q.get("project"), hp["temperature"],
                            conditional, hp["is_flipped"], hp["is_normalized"],
                            hp.get("cad_self_term") == "excluded")
    clf = ref_ce(logits, jnp.asarray(y)).mean()
    total = clf + hp["lmbda"] * bn
    return total, (clf, bn, count)


def hyperparameters(**overrides):
    hp = {"lmbda": 0.7, "temperature": 0.1, "is_normalized": False, "is_project": False,
          "is_flipped": True}
    return {**hp, **overrides}


# DomainBed's setting (flipped) of each, CondCAD's with the normalization and the
# projection head; the unflipped losses are checked below (loss and gradient).
CASES = [
    ("cad", hyperparameters()),
    ("condcad", hyperparameters(temperature=0.05, is_normalized=True, is_project=True)),
]
STEPS = 2


@pytest.mark.parametrize("objective,hp", CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items() if k != "lmbda"))
def test_two_adam_steps_are_the_reference(objective, hp):
    """Every parameter (featurizer, classifier, projection head) and every reported loss
    (``loss`` = DomainBed's total_loss, ``clf_loss``, ``bn_loss``) after each of 2 steps;
    the reference's loss and gradient are compiled once per step."""
    wd = 0.05
    variables, states, metrics = run_steps(objective, hp, wd, steps=STEPS)
    conditional = objective == "condcad"
    with jax.enable_x64(True):
        trained = {"net": f64({k: v for k, v in variables["params"].items() if k != "method"})}
        if hp["is_project"]:
            trained["project"] = f64(variables["params"]["method"]["project"])
            assert trained["project"]["linear_1"]["kernel"].shape == (DIM, 128)
        else:
            assert "method" not in variables["params"]
        adam = adam_init(trained)
        counts = []
        for t in range(STEPS):
            data = batch(t)
            x = jnp.asarray(data["image"], jnp.float64)
            step_loss = functools.partial(ref_update_loss, y=data["label"], hp=hp,
                                          conditional=conditional)
            (total, (clf, bn, count)), grads = jax.jit(
                jax.value_and_grad(step_loss, has_aux=True))(trained, x)
            counts.append(int(count))
            trained, adam = torch_adam(trained, grads, adam, LR, wd)
            for key, want in (("loss", total), ("clf_loss", clf), ("bn_loss", bn)):
                np.testing.assert_allclose(float(metrics[t][key]), float(want), **TOL,
                                           err_msg=f"step {t} {key}")
            got = states[t].params
            net = {k: v for k, v in got.items() if k != "method"}
            for a, b in zip(jax.tree.leaves(net), jax.tree.leaves(trained["net"]), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
            if hp["is_project"]:
                for a, b in zip(jax.tree.leaves(got["method"]["project"]),
                                jax.tree.leaves(trained["project"]), strict=True):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                                               atol=LR * 1e-3)
    assert 0 < counts[0] < M * B  # step 0 drops some rows and keeps others


@pytest.mark.parametrize("conditional,self_term", [(False, "zero_logit"),
                                                    (False, "excluded"), (True, "zero_logit")])
def test_unflipped_losses_and_the_self_term_fix(conditional, self_term):
    """The unflipped bottleneck loss and its gradient on step 0's batch: CAD's counts the
    example itself with logit 0 (the reference's) or not (``cad_self_term="excluded"``,
    the fix, which the reference computes with the diagonal left out of ``mask_d``);
    CondCAD's (which never counts it)."""
    data = batch(0)
    z = jnp.asarray(np.random.default_rng(4).normal(size=(M * B, DIM)), jnp.float32)
    labels, domains = jnp.asarray(data["label"]), jnp.repeat(jnp.arange(M), B)

    def loss(f):
        return contrastive.bottleneck_loss(f, labels, domains, temperature=0.2,
                                           conditional=conditional, flipped=False,
                                           normalized=True, self_term=self_term)

    value, grad = jax.jit(jax.value_and_grad(loss))(z)
    with jax.enable_x64(True):
        def ref(f, excluded):
            return ref_bn_loss(f, data["label"], np.repeat(np.arange(M), B), None, 0.2,
                               conditional, False, True, self_excluded=excluded)[0]

        want, want_grad = jax.jit(jax.value_and_grad(ref), static_argnums=1)(
            f64(z), self_term == "excluded")
        np.testing.assert_allclose(float(value), float(want), **TOL)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), **TOL)
        if not conditional:  # the self term changes the value
            other = jax.jit(ref, static_argnums=1)(f64(z), self_term != "excluded")
            assert abs(float(other) - float(want)) > 1e-3


def test_one_domain_and_no_kept_row():
    """CAD's flipped loss with a single domain: every row is +inf and left out, so the
    loss is 0 (``finite_mean``), with a zero gradient (the reference's logsumexp of -inf
    entries back-propagates NaN there); CondCAD with no label shared across domains
    likewise keeps no row."""
    z = jnp.asarray(np.random.default_rng(3).normal(size=(6, 4)), jnp.float32)
    labels = jnp.asarray([0, 0, 1, 1, 2, 2])

    @functools.partial(jax.jit, static_argnums=2)
    def value_and_grad(f, domains, conditional):
        return jax.value_and_grad(lambda g: contrastive.bottleneck_loss(
            g, labels, domains, temperature=0.1, conditional=conditional, flipped=True,
            normalized=False))(f)

    for domains, conditional in ((jnp.zeros(6, jnp.int32), False), (labels, True)):
        value, grad = value_and_grad(z, domains, conditional)
        assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)


def test_boolean_hyperparameters_are_checked():
    """A config that builds its own ConfigDict (any type) is refused with the key named."""
    config = ConfigDict({**digits_config(objective="cad").to_dict(), "is_project": 1})
    with pytest.raises(ValueError, match="config.is_project=1: expected True or False"):
        validate(config)
    with pytest.raises(ValueError, match="config.lmbda=0"):
        validate(digits_config(objective="condcad", lmbda=0.0))


# ---------------------------------------------------------------- the sweep's draws


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def db_cad_hparams(random_seed):
    """DomainBed's ``hparams_registry`` block of CAD and CondCAD: ``{name: random value}``."""
    draws = {
        "lmbda": lambda r: r.choice([1e-4, 1e-3, 1e-2, 1e-1, 1, 1e1, 1e2]),
        "temperature": lambda r: r.choice([0.05, 0.1]),
        "is_normalized": lambda r: False,
        "is_project": lambda r: False,
        "is_flipped": lambda r: True,
    }
    return {name: draw(np.random.RandomState(db_seed_hash(random_seed, name)))
            for name, draw in draws.items()}


@pytest.mark.parametrize("objective", ["cad", "condcad"])
def test_sweep_draws_are_domainbeds(objective):
    defaults = random_hparams("erm", "PACS", 0, 0, objective)
    assert {k: defaults[k] for k in ("lmbda", "temperature", "is_normalized", "is_project",
                                     "is_flipped")} == {
        "lmbda": 0.1, "temperature": 0.1, "is_normalized": False, "is_project": False,
        "is_flipped": True}
    seen = set()
    for hparams_seed in (1, 2, 5, 11):
        for trial_seed in (0, 1):
            got = random_hparams("erm", "PACS", hparams_seed, trial_seed, objective)
            want = db_cad_hparams(db_seed_hash(hparams_seed, trial_seed))
            assert {k: got[k] for k in want} == want
            assert "cad_self_term" not in got  # ours, not drawn
            seen.add(got["lmbda"])
    assert len(seen) > 2


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_cad_with_its_projection_head_trains_under_sagm(tmp_path):
    config = digits_config(objective="cad", algorithm="sagm", is_project=True,
                           is_normalized=True, steps=2, eval_every=1)
    records = train.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r[k]) for r in records for k in ("loss", "clf_loss", "bn_loss"))
    params = loading.load_run(str(tmp_path), "latest")[1]["params"]
    head = params["method"]["project"]
    assert head["linear_0"]["kernel"].shape == (32, 32)  # the CNN's 32 features
    assert head["linear_1"]["kernel"].shape == (32, 128)
