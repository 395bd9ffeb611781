"""Transfer (sagm_jax.methods.transfer) against a float64 re-statement of DomainBed's
``Transfer.update`` and ``loss_gap`` (``domainbed/algorithms.py``) and ``misc.proj``.

The network is a tanh featurizer (z = tanh(flat(x) @ W + c)) and the linear classifier
``params["classifier"]``; the adversarial head is ``params["method"]``. The re-statement
is JAX in float64, written here from the reference: the loss gap as the reference's loop
(strict ``>``/``<``, so the first domain wins a tie) with ``jax.grad`` of the two chosen
domains' losses, PyTorch's Adam from tests/float64_reference.py with the classifier
skipped on the gap step (its gradient is None), the head's SGD ascent and the Euclidean
projection written out with a Python branch on the distance.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from float64_reference import f64, ref_ce, torch_adam
from run_fixtures import digits_config, procedure_steps

from sagm_jax import methods
from sagm_jax.methods import networks, procedures, transfer
from sagm_jax.methods.objectives import Outputs
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train

M, PER_DOMAIN, HEIGHT, WIDTH, DIM, CLASSES = 3, 4, 2, 3, 5, 4
LR, WD = 0.05, 0.1
HP = {"transfer_t_lambda": 0.7, "transfer_delta": 0.6, "transfer_d_steps_per_g": 3,
      "transfer_weight_decay_d": 0.2, "transfer_gda": False, "transfer_beta1": 0.5,
      "transfer_lr_d": 0.6, "transfer_fix_optimizers": False}
TOL = {"rtol": 2e-4, "atol": 2e-6}


def make_problem(seed=0):
    rng = np.random.default_rng(seed)
    network = {
        "featurizer": {"kernel": rng.normal(0, 0.6, (HEIGHT * WIDTH, DIM)),
                       "bias": rng.normal(0, 0.2, (DIM,))},
        "classifier": {"kernel": rng.normal(0, 0.8, (DIM, CLASSES)),
                       "bias": rng.normal(0, 0.3, (CLASSES,))},
    }
    network = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), network)
    shapes = networks.Shapes((HEIGHT, WIDTH, 1), DIM, CLASSES, M)
    own = transfer.init_adversarial_head(jax.random.PRNGKey(seed), shapes, HP,
                                         network=(None, {"params": network}))
    images = rng.normal(0, 1, (M * PER_DOMAIN, HEIGHT, WIDTH, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, M * PER_DOMAIN).astype(np.int32)
    return {**network, "method": own["params"]}, images, labels


def forward_at(params, dropout_key):
    del dropout_key  # the tiny featurizer has no dropout

    def forward(images):
        layer = params["featurizer"]
        features = jnp.tanh(images.reshape(images.shape[0], -1) @ layer["kernel"]
                            + layer["bias"])
        return Outputs(features, networks.classify(params, features), {},
                       lambda f: networks.classify(params, f))

    return forward


def run_package(hp, params, images, labels, steps):
    return procedure_steps("transfer", hp, params, forward_at, images, labels, steps,
                           num_domains=M, lr=LR, wd=WD)


# ---------------------------------------------------------------- float64 re-statement


def ref_features(f, x):
    return jnp.tanh(x.reshape(len(x), -1) @ f["kernel"] + f["bias"])


def ref_domain_losses(f, head, xs, ys):
    return [jnp.mean(ref_ce(ref_features(f, x) @ head["kernel"] + head["bias"], y))
            for x, y in zip(xs, ys)]


def ref_pick(losses):
    """``loss_gap``'s loop: the first strictly larger / smaller loss wins."""
    hi, lo, i_hi, i_lo = -np.inf, np.inf, None, None
    for m, value in enumerate(float(v) for v in losses):
        if value > hi:
            hi, i_hi = value, m
        if value < lo:
            lo, i_lo = value, m
    return i_hi, i_lo


def ref_gap(f, head, xs, ys, t_lambda, pick):
    losses = ref_domain_losses(f, head, xs, ys)
    return t_lambda * (losses[pick[0]] - losses[pick[1]])


def ref_step(net, adv, states, xs, ys, hp, branches):
    """One ``Transfer.update``: returns the network, head, Adam states and the report."""
    t_lambda, gda, fix = hp["transfer_t_lambda"], hp["transfer_gda"], hp["transfer_fix_optimizers"]
    betas = (hp["transfer_beta1"], 0.999) if fix else (0.9, 0.999)
    x_all, y_all = jnp.concatenate(xs), jnp.concatenate(ys)

    def whole(n):
        logits = ref_features(n["featurizer"], x_all) @ n["classifier"]["kernel"]
        return jnp.mean(ref_ce(logits + n["classifier"]["bias"], y_all))

    loss, g = jax.value_and_grad(whole)(net)
    if gda and not fix:  # SGD over the head only: the network is in no optimizer
        pass
    else:
        if gda:
            net = jax.tree.map(lambda w, d: w - LR * d, net, g)
        else:
            f, states["f"] = torch_adam(net["featurizer"], g["featurizer"], states["f"], LR,
                                        WD, betas)
            c, states["c"] = torch_adam(net["classifier"], g["classifier"], states["c"], LR,
                                        WD, betas)
            net = {"featurizer": f, "classifier": c}
        pick = ref_pick(ref_domain_losses(net["featurizer"], adv, xs, ys))
        gg = jax.grad(ref_gap)(net["featurizer"], adv, xs, ys, t_lambda, pick)
        if gda:
            f = jax.tree.map(lambda w, d: w - LR * d, net["featurizer"], gg)
        else:  # the classifier's grad is None: its Adam does not step
            f, states["f"] = torch_adam(net["featurizer"], gg, states["f"], LR, WD, betas)
        net = {**net, "featurizer": f}
    h = net["classifier"]
    adv = h
    decay = hp["transfer_weight_decay_d"] if fix else 0.0
    for _ in range(hp["transfer_d_steps_per_g"]):
        pick = ref_pick(ref_domain_losses(net["featurizer"], adv, xs, ys))
        minimised = lambda a: -ref_gap(net["featurizer"], a, xs, ys, t_lambda, pick)  # noqa
        neg_gap, grad = jax.value_and_grad(minimised)(adv)
        adv = jax.tree.map(lambda w, d: w - hp["transfer_lr_d"] * (d + decay * w), adv, grad)
        dist = float(jnp.sqrt(sum(jnp.sum((adv[k] - h[k]) ** 2) for k in adv)))
        branches.append(dist <= hp["transfer_delta"])
        if dist > hp["transfer_delta"]:
            ratio = hp["transfer_delta"] / dist
            adv = {k: h[k] + ratio * (adv[k] - h[k]) for k in adv}
    return net, adv, states, {"loss": float(loss), "gap": -float(neg_gap)}


def adam_state(state):
    """The ``ScaleByAdamState`` inside one of the package's optax chains."""
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
        s, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return found[0]


def check_against_reference(hp, seed=0, steps=3):
    params, images, labels = make_problem(seed)
    history = run_package(hp, params, images, labels, steps)
    with jax.enable_x64(True):
        xs = list(f64(images).reshape(M, PER_DOMAIN, HEIGHT, WIDTH, 1))
        ys = list(jnp.asarray(labels).reshape(M, PER_DOMAIN))
        net = f64({k: params[k] for k in ("featurizer", "classifier")})
        adv = f64(params["method"]["adversarial_classifier"])
        zeros = jax.tree.map(jnp.zeros_like, net)
        states = {"f": {"t": 0, "m": zeros["featurizer"], "v": zeros["featurizer"]},
                  "c": {"t": 0, "m": zeros["classifier"], "v": zeros["classifier"]}}
        branches = []
        for got_params, got_state, got_metrics in history:
            net, adv, states, report = ref_step(net, adv, states, xs, ys, hp, branches)
            assert set(got_metrics) == {"loss", "gap"}
            for key in report:
                np.testing.assert_allclose(got_metrics[key], report[key], **TOL, err_msg=key)
            for group in ("featurizer", "classifier"):
                for name in ("kernel", "bias"):
                    np.testing.assert_allclose(got_params[group][name], net[group][name],
                                               **TOL, err_msg=(group, name))
            for name in ("kernel", "bias"):
                np.testing.assert_allclose(
                    got_params["method"]["adversarial_classifier"][name], adv[name], **TOL,
                    err_msg=("adversarial", name))
            if not hp["transfer_gda"]:
                for group, ref in (("featurizer", states["f"]), ("classifier", states["c"])):
                    adam = adam_state(got_state[group])
                    assert int(adam.count) == ref["t"], group
                    # the featurizer group is every network module but the classifier
                    mu, nu = ((adam.mu["featurizer"], adam.nu["featurizer"])
                              if group == "featurizer" else (adam.mu, adam.nu))
                    for name in ("kernel", "bias"):
                        np.testing.assert_allclose(mu[name], ref["m"][name], **TOL)
                        np.testing.assert_allclose(nu[name], ref["v"][name], rtol=2e-4,
                                                   atol=1e-9)
    return history, params, branches


@pytest.mark.parametrize("fix", [False, True])
def test_transfer_adam_steps_are_domainbeds(fix):
    """gda False: the featurizer's Adam steps twice a step, the classifier's once (count
    2t against t); the head ascends the gap inside the ball (both projection branches)."""
    history, _, branches = check_against_reference({**HP, "transfer_fix_optimizers": fix})
    assert any(branches) and not all(branches)
    last_state = history[-1][1]
    assert int(adam_state(last_state["featurizer"]).count) == 6
    assert int(adam_state(last_state["classifier"]).count) == 3


@pytest.mark.parametrize("fix", [False, True])
def test_transfer_gda_steps_are_domainbeds(fix):
    """gda True: DomainBed's SGD holds only the head, so the network never moves (the
    default); the fix steps it by SGD(lr) twice a step."""
    history, params, _ = check_against_reference({**HP, "transfer_gda": True,
                                                   "transfer_fix_optimizers": fix})
    moved = not np.allclose(history[-1][0]["featurizer"]["kernel"],
                            params["featurizer"]["kernel"])
    assert moved == fix


def test_projection_is_misc_proj():
    h = {"kernel": jnp.array([[1.0, 2.0]]), "bias": jnp.array([0.5, 0.0])}
    far = {"kernel": jnp.array([[4.0, 6.0]]), "bias": jnp.array([0.5, 0.0])}  # distance 5
    got = transfer.project(2.0, far, h)
    np.testing.assert_allclose(got["kernel"], [[1.0 + 0.4 * 3, 2.0 + 0.4 * 4]], rtol=1e-6)
    np.testing.assert_allclose(got["bias"], h["bias"])
    inside = transfer.project(5.0, far, h)  # dist <= delta: unchanged
    np.testing.assert_array_equal(inside["kernel"], far["kernel"])


def test_registry_entry_and_a_rotated_digits_run(tmp_path):
    rule = methods.update_rule("transfer")
    assert rule.kind == "procedure" and rule.network.init_from_network
    records = train.train_and_evaluate(
        digits_config(algorithm="transfer", transfer_d_steps_per_g=1, steps=2, eval_every=1),
        str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r[k]) for r in records for k in ("loss", "gap"))
    assert all(r["gap"] >= 0 for r in records)


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


@pytest.mark.parametrize("hparams_seed", [0, 4, 13])
def test_sweep_draws_transfers_hyperparameters_under_domainbeds_names(hparams_seed):
    """DomainBed's ``hparams_registry`` for Transfer on every dataset, under its names:
    gda's default is False but its draw always True."""
    got = random_hparams("transfer", "PACS", hparams_seed, 1)
    if hparams_seed == 0:
        want = {"transfer_t_lambda": 1.0, "transfer_delta": 2.0, "transfer_d_steps_per_g": 10,
                "transfer_weight_decay_d": 0.0, "transfer_gda": False, "transfer_beta1": 0.5,
                "transfer_lr_d": 1e-3}
    else:
        s = db_seed_hash(hparams_seed, 1)

        def draw(name):
            return np.random.RandomState(db_seed_hash(s, name))

        want = {"transfer_t_lambda": 10 ** draw("t_lambda").uniform(-2, 1),
                "transfer_delta": draw("delta").uniform(0.1, 3.0),
                "transfer_d_steps_per_g": int(draw("d_steps_per_g").choice([1, 2, 5])),
                "transfer_weight_decay_d": 10 ** draw("weight_decay_d").uniform(-6, -2),
                "transfer_gda": True,
                "transfer_beta1": draw("beta1").choice([0.0, 0.5]),
                "transfer_lr_d": 10 ** draw("lr_d").uniform(-4.5, -2.5)}
    assert {key: got[key] for key in want} == want
    assert "transfer_fix_optimizers" not in got  # no DomainBed draw: the config's value


def test_a_pack_keeps_the_inner_steps_and_traces_the_rest():
    """``transfer_d_steps_per_g`` sets the number of passes (a Python loop), so runs that
    differ in it are separate programs; the other numbers may differ within a pack."""
    from sagm_jax.training import packed

    base = {"algorithm": "transfer", "transfer_t_lambda": 1.0, "transfer_d_steps_per_g": 1}
    problems = packed.program_problems([base, {**base, "transfer_d_steps_per_g": 2}])
    assert len(problems) == 1 and "transfer_d_steps_per_g" in problems[0]
    assert packed.program_problems([base, {**base, "transfer_t_lambda": 0.1}]) == []


def test_every_pass_draws_its_own_dropout():
    """The reference's passes each draw a dropout mask: the whole batch's, one per domain
    for the gap step, one per domain for each inner step; here each its own key."""
    params, images, labels = make_problem()
    hp = {**HP, "transfer_d_steps_per_g": 2}
    procedure = procedures.make_procedure("transfer", hp, learning_rate=LR, weight_decay=WD,
                                          num_domains=M)
    keys = []

    def recording_forward_at(p, dropout_key):
        keys.append(dropout_key)
        return forward_at(p, dropout_key)

    def one(p, state, key):
        passes = procedures.BatchPasses(recording_forward_at, jnp.asarray(images),
                                        jnp.asarray(labels), M, jnp.int32(0))
        procedure.update(p, state, passes, key)
        return jnp.stack(keys)

    drawn = np.asarray(jax.jit(one)(params, procedure.init(params), jax.random.PRNGKey(5)))
    assert len(drawn) == 1 + M + 2 * M
    assert len({tuple(k) for k in drawn}) == len(drawn)
